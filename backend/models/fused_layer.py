"""A Llama-style layer's few-row forward (decode, verify blocks) through fused kernels.

``PreNormDecoderLayer`` computes ``h = x + o(attention(norm(x)))`` then ``h + mlp(norm(h))``
as ~26 graph nodes; at decode sizes each node's building and dispatch cost more than its
arithmetic, per layer and per token, for the target and a draft model alike. With the
layer's weights in kernel form (``use_cpu_kernels``: stacked q/k/v and gate/up products),
``FusedLayer`` runs it as four: ``kernels.attention_inputs`` (norm, q/k/v product, RoPE),
the cache's two buffer writes (``KVCache.append``, in place) and ``kernels.attention_mlp``
(attention reading the buffers in place, then everything after it). The kernels call the same
functions the separate ops call, so outputs are equal bit for bit (tests/test_fused_layers.py)
and a verify block still equals decode steps.

A batched step (``caches/segments.py``) takes the same four-node shape: every sequence's rows
stacked on the token axis, ``kernels.attention_inputs_segments`` rotates each sequence's rows
at its own positions and returns its keys and values apart, each cache appends its own, and
``kernels.attention_mlp_segments`` attends each sequence's rows to its own buffers. The
products are row-invariant, so each sequence's rows equal its rows alone, bit for bit; the
per-sequence graph nodes of the separate path (RoPE, slices, attention, joins) are gone, and
so is most of a batched step's cost beyond the products.

What it does not cover stays on the separate ops: biases, q/k norms, output gates, scaled
RoPE outputs, Gemma's offset norms, non-SwiGLU or mixture-of-experts MLPs, caches other than
a float32 full-attention ``KVCache`` (its sliding windows are masks: covered), more than
``kernels.MAX_KERNEL_ROWS`` rows (prefill), non-float32 activations.
"""

from __future__ import annotations

import mlx.core as mx

from backend import kernels
from backend.caches.base import Cache
from backend.caches.kv import KVCache
from backend.caches.segments import Segments
from backend.models.cpu_linear import KernelLinear, KernelQuantizedLinear, StackedProjections
from backend.models.layers import Attention, GatedMLP, RMSNorm

def kernel_weight(source) -> kernels.KernelWeight | None:
    """The matrix of a bias-free kernel linear layer or stacked projection, or None."""
    if isinstance(source, StackedProjections):
        if "bias" in source.stacked:
            return None
        w, first = source.stacked, source.layers[0]
        arrays = (w["weight"], w["scales"], w["biases"]) if source.quantized else (w["weight"],)
    elif isinstance(source, (KernelLinear, KernelQuantizedLinear)) and "bias" not in source:
        first = source
        arrays = ((source.weight, source.scales, source.biases)
                  if isinstance(source, KernelQuantizedLinear) else (source.weight,))
    else:
        return None
    if not isinstance(first, KernelQuantizedLinear):
        return kernels.KernelWeight(arrays)
    if not kernels.quantized_layout_supported(first.bits, first.group_size):
        return None
    return kernels.KernelWeight(arrays, first.bits, first.group_size, first.int8_inputs)


def _plain_norm(norm) -> bool:
    return type(norm) is RMSNorm and not norm.offset and norm.native_ops


class FusedLayer:
    """The fused few-row forward of one pre-norm layer; ``build`` says whether it applies."""

    def __init__(self, layer, qkv: kernels.KernelWeight, o: kernels.KernelWeight,
                 gate_up: kernels.KernelWeight, down: kernels.KernelWeight):
        self.layer = layer
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        # What the kernels take besides the activations and the cache, looked up once: each
        # module attribute is a walk through MLX's Module lookup, ~20 per layer and step.
        # (Like the stacked projections, built once the weights are loaded.)
        attn, rope = layer.self_attn, layer.self_attn.rope
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self._causal = attn.mask.kind == "causal"
        self._inputs = (norm1.weight, norm1.eps, qkv, attn.num_heads, attn.num_kv_heads,
                        attn.head_dim, rope.dims)
        self._rope = (rope.scale, rope._inverse_frequencies())
        self._attention = (attn.scale, attn.mask.window or 0)
        self._rest = (norm2.weight, norm2.eps, o, gate_up, down)

    @classmethod
    def build(cls, layer) -> "FusedLayer | None":
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention or type(mlp) is not GatedMLP:
            return None
        if not (attn.native_ops and mlp.native_ops and mlp.is_swiglu and attn.rope.native_ops
                and not attn.has_qk_norm and not attn.output_gate
                and attn.rope.out_scale == 1.0 and attn.stacked is not None
                and mlp.stacked is not None and _plain_norm(layer.input_layernorm)
                and _plain_norm(layer.post_attention_layernorm)):
            return None
        weights = [kernel_weight(w) for w in (attn.stacked, attn.o_proj, mlp.stacked,
                                              mlp.down_proj)]
        return None if None in weights else cls(layer, *weights)

    def __call__(self, x: mx.array, cache: Cache | Segments) -> mx.array | None:
        """The layer's output, or None where the fused kernels do not apply (then run the
        separate ops)."""
        if not self._causal or not kernels.fused_rows_apply(x):
            return None
        if isinstance(cache, Segments):
            return self._segments(x, cache)
        if not _fused_cache(cache):
            return None
        offset = cache.offset
        q, k, v = kernels.attention_inputs(x, *self._inputs, offset, *self._rope)
        cache.append(k, v)  # the attention reads the buffers in place: no history views
        return kernels.attention_mlp(q, cache.keys, cache.values, cache.offset,
                                     *self._attention, x, *self._rest)

    def _segments(self, x: mx.array, segments: Segments) -> mx.array | None:
        """Several sequences' rows (one batched step), each at its own cache."""
        caches = segments.caches
        if not all(_fused_cache(c) for c in caches):
            return None
        rows = segments.lengths
        q, *kv = kernels.attention_inputs_segments(x, *self._inputs, [c.offset for c in caches],
                                                   rows, *self._rope)
        for cache, k, v in zip(caches, kv[0::2], kv[1::2]):
            cache.append(k, v)
        return kernels.attention_mlp_segments(q, [c.keys for c in caches],
                                              [c.values for c in caches],
                                              [c.offset for c in caches], rows,
                                              *self._attention, x, *self._rest)


def _fused_cache(cache: Cache) -> bool:
    """A float32 full-attention cache at a known offset: what the kernels read in place."""
    return (type(cache) is KVCache and cache.holds_float32()
            and isinstance(cache.offset, int))

"""Gemma 4 text decoder (``gemma4_text``), also the language model of a multimodal ``gemma4``
checkpoint (whose vision and audio towers are not loaded: images are not supported).

Gemma 3's layout (sliding-window and global attention layers, four norms per layer, GeGLU,
embeddings scaled by ``sqrt(hidden)``, final logit soft-capping), plus:

* **Per-type attention shapes.** Sliding layers use ``head_dim`` and ``num_key_value_heads``;
  global (full-attention) layers use ``global_head_dim`` and, with ``attention_k_eq_v``,
  ``num_global_key_value_heads``. Attention is unscaled (``scale = 1``): q and k are RMS-normed
  per head (with a weight), v too (without one).
* **Proportional RoPE** on global layers (``rope_type: proportional``): only the first
  ``partial_rotary_factor`` of each head's rotate-half pairs turn (``models/rope.py``).
* **``attention_k_eq_v``** (global layers): one projection gives the keys and, before the key
  norm and RoPE, the values.
* **Shared keys and values.** The last ``num_kv_shared_layers`` layers compute no keys or
  values: each reads those of the last earlier layer of its attention type (its *source*), as
  that layer's cache returned them in the same forward. ``make_caches()`` therefore returns one
  cache per *computing* layer only, so the prefix cache stores, restores and pages those keys
  once; a shared layer runs over its source's ``KVHistory`` with its own queries. A shared layer
  with ``use_double_wide_mlp`` has an MLP twice ``intermediate_size`` wide.
* **Per-layer input embeddings** (``hidden_size_per_layer_input`` > 0): a second embedding
  table gives every token a small vector per layer, mixed with a projection of the scaled
  embedding; each layer gates its slice into the residual stream after its MLP.
* **MoE block** (``enable_moe_block``): beside the dense MLP, a routed mixture of GeGLU experts
  (RMS-normed, scaled router; softmax over the top-k logits times a per-expert scale), each
  branch with its own norms. Every layer ends by multiplying by its ``layer_scalar``.

Config defaults are transformers' ``Gemma4TextConfig``'s (no shared layers, no double-wide
MLP, no soft-capping, 4 kv heads, ``global_head_dim`` 512, a layer pattern of 5 sliding : 1
full); mlx-lm's own defaults differ for several of these. Published configs state them all.
``global_head_dim`` / ``num_global_key_value_heads`` may also come as transformers 5's
``per_layer_config`` (overrides per layer index).

Tensor names: ``model.*`` (text), ``model.language_model.*`` (Hugging Face multimodal) or
``language_model.model.*`` (mlx-community) become ``model.*``; the experts' fused
``experts.gate_up_proj`` is split; shared layers' unused key/value tensors are dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backend.caches.attention import scaled_dot_product_attention
from backend.caches.base import CAUSAL, Cache, KVHistory, sliding_window
from backend.caches.kv import KVCache
from backend.caches.rotating import RotatingKVCache
from backend.caches.segments import Segments, split_rows
from backend.errors import ConfigError
from backend.models.base import ZERO_ALLOWED, DecoderArgs, args_from_config, config_mapping, one_of
from backend.models.decoder import Backbone, DecoderModel, multimodal_text_name
from backend.models.gemma3 import (FULL, SLIDING, check_layer_types, rope_by_attention_type,
                                   soft_cap)
from backend.models.layers import ACTIVATIONS, GatedMLP, RMSNorm
from backend.models.moe import SwitchGLU, check_routing, stack_experts
from backend.models.rope import RoPE, RopeSettings

MODEL_TYPES = ("gemma4_text", "gemma4")

log = logging.getLogger(__name__)

#: RoPE per attention type when the config gives none (transformers' and mlx-lm's default).
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1000000.0}}

#: Towers and projectors of the multimodal checkpoints (with or without a ``model.`` prefix).
_OTHER_MODALITIES = ("vision_tower.", "embed_vision.", "multi_modal_projector.", "audio_tower.",
                     "embed_audio.", "vision_embedder.")
#: Tensors of a shared layer's attention that some checkpoints still carry; the layer has none.
_SHARED_LAYER_UNUSED = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.",
                        "self_attn.v_norm.")


@dataclass
class ModelArgs(DecoderArgs):
    head_dim: int = 256
    global_head_dim: int = 512
    num_key_value_heads: int = 4
    num_global_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    hidden_activation: str = field(default="gelu_pytorch_tanh", metadata=one_of(ACTIVATIONS))
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = field(default=256, metadata=ZERO_ALLOWED)  # 0: none
    vocab_size_per_layer_input: int = 262144
    num_kv_shared_layers: int = field(default=0, metadata=ZERO_ALLOWED)
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    global_rope: RopeSettings = field(default_factory=lambda: RopeSettings(1000000.0))
    local_rope: RopeSettings = field(default_factory=lambda: RopeSettings(10000.0))

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        """The language model's arguments: ``text_config`` when the config nests one (the
        multimodal ``gemma4`` checkpoints), else the config itself; ``model_type`` is the
        outer one."""
        text = dict(config_mapping(config, "text_config") or config)
        text["model_type"] = config.get("model_type")
        if text.get("tie_word_embeddings") is None and "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        if "hidden_size_per_layer_input" in text and text["hidden_size_per_layer_input"] is None:
            text["hidden_size_per_layer_input"] = 0  # null: no per-layer inputs (as mlx-lm)
        if text.get("use_bidirectional_attention"):
            raise ConfigError("bidirectional Gemma 4 attention (use_bidirectional_attention="
                              f"{text['use_bidirectional_attention']!r}) is not supported")
        if text.get("attention_bias"):
            raise ConfigError("attention_bias true is not supported (Gemma 4 projections have "
                              "no biases)")
        text.update(_global_overrides(text))
        block = config_mapping(text, "rope_parameters") or DEFAULT_ROPE
        global_rope, local_rope = rope_by_attention_type(block)
        args = args_from_config(cls, text, global_rope=global_rope, local_rope=local_rope)
        if args.layer_types is None:
            args.layer_types = [SLIDING if (i + 1) % args.sliding_window_pattern else FULL
                                for i in range(args.num_hidden_layers)]
        check_layer_types(args.layer_types, args.num_hidden_layers)
        for name in ("num_key_value_heads", "num_global_key_value_heads"):
            heads = getattr(args, name)
            if heads is not None and args.num_attention_heads % heads:
                raise ConfigError(f"num_attention_heads {args.num_attention_heads} is not a "
                                  f"multiple of {name} {heads}")
        kv_sources(args)  # every shared layer has a source
        if args.enable_moe_block:
            missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size")
                       if getattr(args, k) is None]
            if missing:
                raise ConfigError(f"enable_moe_block needs {', '.join(missing)}")
            check_routing(args.num_experts, args.top_k_experts)
        return args


def _global_overrides(text: dict[str, Any]) -> dict[str, Any]:
    """``global_head_dim`` / ``num_global_key_value_heads`` from transformers 5's
    ``per_layer_config`` (overrides by layer index, which it writes instead) when the config
    does not give them; the overrides must be the same for every full-attention layer."""
    per_layer = config_mapping(text, "per_layer_config")
    if not per_layer or "global_head_dim" in text:
        return {}
    layer_types = text.get("layer_types")
    if not isinstance(layer_types, list):
        raise ConfigError("per_layer_config needs layer_types")
    full = [str(i) for i, kind in enumerate(layer_types) if kind == FULL]
    overrides = {tuple(sorted(config_mapping(per_layer, i).items())) for i in full}
    if len(overrides) > 1 or set(per_layer) - set(full):
        raise ConfigError("per_layer_config must give every full-attention layer the same "
                          f"overrides and no other layer any, got {dict(per_layer)}")
    found = dict(overrides.pop()) if overrides else {}
    out = {"global_head_dim": found.get("head_dim", text.get("head_dim", 256))}
    if "num_key_value_heads" in found:
        out["num_global_key_value_heads"] = found["num_key_value_heads"]
    return out


def kv_sources(args: ModelArgs) -> list[int | None]:
    """For each layer, the layer whose keys and values it reads (None: it computes its own):
    each of the last ``num_kv_shared_layers`` layers reads the last computing layer of its
    attention type. ``ConfigError`` when a shared layer's type has no computing layer."""
    first_shared = args.num_hidden_layers - args.num_kv_shared_layers
    if first_shared < 1:
        raise ConfigError(f"num_kv_shared_layers {args.num_kv_shared_layers} leaves no layer of "
                          f"the {args.num_hidden_layers} computing keys and values")
    last_of_type = {kind: i for i, kind in enumerate(args.layer_types[:first_shared])}
    sources: list[int | None] = [None] * first_shared
    for i in range(first_shared, args.num_hidden_layers):
        kind = args.layer_types[i]
        if kind not in last_of_type:
            raise ConfigError(f"layer {i} shares the keys of an earlier {kind} layer, but "
                              f"none of the first {first_shared} layers is one")
        sources.append(last_of_type[kind])
    return sources


class ScalelessRMSNorm(nn.Module):
    """RMSNorm without a weight (Gemma 4's value norm, the router's input norm)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, None, self.eps)


class Attention(nn.Module):
    """Gemma 4 attention of one layer type; a shared layer (``computes_kv`` False) has only
    its query and output projections and attends over its source layer's history."""

    #: Decode-sized float32 attention through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False
    stacked = None  # the StackedProjections of ``stackable_projections``, when stacked

    def __init__(self, args: ModelArgs, layer_type: str, computes_kv: bool):
        super().__init__()
        full = layer_type == FULL
        self.head_dim = args.global_head_dim if full else args.head_dim
        self.num_heads = args.num_attention_heads
        self.k_is_v = args.attention_k_eq_v and full
        self.num_kv_heads = (args.num_global_key_value_heads
                             if self.k_is_v and args.num_global_key_value_heads
                             else args.num_key_value_heads)
        self.computes_kv = computes_kv
        hidden, width, eps = args.hidden_size, self.num_heads * self.head_dim, args.rms_norm_eps
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        if computes_kv:
            self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
            if not self.k_is_v:
                self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, eps)
            self.v_norm = ScalelessRMSNorm(eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.rope = RoPE(self.head_dim, args.global_rope if full else args.local_rope)
        self.mask = CAUSAL if full else sliding_window(args.sliding_window)

    @property
    def stackable_projections(self) -> tuple[str, ...]:
        """Projections of one input that ``use_cpu_kernels`` may stack into one matrix."""
        if not self.computes_kv:
            return ()
        return ("q_proj", "k_proj") if self.k_is_v else ("q_proj", "k_proj", "v_proj")

    def __call__(self, x: mx.array, cache: Cache | None,
                 shared: KVHistory | None) -> tuple[mx.array, KVHistory]:
        """``x`` (B, N, hidden) -> (output, the history attended over: the cache's, or
        ``shared``, the source layer's, for a shared layer)."""
        b, n, _ = x.shape
        if self.stacked is not None:
            q, k, *v = self.stacked(x)
        else:
            q = self.q_proj(x)
            if shared is None:
                k = self.k_proj(x)
                v = [] if self.k_is_v else [self.v_proj(x)]
        q = self.q_norm(q.reshape(b, n, self.num_heads, self.head_dim)).transpose(0, 2, 1, 3)
        if shared is None:
            k = k.reshape(b, n, self.num_kv_heads, self.head_dim)
            v = v[0].reshape(b, n, self.num_kv_heads, self.head_dim) if v else k
            k = self.k_norm(k).transpose(0, 2, 1, 3)
            v = self.v_norm(v).transpose(0, 2, 1, 3)  # (B, kv heads, N, D)
        else:
            k = v = None
        segments = cache if isinstance(cache, Segments) else \
            shared if isinstance(shared, SegmentHistories) else None
        if segments is None:
            out, history = self._attend(q, k, v, cache, shared)
        else:  # several sequences' rows: each attends to its own history
            split = lambda t: [None] * len(segments.lengths) if t is None else \
                split_rows(t, segments.lengths, axis=2)  # noqa: E731
            parts = [self._attend(qi, ki, vi, ci, si) for qi, ki, vi, ci, si in zip(
                split(q), split(k), split(v),
                cache.caches if cache is not None else [None] * len(segments.lengths),
                shared.histories if shared is not None else [None] * len(segments.lengths))]
            out = mx.concatenate([p[0] for p in parts], axis=2)
            history = SegmentHistories([p[1] for p in parts], segments.lengths)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1)), history

    def _attend(self, q: mx.array, k: mx.array | None, v: mx.array | None, cache: Cache | None,
                shared: KVHistory | None) -> tuple[mx.array, KVHistory]:
        """One sequence: its keys written (RoPE at its offset) or its source's history read,
        attention -> ((B, H, N, D), the history)."""
        if shared is None:
            offset = cache.offset
            history = cache.update(self.rope(k, offset), v)
        else:
            history, offset = shared, shared.query_start
        out = scaled_dot_product_attention(self.rope(q, offset), history, self.mask, 1.0,
                                           native=self.native_ops)
        return out, history


class SegmentHistories:
    """The histories a source layer's sequences attended over in one batched forward, for the
    layers that share its keys and values (one per sequence, in row order)."""

    def __init__(self, histories: list[KVHistory], lengths: list[int]) -> None:
        self.histories, self.lengths = histories, lengths


class Router(nn.Module):
    """Top-k expert choice: RMS-normed input scaled per channel and by ``hidden ** -0.5``, a
    projection to expert logits, softmax over the chosen k, times each expert's scale."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.top_k, self.eps = args.top_k_experts, args.rms_norm_eps
        self.root = args.hidden_size ** -0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``x`` (..., hidden) -> expert indices and weights, (..., k) each."""
        scores = self.proj(mx.fast.rms_norm(x, self.scale * self.root, self.eps))
        top = mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k:]
        weights = mx.softmax(mx.take_along_axis(scores, top, axis=-1), axis=-1)
        return top, weights * self.per_expert_scale[top]


class Experts(nn.Module):
    """The routed GeGLU experts, stacked (``switch_glu``), summed by the router's weights."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(args.hidden_size, args.moe_intermediate_size,
                                    args.num_experts, args.hidden_activation)

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        y = self.switch_glu(x, indices)  # (..., k, hidden)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str, kv_source: int | None,
                 cache_slot: int | None):
        super().__init__()
        self.is_sliding = layer_type == SLIDING
        self.kv_source = kv_source  # the layer whose keys and values this one reads, or None
        self.cache_slot = cache_slot  # its cache's index in make_caches(), or None (shared)
        self.self_attn = Attention(args, layer_type, computes_kv=kv_source is None)
        wide = args.use_double_wide_mlp and kv_source is not None
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size * (2 if wide else 1),
                            activation=args.hidden_activation)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.post_feedforward_layernorm = RMSNorm(d, eps)
        self.has_moe = args.enable_moe_block
        if self.has_moe:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = RMSNorm(d, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(d, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(d, eps)
        self.has_per_layer_input = args.hidden_size_per_layer_input > 0
        if self.has_per_layer_input:
            self.per_layer_input_gate = nn.Linear(d, args.hidden_size_per_layer_input,
                                                  bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, d,
                                                  bias=False)
            self.post_per_layer_input_norm = RMSNorm(d, eps)
        self.activation = ACTIVATIONS[args.hidden_activation]
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache: Cache | None, shared: KVHistory | None,
                 per_layer_input: mx.array | None) -> tuple[mx.array, KVHistory]:
        attended, history = self.self_attn(self.input_layernorm(x), cache, shared)
        h = x + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.has_moe:  # the dense MLP and the experts side by side, both from h
            indices, weights = self.router(h)
            experts = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
            out = (self.post_feedforward_layernorm_1(out)
                   + self.post_feedforward_layernorm_2(experts))
        h = h + self.post_feedforward_layernorm(out)
        if self.has_per_layer_input:  # per_layer_input: (B, N, hidden_size_per_layer_input)
            gate = self.activation(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar, history


class Gemma4Backbone(Backbone):
    """Embedding, per-layer inputs, the layers (shared ones over their sources' histories),
    final norm."""

    def __init__(self, args: ModelArgs, layers: list[DecoderLayer]):
        super().__init__(args, layers, embed_scale=args.hidden_size ** 0.5)
        self.num_layers = args.num_hidden_layers
        self.per_layer_width = args.hidden_size_per_layer_input
        if self.per_layer_width:
            width = self.num_layers * self.per_layer_width
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.per_layer_width, args.rms_norm_eps)
        self.projection_scale = args.hidden_size ** -0.5
        self.sources = {layer.kv_source for layer in layers} - {None}

    def per_layer_inputs(self, tokens: mx.array, h: mx.array) -> mx.array:
        """(B, N, layers, width): each token's own per-layer embedding mixed with a projection
        of its scaled embedding ``h``."""
        shape = (*tokens.shape, self.num_layers, self.per_layer_width)
        own = self.embed_tokens_per_layer(tokens) * self.per_layer_width ** 0.5
        mixed = self.per_layer_model_projection(h) * self.projection_scale
        mixed = self.per_layer_projection_norm(mixed.reshape(shape))
        return (mixed + own.reshape(shape)) * 2 ** -0.5

    def __call__(self, tokens: mx.array, caches: list[Cache]) -> mx.array:
        h = self.embed(tokens)
        per_layer = self.per_layer_inputs(tokens, h) if self.per_layer_width else None
        histories: dict[int, KVHistory] = {}  # the sources' histories of this forward
        kept = []  # what a block drafter reads (``capture``)
        for i, layer in enumerate(self.layers):
            cache = None if layer.cache_slot is None else caches[layer.cache_slot]
            shared = None if layer.kv_source is None else histories[layer.kv_source]
            h, history = layer(h, cache, shared,
                               None if per_layer is None else per_layer[:, :, i])
            if i in self.sources:
                histories[i] = history
            if i in self._capture:
                kept.append(h)
        self.keep_captured(kept)
        return self.norm(h)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        layers, slots = [], 0
        for kind, source in zip(args.layer_types, kv_sources(args)):
            layers.append(DecoderLayer(args, kind, source, slots if source is None else None))
            slots += source is None
        super().__init__(args, Gemma4Backbone(args, layers))

    def logits(self, hidden: mx.array) -> mx.array:
        return soft_cap(super().logits(hidden), self.args.final_logit_softcapping)

    def make_caches(self) -> list[Cache]:
        """One cache per layer that computes keys and values (shared layers read their
        source's): a ring of ``sliding_window`` slots for sliding layers, else a ``KVCache``."""
        return [RotatingKVCache(self.args.sliding_window) if layer.is_sliding else KVCache()
                for layer in self.model.layers if layer.cache_slot is not None]

    def shared_key_caches(self, caches: list[Cache]) -> dict[str, Cache]:
        """Of this model's ``caches`` (``make_caches``), the one of the last layer computing its
        own keys and values per attention type: what the Gemma 4 assistant reads."""
        last: dict[str, Cache] = {}
        for layer in self.model.layers:
            if layer.cache_slot is not None:
                last[SLIDING if layer.is_sliding else FULL] = caches[layer.cache_slot]
        return last

    def parameter_name(self, checkpoint_name: str) -> str | None:
        return multimodal_text_name(checkpoint_name, _OTHER_MODALITIES)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The language model's tensors under this tree's names: other modalities dropped
        (one logged line), shared layers' key/value tensors dropped, experts split and
        stacked; then the shared decoder's sanitize."""
        renamed, others = self.renamed_weights(weights)
        unused = tuple(f"model.layers.{i}.{name}" for i, layer in enumerate(self.model.layers)
                       if layer.kv_source is not None for name in _SHARED_LAYER_UNUSED)
        renamed = {k: v for k, v in renamed.items() if not k.startswith(unused)}
        if others:
            log.warning("images and audio are not supported: the checkpoint's vision/audio "
                        "towers (%d tensors) are not loaded, only its language model", others)
        if self.args.enable_moe_block:
            for i in range(self.args.num_hidden_layers):
                renamed = stack_experts(renamed, f"model.layers.{i}", self.args.num_experts,
                                        source="experts", target="experts.switch_glu")
        return super().sanitize(renamed)

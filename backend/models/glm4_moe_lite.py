"""GLM-4.7-Flash (``glm4_moe_lite``): multi-head latent attention and a group-limited MoE.

Attention (MLA, as in DeepSeek-V2/V3). Queries come through a low-rank pair (``q_a_proj`` ->
RMSNorm -> ``q_b_proj``, or one ``q_proj`` without ``q_lora_rank``); each head's query is
``[q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)]``. Keys and values come from one
compressed latent per token: ``kv_a_proj_with_mqa`` gives ``[latent (kv_lora_rank) | k_rope]``,
the latent is RMS-normed, ``k_rope`` is rotated and shared by every head. Head ``h``'s key is
``[W_UK[h] latent | k_rope]`` and its value ``W_UV[h] latent`` (the checkpoint's
``kv_b_proj``, split per head into ``embed_q`` = W_UK and ``unembed_out`` = W_UV as mlx-lm
names them). The cache (``caches/latent.py``) holds only the latent and ``k_rope``.

* Absorbed form (decode steps, verify blocks and short writes): ``q_nope`` is absorbed into the
  latent space (``W_UK[h]^T q_nope``), so a query scores a position with one dot product against
  the cached entry and its output stays in the latent space until ``W_UV[h]`` maps it to the
  head's values: no per-head key or value is ever built. All heads share the one latent "kv
  head", which the CPU attention kernel runs as grouped-query attention, each query reduced over
  exactly its visible positions (row invariance: a verify block equals its one-token steps bit
  for bit). The per-head products go through ``gather_mm`` (a matrix-vector product per token
  and head, computed alike however many tokens a write has).
* Expanded form (prefill chunks longer than ``ABSORBED_MAX_QUERIES``): the cached latents are
  expanded into per-head keys and values and attended as ordinary multi-head attention, which
  costs fewer multiply-adds per query once a chunk has many of them (head dims 192 + 64 and 256
  against the absorbed 512 + 64 and 512). Results agree with the absorbed form within float32
  rounding.

RoPE: checkpoints rotate interleaved pairs (``rope_interleave``, mlx-lm's ``traditional``);
``sanitize`` reorders the rotary rows of the query and latent projections to the split-half
layout (even dims first, then odd) so the shared ``RoPE`` and the native kernel apply. Queries
and keys are permuted alike, so every score is unchanged.

MoE (layers from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th; or as
``mlp_layer_types`` says): a sigmoid router with a per-expert ``e_score_correction_bias`` that
only chooses (noaux_tc), limited to the ``topk_group`` best of ``n_group`` expert groups (a
group's score is its two best experts), weights from the unbiased sigmoid scores, normalised
(``norm_topk_prob``) and scaled by ``routed_scaling_factor``; plus ``n_shared_experts`` always-on
shared experts (one gated MLP). Dense layers: a gated MLP of ``intermediate_size``.

References differ in two details; Arbor follows the config and mlx-lm where they do: the latent
and query-latent norms use ``rms_norm_eps`` (transformers always uses 1e-6 there), and router
weights are normalised whenever ``norm_topk_prob`` is set (mlx-lm skips it for a top-1 router).
Masked-out expert groups cannot be chosen (transformers; mlx-lm zeroes their scores instead).

Checkpoints: Hugging Face (``kv_b_proj``, per-expert tensors, the MTP layer(s) stored as
``model.layers.{num_hidden_layers}+`` and dropped here) and mlx-community (mlx-lm's
``embed_q`` / ``unembed_out`` and stacked ``switch_mlp``, quantized or not) both load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from backend import kernels
from backend.caches.attention import scaled_dot_product_attention
from backend.caches.base import CAUSAL, Cache
from backend.caches.kv import ContiguousHistory
from backend.caches.segments import Segments
from backend.caches.latent import LatentCache
from backend.errors import CheckpointError, ConfigError
from backend.models.base import ZERO_ALLOWED, args_from_config, config_mapping, one_of
from backend.models.decoder import Backbone, DecoderModel, PreNormDecoderLayer
from backend.models.layers import ACTIVATIONS, GatedMLP, RMSNorm
from backend.models.moe import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, check_routing, \
    layer_mlp, stack_experts
from backend.models.rope import RoPE, RopeSettings, rope_settings

MODEL_TYPES = ("glm4_moe_lite",)

#: Writes of at most this many tokens attend in the absorbed form; longer ones expand the
#: latents into per-head keys and values. As many as ``kernels.MAX_ATTENTION_QUERIES``, so decode
#: steps, verify blocks and exact-prefill chunks are alike row by row.
ABSORBED_MAX_QUERIES = kernels.MAX_ATTENTION_QUERIES

DENSE, SPARSE = "dense", "sparse"


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj
    n_routed_experts: int = field(default=0, metadata=ZERO_ALLOWED)  # 0: dense MLPs only
    n_shared_experts: int = field(default=0, metadata=ZERO_ALLOWED)
    moe_intermediate_size: int = field(default=0, metadata=ZERO_ALLOWED)
    num_experts_per_tok: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    topk_method: str = field(default="noaux_tc", metadata=one_of(("noaux_tc",)))
    scoring_func: str = field(default="sigmoid", metadata=one_of(("sigmoid",)))
    first_k_dense_replace: int = field(default=0, metadata=ZERO_ALLOWED)
    moe_layer_freq: int = 1
    mlp_layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_interleave: bool = True
    hidden_act: str = field(default="silu", metadata=one_of(ACTIVATIONS))
    rope: RopeSettings = field(default_factory=lambda: RopeSettings(1000000.0))

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        block = config_mapping(config, "rope_parameters")
        factor = config.get("partial_rotary_factor", block.get("partial_rotary_factor", 1.0))
        if factor != 1.0:
            raise ConfigError(f"partial_rotary_factor {factor!r} is not supported (the rotary "
                              "part of each head is qk_rope_head_dim)")
        config = {**config, "n_routed_experts": config.get("n_routed_experts") or 0,
                  "n_shared_experts": config.get("n_shared_experts") or 0}
        args = args_from_config(cls, config, rope=rope_settings(config, 1000000.0))
        if args.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim {args.qk_rope_head_dim} is odd: rotary "
                              "dims come in pairs")
        if args.mlp_layer_types is None:
            args.mlp_layer_types = [
                SPARSE if (args.n_routed_experts and i >= args.first_k_dense_replace
                           and i % args.moe_layer_freq == 0) else DENSE
                for i in range(args.num_hidden_layers)]
        if len(args.mlp_layer_types) != args.num_hidden_layers or not set(
                args.mlp_layer_types) <= {DENSE, SPARSE}:
            raise ConfigError(f"mlp_layer_types {args.mlp_layer_types} does not describe "
                              f"{args.num_hidden_layers} dense/sparse layers")
        if SPARSE in args.mlp_layer_types:
            args.check_routing()
        return args

    def check_routing(self) -> None:
        experts, groups = self.n_routed_experts, self.n_group
        if not experts or not self.moe_intermediate_size:
            raise ConfigError("sparse layers need n_routed_experts and moe_intermediate_size")
        check_routing(experts, self.num_experts_per_tok)
        if experts % groups or self.topk_group > groups:
            raise ConfigError(f"n_routed_experts {experts} do not split into n_group {groups} "
                              f"groups of which topk_group {self.topk_group} are kept")
        if groups > 1 and experts // groups < 2:
            raise ConfigError(f"n_group {groups} leaves fewer than two experts per group (a "
                              "group is scored by its two best)")
        if self.num_experts_per_tok > self.topk_group * (experts // groups):
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} is more than "
                              f"the {self.topk_group} kept groups hold")

    def is_sparse(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE

    @property
    def query_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention_scale(self) -> float:
        """``query_head_dim ** -0.5``, times yarn's ``mscale_all_dim`` correction squared."""
        scale = self.query_head_dim ** -0.5
        p = self.rope.params
        if self.rope.kind == "yarn" and p.get("mscale_all_dim") and p["factor"] > 1:
            mscale = 0.1 * p["mscale_all_dim"] * math.log(p["factor"]) + 1.0
            scale *= mscale * mscale
        return scale


def head_weights(layer: SwitchLinear | QuantizedSwitchLinear) -> mx.array:
    """The ``(heads, out, in)`` matrices of a per-head projection, as floating point (a
    quantized one dequantized through the native kernel when it applies)."""
    if isinstance(layer, QuantizedSwitchLinear):
        heads, out, packed = layer.weight.shape
        flat = kernels.dequantize(layer.weight.reshape(heads * out, packed),
                                  layer.scales.reshape(heads * out, -1),
                                  layer.biases.reshape(heads * out, -1),
                                  layer.group_size, layer.bits)
        return flat.reshape(heads, out, -1)
    return layer.weight


class LatentAttention(nn.Module):
    """Multi-head latent attention over a ``LatentCache`` (module docstring)."""

    #: Decode-sized float32 attention through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False
    stacked = None  # the two input projections stacked, when ``use_cpu_kernels`` can

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.num_attention_heads, args.hidden_size
        self.num_heads = h
        self.nope, self.rope_dims = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.latent_dims, self.v_head_dim = args.kv_lora_rank, args.v_head_dim
        self.query_head_dim = args.query_head_dim
        self.scale = args.attention_scale
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * self.query_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = nn.Linear(args.q_lora_rank, h * self.query_head_dim, bias=False)
        self.low_rank_queries = args.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(d, self.latent_dims + self.rope_dims,
                                            bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dims, args.rms_norm_eps)
        self.embed_q = SwitchLinear(self.nope, self.latent_dims, h)  # W_UK^T per head
        self.unembed_out = SwitchLinear(self.latent_dims, self.v_head_dim, h)  # W_UV per head
        self.o_proj = nn.Linear(h * self.v_head_dim, d, bias=args.attention_bias)
        self.rope = RoPE(self.rope_dims, args.rope)
        self._heads = mx.arange(h)  # every head's own matrix in the per-head products

    @property
    def stackable_projections(self) -> tuple[str, str]:
        """Projections of one input that ``use_cpu_kernels`` may stack into one matrix."""
        return ("q_a_proj" if self.low_rank_queries else "q_proj", "kv_a_proj_with_mqa")

    def __call__(self, x: mx.array, cache: LatentCache) -> mx.array:
        b, n, _ = x.shape  # x: (B, N, hidden)
        if self.stacked is not None:
            q, compressed = self.stacked(x)
        else:
            q = self.q_a_proj(x) if self.low_rank_queries else self.q_proj(x)
            compressed = self.kv_a_proj_with_mqa(x)  # (B, N, latent + rope)
        if self.low_rank_queries:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(b, n, self.num_heads, self.query_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_rope = mx.split(q, [self.nope], axis=-1)  # (B, H, N, nope | rope)
        latent = self.kv_a_layernorm(compressed[..., : self.latent_dims])  # (B, N, latent)
        latent = latent.reshape(b, 1, n, self.latent_dims)
        k_rope = compressed[..., self.latent_dims:].reshape(b, 1, n, self.rope_dims)
        if isinstance(cache, Segments):  # several sequences' rows: each attends to its own
            out = cache.map(self._attend, (q_nope, q_rope, latent, k_rope), axis=2)
        else:
            out = self._attend(q_nope, q_rope, latent, k_rope, cache)
        b, h, n, v = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, h * v))

    def _attend(self, q_nope: mx.array, q_rope: mx.array, latent: mx.array, k_rope: mx.array,
                cache: LatentCache) -> mx.array:
        """One sequence: RoPE at its cache's offset, the latent written, attention (absorbed
        for a few queries, expanded for a prefill chunk) -> (B, H, N, v_head_dim)."""
        offset = cache.offset
        q_rope, k_rope = self.rope(q_rope, offset), self.rope(k_rope, offset)
        history = cache.update(latent, k_rope)
        b, h, n, _ = q_nope.shape
        if n <= ABSORBED_MAX_QUERIES:
            out = self._absorbed(q_nope, q_rope, history)
        else:
            out = self._expanded(q_nope, q_rope, history)
        return out.reshape(b, n, h, self.v_head_dim).transpose(0, 2, 1, 3)

    def _absorbed(self, q_nope: mx.array, q_rope: mx.array,
                  history: ContiguousHistory) -> mx.array:
        b, h, n, _ = q_nope.shape
        # W_UK[h]^T q_nope per token and head: (B, N, H, 1, nope) -> (B, N, H, 1, latent)
        q_latent = self.embed_q(mx.expand_dims(q_nope.transpose(0, 2, 1, 3), -2), self._heads)
        queries = mx.concatenate([q_latent.squeeze(-2).transpose(0, 2, 1, 3), q_rope], axis=-1)
        out = scaled_dot_product_attention(queries, history, CAUSAL, self.scale,
                                           native=self.native_ops)  # (B, H, N, latent)
        out = self.unembed_out(mx.expand_dims(out.transpose(0, 2, 1, 3), -2), self._heads)
        return out.reshape(b, n, h * self.v_head_dim)  # (B, N, H, 1, v) -> (B, N, H * v)

    def _expanded(self, q_nope: mx.array, q_rope: mx.array,
                  history: ContiguousHistory) -> mx.array:
        b, h, n, _ = q_nope.shape
        latent = history.values  # (B, 1, S, latent)
        s = latent.shape[2]
        k_rope = history.keys[..., self.latent_dims:]  # (B, 1, S, rope)
        k_nope = latent @ head_weights(self.embed_q)  # (H, latent, nope) -> (B, H, S, nope)
        values = latent @ head_weights(self.unembed_out).swapaxes(-1, -2)  # (B, H, S, v)
        keys = mx.concatenate(
            [k_nope, mx.broadcast_to(k_rope, (b, h, s, self.rope_dims))], axis=-1)
        expanded = ContiguousHistory(keys, values, history.query_start, history.num_queries,
                                     history.key_start)
        out = scaled_dot_product_attention(mx.concatenate([q_nope, q_rope], axis=-1), expanded,
                                           CAUSAL, self.scale, native=self.native_ops)
        return out.transpose(0, 2, 1, 3).reshape(b, n, h * self.v_head_dim)


class GroupLimitedRouter(nn.Module):
    """The noaux_tc router: sigmoid scores; experts chosen by score + ``e_score_correction_bias``
    among the ``topk_group`` best of ``n_group`` groups; weights from the unbiased scores."""

    #: The router's product through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        experts = args.n_routed_experts
        self.weight = mx.zeros((experts, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((experts,))
        self.top_k, self.n_group, self.topk_group = (args.num_experts_per_tok, args.n_group,
                                                     args.topk_group)
        self.norm_topk_prob = args.norm_topk_prob
        self.scaling = args.routed_scaling_factor

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``x`` (..., D) -> expert indices and their weights, each (..., top_k)."""
        logits = kernels.linear(x, self.weight) if self.native_ops else x @ self.weight.T
        scores = mx.sigmoid(logits.astype(mx.float32))  # (..., E)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if self.n_group > 1:
            lead = choice.shape[:-1]
            groups = choice.reshape(*lead, self.n_group, -1)  # (..., G, E / G)
            group_scores = mx.topk(groups, 2, axis=-1).sum(axis=-1, keepdims=True)  # (..., G, 1)
            dropped = self.n_group - self.topk_group
            worst = mx.argpartition(group_scores, kth=dropped - 1, axis=-2)[..., :dropped, :]
            groups = mx.put_along_axis(groups, worst, mx.array(-mx.inf, mx.float32), axis=-2)
            choice = groups.reshape(*lead, -1)
        top = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(scores, top, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return top, weights * self.scaling


class LatentMoE(nn.Module):
    """Routed experts (stacked, ``moe.SwitchGLU``) plus the always-on shared experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = GroupLimitedRouter(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size,
                                    args.n_routed_experts, args.hidden_act)
        self.has_shared = args.n_shared_experts > 0
        if self.has_shared:
            self.shared_experts = GatedMLP(
                args.hidden_size, args.moe_intermediate_size * args.n_shared_experts,
                activation=args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        top, weights = self.gate(x)  # (B, N, k)
        y = self.switch_mlp(x, top)  # (B, N, k, D)
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        return y + self.shared_experts(x) if self.has_shared else y


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.self_attn = LatentAttention(args)
        self.mlp = layer_mlp(args, index, lambda: LatentMoE(args))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args, Backbone(args, [DecoderLayer(args, i)
                                               for i in range(args.num_hidden_layers)]))

    def make_caches(self) -> list[Cache]:
        return [LatentCache(self.args.kv_lora_rank) for _ in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        a = self.args
        weights = {k: v for k, v in weights.items() if not _is_prediction_layer(k, a)}
        for i in range(a.num_hidden_layers):
            prefix = f"model.layers.{i}"
            if a.is_sparse(i):
                weights = stack_experts(weights, f"{prefix}.mlp", a.n_routed_experts)
                _dequantize_in_place(weights, f"{prefix}.mlp.gate", a.hidden_size)
            _split_kv_b(weights, f"{prefix}.self_attn", a)
            if a.rope_interleave:
                _rope_rows_split_half(weights, f"{prefix}.self_attn", a)
        return weights


def _is_prediction_layer(name: str, args: ModelArgs) -> bool:
    """``model.layers.N.*`` with N >= num_hidden_layers: the checkpoint's multi-token-prediction
    layer(s) (``num_nextn_predict_layers``), which this model does not run."""
    parts = name.split(".")
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= args.num_hidden_layers)


def _dequantize_in_place(weights: dict[str, mx.array], module: str, inputs: int) -> None:
    """Replace a quantized ``module`` (``weight``/``scales``/``biases``) by its float weight
    (bits and group size read off the shapes, as mlx-lm does). The router and ``kv_b_proj``
    are used as float matrices: an import that quantized every 2-D weight reaches here."""
    if f"{module}.scales" not in weights:
        return
    packed = weights.pop(f"{module}.weight")
    scales = weights.pop(f"{module}.scales")
    biases = weights.pop(f"{module}.biases", None)
    if biases is None or packed.dtype != mx.uint32 or scales.shape[-1] == 0:
        raise CheckpointError(f"{module} is not in MLX's affine quantized layout")
    bits, group_size = packed.shape[-1] * 32 // inputs, inputs // scales.shape[-1]
    weights[f"{module}.weight"] = mx.dequantize(packed, scales, biases, group_size, bits)


def _split_kv_b(weights: dict[str, mx.array], attn: str, a: ModelArgs) -> None:
    """Hugging Face's ``kv_b_proj`` ``(H * (nope + v), latent)`` -> per head ``embed_q``
    ``(H, latent, nope)`` (W_UK transposed) and ``unembed_out`` ``(H, v, latent)`` (W_UV)."""
    name = f"{attn}.kv_b_proj"
    if f"{name}.weight" not in weights:
        return
    _dequantize_in_place(weights, name, a.kv_lora_rank)
    w = weights.pop(f"{name}.weight")
    rows = a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
    if tuple(w.shape) != (rows, a.kv_lora_rank):
        raise CheckpointError(f"tensor {name}.weight has shape {list(w.shape)}, the config "
                              f"needs {[rows, a.kv_lora_rank]}")
    w = w.reshape(a.num_attention_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
    weights[f"{attn}.embed_q.weight"] = mx.contiguous(
        w[:, : a.qk_nope_head_dim].swapaxes(-1, -2))
    weights[f"{attn}.unembed_out.weight"] = mx.contiguous(w[:, a.qk_nope_head_dim:])


def _rope_rows_split_half(weights: dict[str, mx.array], attn: str, a: ModelArgs) -> None:
    """Reorder the rotary output rows of the query and latent projections from interleaved
    pairs ``(0, 1), (2, 3), ...`` to split halves ``(0, 2, ... | 1, 3, ...)`` (module
    docstring). Quantized layers' scales and biases are per row and move with their rows."""
    r = a.qk_rope_head_dim
    pairs = list(range(0, r, 2)) + list(range(1, r, 2))
    head = list(range(a.qk_nope_head_dim)) + [a.qk_nope_head_dim + i for i in pairs]
    query = [h * a.query_head_dim + i for h in range(a.num_attention_heads) for i in head]
    latent = list(range(a.kv_lora_rank)) + [a.kv_lora_rank + i for i in pairs]
    query_module = f"{attn}.q_b_proj" if a.q_lora_rank is not None else f"{attn}.q_proj"
    for module, order in ((query_module, query), (f"{attn}.kv_a_proj_with_mqa", latent)):
        rows = mx.array(order)
        for suffix in ("weight", "scales", "biases", "bias"):
            key = f"{module}.{suffix}"
            if key not in weights:
                continue
            if weights[key].shape[0] != len(order):
                raise CheckpointError(f"tensor {key} has shape {list(weights[key].shape)}, the "
                                      f"config needs {len(order)} rows")
            weights[key] = weights[key][rows]

"""Qwen3-Next: a hybrid of gated-delta linear attention and gated full attention, with MoE.

Layer mix (``layer_types``, or every ``full_attention_interval``-th layer full):

* ``linear_attention`` — ``GatedDeltaNet`` on a ``RecurrentCache``: one projection gives q, k, v
  and the output gate z, another the per-head beta/decay inputs; the rest (conv, the gated delta
  rule, the gated norm) is the mixer shared with Qwen3.5 (``gated_delta.py``).
* ``full_attention`` — standard attention on a ``KVCache`` whose q projection also emits a
  per-head sigmoid output gate, with (1 + w) q/k RMSNorms and partial rotary embeddings
  (``partial_rotary_factor`` of each head).
* MLP — sparse MoE with a sigmoid-gated shared expert (``moe.py``) on the layers selected by
  ``decoder_sparse_step`` / ``mlp_only_layers``, a dense gated MLP elsewhere.

Checkpoints: Hugging Face (per-expert tensors, conv weight ``(C, 1, K)``, norms stored as ``w``
of ``(1 + w)``) and mlx-lm (stacked ``switch_mlp``, conv weight ``(C, K, 1)``, norms stored as
``1 + w``) both load; ``sanitize`` tells them apart by the conv weight's layout.

Multi-token prediction: a Hugging Face checkpoint may ship ``mtp.*`` tensors (config
``mtp_num_hidden_layers``, or ``num_nextn_predict_layers``). ``sanitize`` then adds ``MTPHead``
as ``self.mtp``: ``fc(concat(pre_fc_norm_embedding(embed(token t + 1)),
pre_fc_norm_hidden(h_t)))`` -> full-attention decoder layer(s) on their own ``HeadCache`` ->
``norm``, scored by the shared ``lm_head``. ``h_t`` is the target's final *normed* hidden state
(what ``hidden()`` returns and ``lm_head`` scores): that is what vLLM and SGLang feed
Qwen3-Next's head, and measured acceptance is higher with it than with the pre-norm residual.
Several layers run as a stack. The
mlx-lm layout never carries the head (mlx-lm strips it; tensors in that layout would be of an
unknown norm convention), so there ``mtp.*`` is dropped, as it is when absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from backend.caches.base import Cache
from backend.caches.kv import ContiguousHistory, KVCache
from backend.caches.recurrent import RecurrentCache
from backend.errors import CheckpointError, ConfigError
from backend.models.base import (
    ZERO_ALLOWED,
    args_from_config,
    complete_attention_heads,
    config_mapping,
    one_of,
)
from backend.models.decoder import Backbone, DecoderModel
from backend.models.gated_delta import GatedDeltaMixer
from backend.models.layers import ACTIVATIONS, Attention, AttentionShape, RMSNorm
from backend.models.moe import SparseMoE, check_routing, is_sparse_layer, layer_mlp, \
    stack_experts
from backend.models.rope import RoPE, RopeSettings, rope_settings

MODEL_TYPES = ("qwen3_next",)

LINEAR, FULL = "linear_attention", "full_attention"

#: Norms stored as (1 + w) by mlx-lm's conversion (and as w by Hugging Face).
_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                 "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    # Dense MLP width; a model whose every MLP is sparse (Qwen3.5-MoE) gives none.
    intermediate_size: int = field(default=0, metadata=ZERO_ALLOWED)
    num_experts: int = field(default=0, metadata=ZERO_ALLOWED)  # 0: dense MLPs only
    num_experts_per_tok: int = 1
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = field(default=0, metadata=ZERO_ALLOWED)
    shared_expert_intermediate_size: int | None = field(default=None, metadata=ZERO_ALLOWED)
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = True
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = field(default="silu", metadata=one_of(ACTIVATIONS))
    rope: RopeSettings = field(default_factory=lambda: RopeSettings(10000.0))
    # Layers of the multi-token-prediction head, when the checkpoint ships one (0: as many as
    # its ``mtp.layers.N`` tensors hold).
    mtp_num_hidden_layers: int = field(default=0, metadata=ZERO_ALLOWED)

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        block = config_mapping(config, "rope_parameters")
        factor = config.get("partial_rotary_factor", block.get("partial_rotary_factor", 0.25))
        mtp = {} if config.get("mtp_num_hidden_layers") is not None else {  # DeepSeek's name
            "mtp_num_hidden_layers": config.get("num_nextn_predict_layers") or 0}
        args = args_from_config(cls, config, rope=rope_settings(config, 10000.0),
                                partial_rotary_factor=factor, **mtp)
        complete_attention_heads(args)
        rotary = args.head_dim * args.partial_rotary_factor
        if args.partial_rotary_factor > 1 or int(rotary) < 2 or int(rotary) % 2:
            raise ConfigError(f"partial_rotary_factor {args.partial_rotary_factor} of head_dim "
                              f"{args.head_dim} does not give an even number of rotary dims")
        if args.layer_types is None:
            args.layer_types = [FULL if (i + 1) % args.full_attention_interval == 0 else LINEAR
                                for i in range(args.num_hidden_layers)]
        if len(args.layer_types) != args.num_hidden_layers or not set(args.layer_types) <= {
                LINEAR, FULL}:
            raise ConfigError(f"layer_types {args.layer_types} does not describe "
                              f"{args.num_hidden_layers} linear/full attention layers")
        if args.linear_num_value_heads % args.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads {args.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {args.linear_num_key_heads}")
        if args.num_experts:
            check_routing(args.num_experts, args.num_experts_per_tok)
            if not args.moe_intermediate_size:
                raise ConfigError("moe_intermediate_size must be a positive integer when "
                                  f"num_experts is {args.num_experts}")
        dense = [i for i in range(args.num_hidden_layers) if not args.is_sparse(i)]
        if dense and not args.intermediate_size:
            raise ConfigError(f"intermediate_size must be a positive integer: layer {dense[0]} "
                              "has a dense MLP")
        return args

    def is_sparse(self, layer: int) -> bool:
        return is_sparse_layer(layer, self.mlp_only_layers, self.num_experts,
                               self.decoder_sparse_step)


class GatedDeltaNet(GatedDeltaMixer):
    """The gated-delta mixer with Qwen3-Next's fused projections: ``in_proj_qkvz`` and
    ``in_proj_ba`` (rows regrouped by kind in ``sanitize``)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.in_proj_qkvz = nn.Linear(args.hidden_size, 2 * self.key_dim + 2 * self.value_dim,
                                      bias=False)
        self.in_proj_ba = nn.Linear(args.hidden_size, 2 * self.num_v_heads, bias=False)

    def _split_projections(self, x: mx.array
                           ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        b, n, _ = x.shape
        qkvz = self.in_proj_qkvz(x)  # [q | k | v | z] (rows reordered by sanitize)
        mixed = qkvz[..., :self.conv_dim]  # (B, N, conv_dim): what the conv sees
        z = qkvz[..., self.conv_dim:].reshape(b, n, self.num_v_heads, self.head_v_dim)
        beta_in, decay_in = mx.split(self.in_proj_ba(x), 2, axis=-1)  # [b | a], (B, N, Hv) each
        return mixed, z, beta_in, decay_in


class DecoderLayer(nn.Module):
    #: The gated-delta mixer of the linear-attention layers (its projection layout).
    linear_mixer: type[GatedDeltaMixer] = GatedDeltaNet

    def __init__(self, args: ModelArgs, index: int, full_attention: bool = False):
        super().__init__()
        self.is_linear = not full_attention and args.layer_types[index] == LINEAR
        if self.is_linear:
            self.linear_attn = self.linear_mixer(args)
        else:
            shape = AttentionShape.from_args(
                args, qk_norm_eps=args.rms_norm_eps, qk_norm_offset=1.0, output_gate=True)
            rotary = int(args.head_dim * args.partial_rotary_factor)
            self.self_attn = Attention(shape, RoPE(rotary, args.rope))
        self.mlp = layer_mlp(args, index, lambda: SparseMoE(
            args.hidden_size, args.moe_intermediate_size, args.num_experts,
            args.num_experts_per_tok, args.norm_topk_prob,
            args.shared_expert_intermediate_size or None, args.hidden_act))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, offset=1.0)

    def __call__(self, x: mx.array, cache: Cache) -> mx.array:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class HeadCache(KVCache):
    """The MTP head's KV cache. Slot p pairs token p with the target's hidden at p - 1 (so the
    head's cache sits at the target's offset and the prefix cache stores both alike); token 0
    has no hidden before it, so slot 0 pairs nothing: it holds zeros (``open``) and attention
    never sees it."""

    def open(self, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> None:
        """Write the empty slot 0 of a fresh cache."""
        if self.offset != 0:
            raise ValueError(f"open() on an MTP head cache at offset {self.offset}")
        empty = mx.zeros((1, kv_heads, 1, head_dim), dtype)
        super().update(empty, empty)

    def update(self, keys: mx.array, values: mx.array) -> ContiguousHistory:
        """As ``KVCache.update``, but the history starts at slot 1. (A restore also writes
        through here, slot 0 included; only the head's own writes read the history.)"""
        history = super().update(keys, values)
        return ContiguousHistory(history.keys[..., 1:, :], history.values[..., 1:, :],
                                 history.query_start, history.num_queries, key_start=1)


class MTPHead(nn.Module):
    """Qwen3-Next's multi-token-prediction head (the checkpoint's ``mtp.*``; module docstring).

    ``head(embeddings, previous, caches)``: row i pairs the embedding of a token with the hidden
    state before it (the target's, or the head's own output when it drafts further ahead), at
    slot ``caches[0].offset + i``; returns the normed output ``(B, N, hidden)``, which the
    shared ``lm_head`` scores and the next draft step takes as its ``previous``."""

    def __init__(self, args: ModelArgs, layers: int):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps, offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, offset=1.0)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = [DecoderLayer(args, i, full_attention=True) for i in range(layers)]
        self.norm = RMSNorm(h, eps, offset=1.0)

    def make_caches(self) -> list[HeadCache]:
        return [HeadCache() for _ in self.layers]

    def open(self, caches: list[HeadCache], dtype: mx.Dtype) -> None:
        """Write the empty slot 0 of fresh caches (see ``HeadCache``)."""
        for layer, cache in zip(self.layers, caches):
            cache.open(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, dtype)

    def __call__(self, embeddings: mx.array, previous: mx.array,
                 caches: list[HeadCache]) -> mx.array:
        if caches[0].offset == 0:
            raise ValueError("slot 0 of the MTP head's caches pairs nothing: open() them first")
        x = mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                            self.pre_fc_norm_hidden(previous)], axis=-1)  # (B, N, 2 * hidden)
        x = self.fc(x)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache)
        return self.norm(x)


class Model(DecoderModel):
    #: The decoder layer (its linear mixer's projection layout).
    decoder_layer: type[DecoderLayer] = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__(args, Backbone(args, [self.decoder_layer(args, i)
                                               for i in range(args.num_hidden_layers)],
                                        norm_offset=1.0))

    def make_caches(self) -> list[Cache]:
        return [RecurrentCache() if layer.is_linear else KVCache() for layer in self.model.layers]

    def _grouping_orders(self) -> tuple[mx.array, mx.array]:
        """Row orders taking the checkpoint's per-key-head grouping of ``in_proj_qkvz``
        ([q_h | k_h | v_h... | z_h...] for each key head h) and ``in_proj_ba`` ([b_h... | a_h...])
        to the grouping by kind this module uses ([all q | all k | all v | all z], [b | a]), so
        the conv input is one contiguous slice of one matmul instead of a gathered copy."""
        a = self.args
        hk, dk, dv = a.linear_num_key_heads, a.linear_key_head_dim, a.linear_value_head_dim
        per_k = a.linear_num_value_heads // hk
        widths = [dk, dk, per_k * dv, per_k * dv]
        group = sum(widths)
        qkvz = []
        for part, width in enumerate(widths):
            offset = sum(widths[:part])
            qkvz += [h * group + offset + i for h in range(hk) for i in range(width)]
        ba = [h * 2 * per_k + part * per_k + i
              for part in range(2) for h in range(hk) for i in range(per_k)]
        return mx.array(qkvz), mx.array(ba)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        head = {k: v for k, v in weights.items() if k.startswith("mtp.")}
        weights = self._regroup_projections(
            {k: v for k, v in weights.items() if not k.startswith("mtp.")})
        for i in range(self.args.num_hidden_layers):
            if self.args.is_sparse(i):
                weights = stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        convs = [k for k in weights if k.endswith("linear_attn.conv1d.weight")]
        for key in convs:
            if weights[key].ndim != 3:
                raise CheckpointError(f"tensor {key} has shape {list(weights[key].shape)}, "
                                      "expected a depthwise conv kernel (C, 1, K) or (C, K, 1)")
        mlx_lm_layout = any(weights[k].shape[-1] == 1 for k in convs)
        for key in convs:
            if weights[key].shape[-1] != 1:  # Hugging Face (C, 1, K) -> (C, K, 1)
                weights[key] = weights[key].moveaxis(2, 1)
        if mlx_lm_layout:  # norms were stored as 1 + w; this module applies (1 + w) itself
            for key in [k for k in weights if k.endswith(_OFFSET_NORMS)]:
                weights[key] = weights[key] - 1.0
        elif head:
            weights.update(self._add_head(head))
        return weights

    def _regroup_projections(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The fused projections' rows regrouped by kind (``_grouping_orders``)."""
        qkvz_rows, ba_rows = self._grouping_orders()
        for key in list(weights):
            # Output rows (and their quantization scales/biases, which are per row) reorder.
            if ".linear_attn.in_proj_qkvz." in key:
                weights[key] = _reorder_rows(key, weights[key], qkvz_rows)
            elif ".linear_attn.in_proj_ba." in key:
                weights[key] = _reorder_rows(key, weights[key], ba_rows)
        return weights

    def _add_head(self, head: dict[str, mx.array]) -> dict[str, mx.array]:
        """Build ``self.mtp`` for the checkpoint's ``mtp.*`` tensors (Hugging Face layout);
        returns them under the head's parameter names (``check_weights`` vets them)."""
        layers = self.args.mtp_num_hidden_layers or 1 + max(
            (int(k.split(".")[2]) for k in head
             if k.startswith("mtp.layers.") and k.split(".")[2].isdigit()), default=0)
        self.mtp = MTPHead(self.args, layers)
        for i in range(layers):
            if self.args.is_sparse(i):
                head = stack_experts(head, f"mtp.layers.{i}.mlp", self.args.num_experts)
        return head


def _reorder_rows(name: str, tensor: mx.array, rows: mx.array) -> mx.array:
    """``tensor[rows]``, after checking the row count: a gather would not notice a tensor with
    fewer rows than the config implies (it would read out of range instead)."""
    if tensor.ndim != 2 or tensor.shape[0] != rows.size:
        raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)}, the config "
                              f"needs {rows.size} rows")
    return tensor[rows]

"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm, no biases) with sparse mixture-of-experts MLPs.

Layers selected by ``decoder_sparse_step`` and not in ``mlp_only_layers`` route each token to
``num_experts_per_tok`` of ``num_experts`` stacked experts (``moe.py``); the others keep a dense
gated MLP. Checkpoints name experts per index (``mlp.experts.{e}.{proj}``, Hugging Face) or
stacked (``mlp.switch_mlp.{proj}``, mlx-lm); ``sanitize`` stacks the former.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from backend.caches.base import Cache
from backend.caches.kv import KVCache
from backend.errors import ConfigError
from backend.models.base import DecoderArgs, args_from_config, complete_attention_heads, one_of
from backend.models.decoder import Backbone, DecoderModel, PreNormDecoderLayer
from backend.models.layers import ACTIVATIONS, Attention, AttentionShape, RMSNorm
from backend.models.moe import SparseMoE, check_routing, is_sparse_layer, layer_mlp, \
    stack_experts
from backend.models.rope import RoPE, RopeSettings, rope_settings

MODEL_TYPES = ("qwen3_moe",)


@dataclass
class ModelArgs(DecoderArgs):
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = False
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = field(default="silu", metadata=one_of(ACTIVATIONS))
    rope: RopeSettings = field(default_factory=lambda: RopeSettings(1000000.0))

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        if config.get("use_sliding_window"):
            raise ConfigError("Qwen3-MoE with use_sliding_window is not supported")
        experts = config.get("num_experts", config.get("num_local_experts"))
        args = args_from_config(cls, {**config, "num_experts": experts},
                                rope=rope_settings(config, 1000000.0))
        complete_attention_heads(args)
        check_routing(args.num_experts, args.num_experts_per_tok)
        return args

    def is_sparse(self, layer: int) -> bool:
        return is_sparse_layer(layer, self.mlp_only_layers, self.num_experts,
                               self.decoder_sparse_step)


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        shape = AttentionShape.from_args(args, qk_norm_eps=args.rms_norm_eps)
        self.self_attn = Attention(shape, RoPE(args.head_dim, args.rope))
        self.mlp = layer_mlp(args, index, lambda: SparseMoE(
            args.hidden_size, args.moe_intermediate_size, args.num_experts,
            args.num_experts_per_tok, args.norm_topk_prob, activation=args.hidden_act))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args, Backbone(args, [DecoderLayer(args, i)
                                               for i in range(args.num_hidden_layers)]))

    def make_caches(self) -> list[Cache]:
        return [KVCache() for _ in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            if self.args.is_sparse(i):
                weights = stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        return weights

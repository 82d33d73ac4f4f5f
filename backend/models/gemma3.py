"""Gemma 3 text decoder: interleaved sliding-window and global attention.

Most layers attend within a sliding window (``RotatingKVCache``, RoPE base
``rope_local_base_freq``); every ``sliding_window_pattern``-th layer attends globally (``KVCache``,
RoPE base ``rope_theta`` with optional scaling). Gemma specifics: RMSNorms scale by
``(1 + weight)``, a norm after attention and around the MLP (four per layer), per-head q/k norms,
attention scaled by ``query_pre_attn_scalar ** -0.5``, embeddings scaled by ``sqrt(hidden)``
(rounded to the compute dtype, as the reference does), GeGLU MLP, optional final logit
soft-capping.

Config layouts: newer Hugging Face configs list ``layer_types`` and nest RoPE settings per
attention type (``rope_parameters: {"sliding_attention": {...}, "full_attention": {...}}``);
older ones (and mlx-lm) give ``sliding_window_pattern``, ``rope_theta``, ``rope_local_base_freq``
and ``rope_scaling`` at the top level. Both are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backend.caches.base import CAUSAL, Cache, sliding_window
from backend.caches.kv import KVCache
from backend.caches.rotating import RotatingKVCache
from backend.errors import ConfigError
from backend.models.base import (DecoderArgs, args_from_config, complete_attention_heads,
                                 config_mapping, one_of)
from backend.models.decoder import Backbone, DecoderModel
from backend.models.layers import ACTIVATIONS, Attention, AttentionShape, GatedMLP, RMSNorm
from backend.models.rope import RoPE, RopeSettings, rope_settings

MODEL_TYPES = ("gemma3_text",)

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArgs(DecoderArgs):
    head_dim: int | None = 256
    num_key_value_heads: int | None = 1
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 4096
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    hidden_activation: str = field(default="gelu_pytorch_tanh", metadata=one_of(ACTIVATIONS))
    final_logit_softcapping: float | None = None
    global_rope: RopeSettings = field(default_factory=lambda: RopeSettings(1000000.0))
    local_rope: RopeSettings = field(default_factory=lambda: RopeSettings(10000.0))

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        if config.get("attn_logit_softcapping") is not None:
            raise ConfigError("Gemma attention logit soft-capping is not supported "
                              "(Gemma 3 checkpoints leave attn_logit_softcapping null)")
        if config.get("use_bidirectional_attention"):
            raise ConfigError("bidirectional (embedding) Gemma 3 models are not supported")
        block = config_mapping(config, "rope_parameters")
        if FULL in block or SLIDING in block:
            global_rope, local_rope = rope_by_attention_type(block)
        else:
            global_rope = rope_settings(config, 1000000.0)
            local_rope = rope_settings(config, 10000.0, theta_key="rope_local_base_freq",
                                       scaled=False)
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        args = args_from_config(cls, {**config, "sliding_window_pattern": pattern},
                                global_rope=global_rope, local_rope=local_rope)
        complete_attention_heads(args)
        if args.layer_types is None:
            args.layer_types = [SLIDING if (i + 1) % args.sliding_window_pattern else FULL
                                for i in range(args.num_hidden_layers)]
        check_layer_types(args.layer_types, args.num_hidden_layers)
        return args


def rope_by_attention_type(block: Mapping[str, Any]) -> tuple[RopeSettings, RopeSettings]:
    """(global, local) RoPE settings from a ``rope_parameters`` block nested per attention type
    (``{"full_attention": {...}, "sliding_attention": {...}}``); bases default to 1e6 / 1e4."""
    return (rope_settings({"rope_parameters": block.get(FULL)}, 1000000.0),
            rope_settings({"rope_parameters": block.get(SLIDING)}, 10000.0))


def check_layer_types(layer_types: list[str], num_layers: int) -> None:
    """``layer_types`` names one sliding or full attention layer per decoder layer."""
    if len(layer_types) != num_layers or not set(layer_types) <= {SLIDING, FULL}:
        raise ConfigError(f"layer_types {layer_types} does not describe {num_layers} "
                          "sliding/full attention layers")


def soft_cap(logits: mx.array, cap: float | None) -> mx.array:
    """Gemma's final logit soft-capping: ``cap * tanh(logits / cap)`` (None: unchanged)."""
    return logits if cap is None else mx.tanh(logits / cap) * cap


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.is_sliding = layer_type == SLIDING
        shape = AttentionShape.from_args(
            args,
            qk_norm_eps=args.rms_norm_eps,
            qk_norm_offset=1.0,
            scale=args.query_pre_attn_scalar ** -0.5,
        )
        rope = RoPE(args.head_dim, args.local_rope if self.is_sliding else args.global_rope)
        mask = sliding_window(args.sliding_window) if self.is_sliding else CAUSAL
        self.self_attn = Attention(shape, rope, mask)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size,
                            activation=args.hidden_activation)
        eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps, offset=1.0)

    def __call__(self, x: mx.array, cache: Cache) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        layers = [DecoderLayer(args, t) for t in args.layer_types]
        super().__init__(args, Backbone(args, layers, norm_offset=1.0,
                                        embed_scale=args.hidden_size ** 0.5))

    def logits(self, hidden: mx.array) -> mx.array:
        return soft_cap(super().logits(hidden), self.args.final_logit_softcapping)

    def make_caches(self) -> list[Cache]:
        return [RotatingKVCache(self.args.sliding_window) if layer.is_sliding else KVCache()
                for layer in self.model.layers]

"""Llama-style decoders: Llama (incl. llama3 / linear / yarn RoPE), Mistral, Qwen2, Qwen3.

They differ only in a few switches, so one module covers them: Qwen2 adds q/k/v biases, Qwen3
adds a per-head RMSNorm on q and k, Mistral (and Qwen2 with ``use_sliding_window``) may restrict
attention to a sliding window. Embeddings are tied or not per ``tie_word_embeddings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.caches.base import CAUSAL, Cache, sliding_window
from backend.caches.kv import KVCache
from backend.models.base import DecoderArgs, args_from_config, complete_attention_heads, one_of
from backend.models.decoder import Backbone, DecoderModel, PreNormDecoderLayer
from backend.models.layers import ACTIVATIONS, Attention, AttentionShape, GatedMLP, RMSNorm
from backend.models.rope import RoPE, RopeSettings, rope_settings

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = field(default="silu", metadata=one_of(ACTIVATIONS))
    sliding_window: int | None = None
    use_sliding_window: bool = True
    rope: RopeSettings = field(default_factory=lambda: RopeSettings(10000.0))

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        theta_default = 1000000.0 if config.get("model_type", "").startswith("qwen") else 10000.0
        args = args_from_config(cls, config, rope=rope_settings(config, theta_default))
        complete_attention_heads(args)
        if args.model_type == "qwen2":
            args.attention_bias = True  # Qwen2 always has q/k/v biases
            if not config.get("use_sliding_window", False):
                args.sliding_window = None
        if args.model_type == "qwen3":
            args.sliding_window = None if not config.get("use_sliding_window") else args.sliding_window
        return args


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: ModelArgs):
        super().__init__()
        shape = AttentionShape.from_args(
            args,
            out_bias=args.attention_bias and args.model_type not in ("qwen2",),
            qk_norm_eps=args.rms_norm_eps if args.model_type == "qwen3" else None,
        )
        mask = sliding_window(args.sliding_window) if args.sliding_window else CAUSAL
        self.self_attn = Attention(shape, RoPE(args.head_dim, args.rope), mask)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias,
                            args.hidden_act)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(DecoderModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args, Backbone(args, [DecoderLayer(args)
                                               for _ in range(args.num_hidden_layers)]))

    def make_caches(self) -> list[Cache]:
        return [KVCache() for _ in self.model.layers]

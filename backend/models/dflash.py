"""DFlash block drafters: a separate small checkpoint that proposes a whole block of tokens in
one forward, conditioned on hidden states taken from chosen layers of its target.

The published layout (config ``architectures: ["DFlashDraftModel"]`` with a ``dflash_config``
block: ``mask_token_id``, ``target_layer_ids``; ``block_size``, usually 16; tensors ``fc``,
``hidden_norm``, ``layers.N.*``, ``norm``, no embedding and no output head: it shares its
target's):

* context: the target's hidden states after each layer of ``target_layer_ids`` at every
  committed position, concatenated, ``hidden_norm(fc(...))``. Each drafter layer projects the
  context to keys and values of its own (``k_norm`` on the keys, RoPE at the position), and
  those are all a drafter's cache holds: one ``KVCache`` per layer, at the target's positions.
  The context skips the layers' norms and MLPs: only attention reads it.
* the block: the anchor token (the newest id, whose target hidden is not in the context yet)
  then ``mask_token_id`` at the next positions, embedded with the target's embedding, through
  Qwen3-style layers whose attention sees the whole context and the whole block (no causal mask
  inside the block), then ``norm``; the target's head scores rows 1.. as the drafts.

``Model.extend(features, caches)`` appends context positions; ``Model.block(embedded, caches)``
runs a block at the caches' offset without writing them. ``is_dflash_config`` tells such a
checkpoint from a model (``architecture_args`` routes it here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backend.caches.kv import KVCache
from backend.errors import ConfigError
from backend.models.base import ZERO_ALLOWED, args_from_config, config_mapping
from backend.models.decoder import Backbone
from backend.models.layers import GatedMLP, RMSNorm
from backend.models.rope import RoPE, RopeSettings, rope_settings

#: Not a ``model_type``: DFlash checkpoints carry their layers' type (``qwen3``) there;
#: ``architecture_args`` recognises them by ``is_dflash_config``.
MODEL_TYPES: tuple[str, ...] = ()
ARCHITECTURE = "DFlashDraftModel"


def is_dflash_config(config: dict) -> bool:
    return isinstance(config.get("dflash_config"), dict) or ARCHITECTURE in (
        config.get("architectures") or [])


def is_dflash_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a DFlash checkpoint (an unreadable config says no: loading it
    as a model then names the fault)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and is_dflash_config(config)


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    block_size: int = 16
    #: None: the config names none; the target's family default then (``MASK_DEFAULTS``).
    mask_token_id: int | None = field(default=None, metadata=ZERO_ALLOWED)
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0
    max_position_embeddings: int = 262144
    model_type: str = "dflash"
    rope: RopeSettings = field(default_factory=lambda: RopeSettings(10000.0))

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        block = config_mapping(config, "dflash_config")
        unsupported = _unsupported_settings(config, block)
        if unsupported:
            raise ConfigError(f"this DFlash drafter uses {unsupported}, which Arbor's block "
                              "drafter does not implement (it drafts with full, non-causal "
                              "attention over the whole context)")
        extra = {k: block[k] for k in ("mask_token_id", "target_layer_ids", "num_target_layers")
                 if k in block}
        flat = {**config, **extra, "model_type": "dflash"}
        args = args_from_config(cls, flat, rope=rope_settings(config, 10000.0))
        if args.head_dim is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        if not args.target_layer_ids:
            raise ConfigError("dflash_config.target_layer_ids must name the target layers whose "
                              "hidden states the drafter reads")
        if args.block_size < 2:
            raise ConfigError(f"block_size must be at least 2, got {args.block_size}")
        if args.mask_token_id is not None and not 0 <= args.mask_token_id < args.vocab_size:
            raise ConfigError(f"mask_token_id {args.mask_token_id} is outside the vocabulary "
                              f"of {args.vocab_size}")
        return args


def _unsupported_settings(config: dict, block: dict) -> str | None:
    """The first setting of a DFlash config that changes the drafter's attention beyond the
    published layout (sliding-window layers, a causal block, attention sinks, a windowed
    context), named; None when there is none."""
    sliding = [t for t in config.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        return f"layer_types {sorted(set(sliding))}"
    if block.get("causal") or config.get("dflash_query_causal") or config.get("is_causal"):
        return "a causal mask inside the block"
    if block.get("attention_sink_bias"):
        return "attention sinks"
    if block.get("draft_window_size"):
        return f"a context window of {block['draft_window_size']} positions"
    return None


#: The mask id a drafter whose config names none uses, by its target's ``model_type`` (Gemma
#: 4's tokenizer has ``<mask>`` at 4; its DFlash configs leave the id out).
MASK_DEFAULTS = {"gemma4": 4, "gemma4_text": 4}


class ContextAttention(nn.Module):
    """Attention of the block over the cached context and itself (see the module docstring)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, self.heads, self.kv_heads = args.head_dim, args.num_attention_heads, \
            args.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(args.hidden_size, self.heads * d, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps)
        self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.rope = RoPE(d, args.rope)

    def _keys_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        b, n, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(b, n, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(keys, offset), values

    def extend(self, context: mx.array, cache: KVCache) -> None:
        keys, values = self._keys_values(context, cache.offset)
        cache.append(keys, values)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        b, n, _ = x.shape
        start = cache.offset
        queries = self.q_norm(self.q_proj(x).reshape(b, n, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = self.rope(queries, start)
        keys, values = self._keys_values(x, start)
        if start:
            keys = mx.concatenate([cache.keys[..., :start, :], keys], axis=2)
            values = mx.concatenate([cache.values[..., :start, :], values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values,
                                                   scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = ContextAttention(args)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """The drafter network (module docstring); the target supplies embedding and head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size,
                            bias=False)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def make_caches(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def extend(self, features: mx.array, caches: list[KVCache]) -> None:
        """Append context positions: ``features`` (1, n, len(target_layer_ids) * hidden), the
        target's captured hidden states of the next n positions."""
        context = self.hidden_norm(self.fc(features))
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.extend(context, cache)

    def block(self, embedded: mx.array, caches: list[KVCache]) -> mx.array:
        """The block's normed hidden states (1, n, hidden) from its embedded tokens, at the
        caches' offset; the caches are read, not written."""
        h = embedded
        for layer, cache in zip(self.layers, caches):
            h = layer(h, cache)
        return self.norm(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names without the ``model.`` prefix some exports add; no RoPE tables."""
        out = {}
        for name, value in weights.items():
            name = name.removeprefix("model.")
            if "rotary_emb" not in name:
                out[name] = value
        return out

    def parameter_name(self, checkpoint_name: str) -> str | None:
        return checkpoint_name.removeprefix("model.")

    def mask_id(self, target: Any) -> int | None:
        """The id the block's draft positions hold: the config's, else the target family's
        default (None: neither)."""
        if self.args.mask_token_id is not None:
            return self.args.mask_token_id
        return MASK_DEFAULTS.get(getattr(target.args, "model_type", None))

    def check_target(self, target: Any) -> str | None:
        """Why this drafter cannot draft for ``target`` (a loaded model), or None."""
        t = target.args
        if t.vocab_size != self.args.vocab_size:
            return (f"its vocabulary has {self.args.vocab_size} ids, the model's has "
                    f"{t.vocab_size}")
        if t.hidden_size != self.args.hidden_size:
            return (f"it reads hidden states of width {self.args.hidden_size}, the model's are "
                    f"{t.hidden_size}")
        if not isinstance(target.model, Backbone):
            return "this model's forward does not capture its layers' hidden states"
        if self.mask_id(target) is None:
            return "its config names no dflash_config.mask_token_id"
        layers = len(target.model.layers)
        bad = [i for i in self.args.target_layer_ids if not 0 <= i < layers]
        if bad:
            return f"it reads layers {bad}, the model has {layers}"
        return None

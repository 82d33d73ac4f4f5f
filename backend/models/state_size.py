"""Bytes of cached state a token adds: what each token of a conversation costs the live caches
and every tier of the prefix cache (``arbor models list --verbose``).

Counted from the config alone (no weights are read): full-attention layers keep each token's
keys and values, ``2 * num_key_value_heads * head_dim`` values; a latent-attention layer
(GLM-4.7-Flash) its latent and rotary key, ``kv_lora_rank + qk_rope_head_dim`` values; Gemma
4's KV-shared layers none (they read an earlier layer's keys). Sliding
windows and recurrent states are bounded, so a longer conversation adds nothing to them.
``tests/test_state_size.py`` checks every family against the bytes its caches really hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from backend.models import architecture_args

FULL_ATTENTION = "full_attention"


def _keys_and_values(args: Any, layers: int) -> int:
    return layers * 2 * args.num_key_value_heads * args.head_dim


def _every_layer(args: Any) -> int:
    return _keys_and_values(args, args.num_hidden_layers)


def _full_attention_layers(args: Any) -> int:
    """Families mixing full attention with windows (Gemma 3) or recurrent layers (Qwen3-Next,
    Qwen3.5)."""
    return _keys_and_values(args, args.layer_types.count(FULL_ATTENTION))


def _gemma4(args: Any) -> int:
    """Gemma 4: the full-attention layers that compute keys (a KV-shared layer reads an earlier
    layer's, so it adds nothing), each with the global layers' head size and kv heads."""
    computing = args.layer_types[:args.num_hidden_layers - args.num_kv_shared_layers]
    heads = (args.num_global_key_value_heads
             if args.attention_k_eq_v and args.num_global_key_value_heads
             else args.num_key_value_heads)
    return computing.count(FULL_ATTENTION) * 2 * heads * args.global_head_dim


def _latent(args: Any) -> int:
    return args.num_hidden_layers * (args.kv_lora_rank + args.qk_rope_head_dim)


#: Values a token adds to a model's caches, by ``model_type``; families not named keep keys
#: and values in every layer.
VALUES_PER_TOKEN: dict[str, Callable[[Any], int]] = {
    "gemma3_text": _full_attention_layers,
    "qwen3_next": _full_attention_layers,
    "qwen3_5": _full_attention_layers,
    "qwen3_5_moe": _full_attention_layers,
    "glm4_moe_lite": _latent,
    "gemma4_text": _gemma4,
    "gemma4": _gemma4,
}


def state_bytes_per_token(config: Mapping[str, Any], itemsize: int = 4,
                          source: Path = Path("config.json")) -> int:
    """Bytes one more token adds to the caches of the model ``config`` describes, at
    ``itemsize`` bytes per value (4: float32, the CPU's compute dtype)."""
    _, args = architecture_args(config, source)
    return VALUES_PER_TOKEN.get(args.model_type, _every_layer)(args) * itemsize

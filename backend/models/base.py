"""The architecture contract, and the one place a config becomes checked model arguments.

An architecture module (one per family, registered in ``backend/models/__init__.py``) is an
``Architecture``: ``MODEL_TYPES``, ``ModelArgs`` (a dataclass that is a ``ModelConfig``) and
``Model`` (an ``nn.Module`` that is a ``LanguageModel``). The protocols are runtime-checkable;
``tests/test_architecture_contract.py`` checks every registered family against them.

``args_from_config`` builds a family's ``ModelArgs`` from ``config.json``: every value is checked
against its field's type here, so that a zero head count or a string where a size belongs is one
``ConfigError`` naming the key, never a ``ZeroDivisionError`` deep inside a layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from types import MappingProxyType, NoneType, UnionType
from typing import (TYPE_CHECKING, Any, Protocol, TypeVar, Union, get_args, get_origin,
                    get_type_hints, runtime_checkable)

from backend.errors import ConfigError

if TYPE_CHECKING:
    import mlx.core as mx

    from backend.caches.base import Cache


@runtime_checkable
class ModelConfig(Protocol):
    """What the shared decoder, the loader and the engine read from every family's arguments."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelConfig:
        """Checked arguments from a parsed ``config.json``; ``ConfigError`` naming the key."""
        ...


@dataclass
class DecoderArgs:
    """The required arguments most families name alike, first and in this order; a family's
    ``ModelArgs`` dataclass extends it with its own."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int


@runtime_checkable
class LanguageModel(Protocol):
    """A causal language model over per-layer caches.

    ``__call__(tokens, caches)`` is ``logits(hidden(tokens, caches))``: the engine calls
    ``hidden`` for prefill chunks and applies ``logits`` only where it needs them (the
    vocabulary projection is the largest matmul).
    """

    args: ModelConfig

    def __call__(self, tokens: mx.array, caches: list[Cache]) -> mx.array:
        """``tokens`` (B, N) int32 -> logits (B, N, vocab)."""
        ...

    def hidden(self, tokens: mx.array, caches: list[Cache]) -> mx.array:
        """Final normed hidden states (B, N, hidden); each cache advances by N."""
        ...

    def logits(self, hidden: mx.array) -> mx.array:
        """(..., hidden) -> (..., vocab)."""
        ...

    def make_caches(self) -> list[Cache]:
        """One fresh cache per layer that holds state; the model chooses each layer's cache kind.
        A layer that reads another layer's keys and values (Gemma 4's KV-shared layers) has
        none: the model hands it its source's history."""
        ...

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint tensors -> this module tree's parameter names and layouts. May settle
        checkpoint-dependent structure (a shipped ``lm_head``); ``CheckpointError`` naming the
        tensor when the checkpoint cannot fit."""
        ...

    def parameter_name(self, checkpoint_name: str) -> str | None:
        """The name ``sanitize`` gives a checkpoint's tensor or module (None: one it drops);
        the loader reads per-module quantization settings through it."""
        ...


@runtime_checkable
class Architecture(Protocol):
    """One architecture module."""

    MODEL_TYPES: tuple[str, ...]  # the config ``model_type`` values it implements
    ModelArgs: type[ModelConfig]
    Model: Callable[[Any], LanguageModel]


# ---------------------------------------------------------------------------------------------
# Reading a config

#: Field metadata: this count may be 0 (e.g. ``num_experts`` of a model with dense MLPs only).
ZERO_ALLOWED = MappingProxyType({"zero_allowed": True})


def one_of(names: Iterable[str]) -> Mapping[str, Any]:
    """Field metadata: the string value must be one of ``names``."""
    return MappingProxyType({"choices": tuple(sorted(names))})


T = TypeVar("T")


def args_from_config(cls: type[T], config: Mapping[str, Any], **overrides: Any) -> T:
    """Build the dataclass ``cls`` from config keys with the same names (``overrides`` replace
    them), checking each value against its field's type.

    Numbers in model arguments are sizes, counts and scales: integers must be >= 1 and floats
    > 0, unless the field's metadata is ``ZERO_ALLOWED``; a ``one_of`` field takes only the
    listed strings; ``list[int]`` holds indices (>= 0). Fields of other types (settings objects
    the family built itself) pass unchecked. A missing required key or any bad value is a
    ``ConfigError`` naming the key.
    """
    hints = get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name in overrides:
            value = overrides[f.name]
        elif config.get(f.name) is not None:
            value = config[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
            raise ConfigError(f"missing required key {f.name!r} for model_type "
                              f"{config.get('model_type')!r}")
        else:
            continue
        values[f.name] = _checked(f, hints[f.name], value)
    return cls(**values)


def _checked(f: Field, hint: Any, value: Any) -> Any:
    """``value`` if it fits field ``f`` of type ``hint`` (ints widened to float for float
    fields); ``ConfigError`` otherwise."""
    optional = get_origin(hint) in (Union, UnionType) and NoneType in get_args(hint)
    if optional:
        if value is None:
            return None
        hint = next(a for a in get_args(hint) if a is not NoneType)
    zero_ok = bool(f.metadata.get("zero_allowed"))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{f.name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if not _is_int(value) or value < (0 if zero_ok else 1):
            kind = "a non-negative" if zero_ok else "a positive"
            raise ConfigError(f"{f.name} must be {kind} integer, got {value!r}")
        return value
    if hint is float:
        if not is_number(value) or value < 0 or (value == 0 and not zero_ok):
            kind = "a non-negative" if zero_ok else "a positive"
            raise ConfigError(f"{f.name} must be {kind} number, got {value!r}")
        return float(value)
    if hint is str:
        choices = f.metadata.get("choices")
        if not isinstance(value, str) or (choices and value not in choices):
            allowed = f" (supported: {', '.join(choices)})" if choices else ""
            raise ConfigError(f"unsupported {f.name} {value!r}{allowed}")
        return value
    if get_origin(hint) is list:
        (item,) = get_args(hint)
        good = isinstance(value, list) and all(
            (_is_int(v) and v >= 0) if item is int else isinstance(v, item) for v in value)
        if not good:
            what = "layer indices" if item is int else f"{item.__name__} values"
            raise ConfigError(f"{f.name} must be a list of {what}, got {value!r}")
        return list(value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number (not a boolean)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def config_mapping(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``config[key]`` when it is a JSON object, ``{}`` when absent or null; ``ConfigError``
    for anything else."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a JSON object, got {value!r}")
    return value


def complete_attention_heads(args: Any) -> None:
    """Fill the attention shape's defaults as Hugging Face does and check that it is whole:
    ``num_key_value_heads`` defaults to one per query head, ``head_dim`` to
    ``hidden_size / num_attention_heads``; the query heads must split evenly into groups per
    key/value head."""
    if args.num_key_value_heads is None:
        args.num_key_value_heads = args.num_attention_heads
    if args.head_dim is None:
        if args.hidden_size % args.num_attention_heads:
            raise ConfigError(
                f"hidden_size {args.hidden_size} is not a multiple of num_attention_heads "
                f"{args.num_attention_heads} (and the config gives no head_dim)")
        args.head_dim = args.hidden_size // args.num_attention_heads
    if args.num_attention_heads % args.num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads {args.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {args.num_key_value_heads}")

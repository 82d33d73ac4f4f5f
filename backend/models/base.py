"""What every architecture module provides, and the config-reading helper they share.

An architecture module exposes ``ModelArgs`` (a dataclass with ``from_config(dict)``) and
``Model`` (an ``nn.Module``) with:

* ``__call__(tokens (B, N) int32, caches) -> logits (B, N, vocab)``, which is
  ``logits(hidden(tokens, caches))``: the engine calls ``hidden`` for prefill chunks and applies
  ``logits`` only where it needs them (the vocabulary projection is the largest matmul)
* ``args`` with at least ``vocab_size`` and ``max_position_embeddings``
* ``make_caches() -> list[Cache]`` — the model chooses its cache kind per layer
* ``sanitize(weights) -> weights`` — map checkpoint names onto the module tree
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, TypeVar

from backend.errors import ModelLoadError

T = TypeVar("T")


def args_from_config(cls: type[T], config: dict[str, Any], **overrides: Any) -> T:
    """Build the dataclass ``cls`` from config keys with the same names.

    Required fields missing from the config are a ``ModelLoadError`` naming the key.
    """
    values = {}
    for f in fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif f.name in config and config[f.name] is not None:
            values[f.name] = config[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
            raise ModelLoadError(
                f"config.json is missing required key {f.name!r} for model_type "
                f"{config.get('model_type')!r}")
    return cls(**values)

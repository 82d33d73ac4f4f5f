"""What a model's caches hold per token, read from the caches it makes (no weights needed).

``cache_footprint(config, dtype)`` builds the model for a ``config.json`` with lazy random
parameters, makes its caches and writes one token through them without evaluating anything:
MLX arrays know their shapes before they are computed, so the caches' buffers say what each
position costs while no weight is ever materialised (a 30B config costs what a tiny one does).
The figures are those of the caches the model really makes: layers that read another layer's
keys (Gemma 4's KV-shared layers) add nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from backend.caches.kv import KVCache
from backend.caches.recurrent import RecurrentCache
from backend.caches.rotating import RotatingKVCache
from backend.models import architecture_args


@dataclass(frozen=True)
class CacheFootprint:
    """Bytes of one sequence's caches: ``full_per_token`` grows without bound (full
    attention); ``window_per_token`` only up to each window, ``window_bytes`` in all once the
    windows are full; ``state_bytes`` whatever the length (recurrent states). ``caches`` hold
    state, for ``layers`` decoder layers."""

    full_per_token: int
    window_per_token: int
    window_bytes: int
    state_bytes: int
    caches: int
    layers: int

    def describe(self) -> str:
        """One line, e.g. ``"512 B/token full attention, 768 B/token in windows (at most
        6.0 KiB); 4 caches for 6 layers"``."""
        parts = [f"{_size(self.full_per_token)}/token full attention"]
        if self.window_bytes:
            parts.append(f"{_size(self.window_per_token)}/token in windows "
                         f"(at most {_size(self.window_bytes)})")
        if self.state_bytes:
            parts.append(f"{_size(self.state_bytes)} recurrent state")
        return f"{', '.join(parts)}; {self.caches} caches for {self.layers} layers"


def cache_footprint(config: Mapping[str, Any], dtype: mx.Dtype = mx.float32,
                    source: Path | None = None) -> CacheFootprint:
    """The footprint of the model ``config`` describes, computing in ``dtype``; the errors of
    ``architecture_args`` for a config it cannot build (``source`` names it)."""
    module, args = architecture_args(config, source or Path("config.json"))
    model = module.Model(args)
    model.set_dtype(dtype)
    caches = model.make_caches()
    model.hidden(mx.zeros((1, 1), mx.int32), caches)  # shapes only: nothing is evaluated
    full = window_per_token = window_bytes = state = 0
    for cache in caches:
        if isinstance(cache, RotatingKVCache):
            window_per_token += cache.bytes_per_token
            window_bytes += cache.bytes_per_token * cache.window
        elif isinstance(cache, KVCache):
            full += cache.bytes_per_token
        elif isinstance(cache, RecurrentCache):
            state += cache.nbytes
    return CacheFootprint(full, window_per_token, window_bytes, state, len(caches),
                          args.num_hidden_layers)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"

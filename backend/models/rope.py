"""Rotary position embeddings: default, linear, llama3, yarn and proportional (Gemma 4) RoPE.

Configs name RoPE either with top-level keys (``rope_theta``, ``rope_scaling``) or, in newer
Hugging Face configs, a ``rope_parameters`` block holding theta and the scaling type together;
``rope_settings`` accepts both. Every variant is applied with ``mx.fast.rope`` (non-traditional,
i.e. the rotate-half layout Hugging Face checkpoints use); variants that change frequencies pass
them as ``freqs`` (MLX takes per-pair *periods*, 1 / inv_freq).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backend.errors import ConfigError
from backend.models.base import config_mapping, is_number


@dataclass(frozen=True)
class RopeSettings:
    theta: float
    kind: str = "default"  # default | linear | llama3 | yarn | proportional
    params: dict = field(default_factory=dict)


#: Parameters each scaling kind needs, and the numeric ones it may take (all must be > 0).
_REQUIRED = {"default": (), "linear": ("factor",), "llama3": ("factor",), "yarn": ("factor",),
             "proportional": ()}
_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")


def rope_settings(config: Mapping[str, Any], default_theta: float = 10000.0,
                  theta_key: str = "rope_theta", scaled: bool = True) -> RopeSettings:
    """Read RoPE settings from a config dict, old or new layout (``scaled=False``: the base
    only, for layers that never scale). Bad values are a ``ConfigError`` naming the key."""
    block = config_mapping(config, "rope_parameters")
    # A nested block per attention type (e.g. {"full_attention": {...}}) is resolved by callers.
    scaling = dict(config_mapping(config, "rope_scaling")) if scaled else {}
    if block and scaled:
        scaling = {**block, **scaling}
    theta = block.get(theta_key, config.get(theta_key, default_theta))
    if not is_number(theta) or theta <= 1:
        raise ConfigError(f"{theta_key} must be a number > 1, got {theta!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind not in _REQUIRED:
        raise ConfigError(f"unsupported RoPE scaling type {kind!r} "
                          f"(supported: {', '.join(_REQUIRED)})")
    params = {k: v for k, v in scaling.items() if k not in (theta_key, "rope_type", "type")}
    for key in _REQUIRED[kind]:
        if params.get(key) is None:
            raise ConfigError(f"{kind} RoPE scaling needs rope_scaling.{key}")
    for key in _POSITIVE:
        value = params.get(key)
        if value is not None and (not is_number(value) or value <= 0):
            raise ConfigError(f"rope_scaling.{key} must be a positive number, got {value!r}")
    if kind == "proportional":
        share = params.get("partial_rotary_factor", 1.0)
        if not is_number(share) or not 0 < share <= 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {share!r}")
    if kind == "llama3" and params.get("low_freq_factor", 1.0) == params.get(
            "high_freq_factor", 4.0):
        raise ConfigError("llama3 RoPE scaling needs low_freq_factor != high_freq_factor")
    return RopeSettings(float(theta), kind, params)


def _llama3_periods(dims: int, theta: float, p: dict) -> mx.array:
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_ctx = p.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    periods = theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * periods
    # Long wavelengths are slowed by `factor`; the band in between is blended smoothly.
    periods = mx.where(wavelens > low_wavelen, periods * factor, periods)
    is_mid = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old_ctx / wavelens - low) / (high - low)
    mid = periods / ((1 - smooth) / factor + smooth)
    return mx.where(is_mid, mid, periods)


def _proportional_periods(dims: int, theta: float, p: dict) -> mx.array:
    """Gemma 4's partial rotation of a whole head: the first ``partial_rotary_factor`` of the
    rotate-half pairs turn with the frequencies a ``dims``-wide head would give them (the
    exponent's denominator stays ``dims``), the other pairs not at all (an infinite period),
    all periods slowed by ``factor``. Unlike a rotation of the first dims only, each pair is
    still (i, i + dims / 2)."""
    angles = int(p.get("partial_rotary_factor", 1.0) * dims // 2)
    exponents = mx.arange(0, 2 * angles, 2, dtype=mx.float32) / dims
    turning = p.get("factor", 1.0) * theta ** exponents
    return mx.concatenate([turning, mx.full((dims // 2 - angles,), mx.inf)])


def _yarn(dims: int, theta: float, p: dict) -> tuple[mx.array, float]:
    factor = p["factor"]
    old_ctx = p.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = p.get("beta_fast", 32), p.get("beta_slow", 1)

    def correction_dim(rotations: float) -> float:
        return (dims * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    if p.get("truncate", True) is False:
        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = 1.0 / theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    return 1.0 / inv_freq, float(attention_factor)


class RoPE(nn.Module):
    """Applies rotary embeddings to ``(B, heads, L, head_dim)`` starting at a position offset."""

    #: Decode-sized float32 work through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False

    def __init__(self, dims: int, settings: RopeSettings):
        super().__init__()
        self.dims = dims
        self.base: float | None = settings.theta
        self.scale = 1.0
        self.out_scale = 1.0
        self._periods = None
        p = settings.params
        if settings.kind == "linear":
            self.scale = 1.0 / p["factor"]
        elif settings.kind == "llama3":
            self._periods, self.base = _llama3_periods(dims, settings.theta, p), None
        elif settings.kind == "proportional":
            self._periods, self.base = _proportional_periods(dims, settings.theta, p), None
        elif settings.kind == "yarn":
            self._periods, self.out_scale = _yarn(dims, settings.theta, p)
            self.base = None

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        y = None
        if self.native_ops:
            from backend import kernels

            y = kernels.rope(x, self.dims, offset, self.scale, self._inverse_frequencies())
        if y is None:
            y = mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=self.scale,
                             offset=offset, freqs=self._periods)
        return y * self.out_scale if self.out_scale != 1.0 else y

    def _inverse_frequencies(self) -> mx.array:
        """Angle per position of each rotated pair, computed as ``mx.fast.rope`` does."""
        if getattr(self, "_inv_freqs", None) is None:
            half = self.dims // 2
            if self._periods is not None:
                inv = 1.0 / self._periods.astype(mx.float32)
            else:
                inv = mx.exp(-mx.arange(half, dtype=mx.float32) * (math.log(self.base) / half))
            mx.eval(inv)
            object.__setattr__(self, "_inv_freqs", inv)  # a cache, not a parameter
        return self._inv_freqs

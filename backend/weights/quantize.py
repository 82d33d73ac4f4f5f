"""MLX affine quantization in the mlx-community folder layout.

A quantized linear or embedding weight ``X.weight`` is stored as three tensors:

* ``X.weight``  uint32, shape ``(out, in * bits / 32)``: ``bits``-bit codes packed little-endian,
  element ``j`` of each ``32 / bits`` run in bits ``j*bits ..`` of its word (``mx.quantize``'s
  layout);
* ``X.scales``  float32, shape ``(out, in / group_size)``;
* ``X.biases``  float32, shape ``(out, in / group_size)``;

so that ``w = scales * q + biases`` group by group (``mx.dequantize``). ``config.json`` carries
``"quantization": {"group_size": G, "bits": B, ...}`` where extra keys name modules (``X`` without
``.weight``) whose spec differs: a ``{"group_size", "bits"}`` dict, or ``false`` for a linear layer
kept in floating point. This is what mlx-lm reads and writes.

Scales and biases that Arbor computes are float32: on MLX's CPU backend quantized matmuls with
float16/bfloat16 scales are several times slower. (GGUF imports store them as float16 where
every value is a float16 exactly, to save disk; the loader widens every scale to float32 on the
CPU, which is exact.)

Groups of 16 (from GGUF K-quants, see ``SUPPORTED_GROUP_SIZES``) are a layout MLX dequantizes but
does not multiply; ``widen_codes`` rewrites any layout as 8-bit codes of the same values, which the
native kernels multiply in every group size.

Scope: the tensor-level operations and the config block. Which tensors to quantize and how to
stream them through files is the caller's business (``store.py``, ``gguf.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from backend import kernels
from backend.errors import ConfigError

#: dtype of ``.scales`` / ``.biases`` written by Arbor (see module docstring for why).
SCALE_DTYPE = mx.float32

#: Group size used when Arbor quantizes floating-point weights itself (mlx-lm's default).
DEFAULT_GROUP_SIZE = 64

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


@dataclass(frozen=True, order=True)
class QuantSpec:
    """How one layer is quantized: ``bits`` per weight, one scale/bias per ``group_size`` inputs."""

    group_size: int
    bits: int

    def describe(self) -> str:
        """Short human form, e.g. ``"4-bit g32"``."""
        return f"{self.bits}-bit g{self.group_size}"

    def as_config(self) -> dict[str, int]:
        return {"group_size": self.group_size, "bits": self.bits}


def module_of(weight_name: str) -> str:
    """``"model.layers.0.mlp.up_proj.weight"`` -> ``"model.layers.0.mlp.up_proj"``."""
    return weight_name.removesuffix(".weight")


def is_quantizable(name: str, shape: tuple[int, ...], group_size: int) -> bool:
    """Whether a float tensor is a linear/embedding weight MLX can quantize at ``group_size``.

    Linear and embedding weights are the 2-D ``*.weight`` tensors of a decoder; norms and biases
    are 1-D and convolution kernels 3-D. The input dimension must split into whole groups.
    """
    if not name.endswith(".weight") or len(shape) != 2:
        return False
    if "norm" in module_of(name).rsplit(".", 1)[-1]:  # defensive: a 2-D norm is never a matmul
        return False
    return shape[-1] % group_size == 0


def quantize_weight(weight: mx.array, spec: QuantSpec) -> dict[str, mx.array]:
    """Quantize a float ``(out, in)`` weight; returns ``{"weight", "scales", "biases"}``.

    Precondition: ``weight.shape[-1] % spec.group_size == 0`` (see ``is_quantizable``).
    """
    if spec.bits not in SUPPORTED_BITS:
        raise ValueError(f"cannot quantize to {spec.bits} bits; supported: {SUPPORTED_BITS}")
    # Quantize from float32: mx.quantize on bf16 input computes its scales in bf16.
    packed, scales, biases = mx.quantize(
        weight.astype(mx.float32), group_size=spec.group_size, bits=spec.bits
    )
    return {
        "weight": packed,
        "scales": scales.astype(SCALE_DTYPE),
        "biases": biases.astype(SCALE_DTYPE),
    }


def quantization_block(layers: Mapping[str, QuantSpec | None]) -> dict[str, Any] | None:
    """The ``config.json`` ``"quantization"`` block for per-module specs.

    ``layers`` maps every linear/embedding module to its spec, or ``None`` if it stays in floating
    point. The most common spec becomes the default; every module that differs gets an override
    (``false`` for floating point). Returns ``None`` when nothing is quantized.
    """
    counts = Counter(spec for spec in layers.values() if spec is not None)
    if not counts:
        return None
    # Most common first; ties broken by the spec itself so the output is deterministic.
    default = max(counts, key=lambda spec: (counts[spec], spec))
    block: dict[str, Any] = default.as_config()
    for module in sorted(layers):
        spec = layers[module]
        if spec != default:
            block[module] = False if spec is None else spec.as_config()
    return block


#: Group sizes MLX's quantized matmuls (and ``mx.quantize``) take.
MATMUL_GROUP_SIZES = kernels.MLX_MATMUL_GROUP_SIZES

#: Group sizes a model folder may use: MLX's, plus 16, the sub-block of llama.cpp's Q2_K, Q3_K
#: and Q6_K (gguf_quants.py). MLX dequantizes groups of 16 but cannot multiply by them, so the
#: loader runs such layers on the native CPU kernels or dequantizes them (loading.py).
SUPPORTED_GROUP_SIZES = (16, *MATMUL_GROUP_SIZES)


def read_quantization(
    config: Mapping[str, Any],
) -> tuple[QuantSpec | None, dict[str, QuantSpec | None]]:
    """Parse the config's MLX quantization block into ``(default spec, {module: override or
    None})``: ``"quantization"``, or a ``"quantization_config"`` in the same layout (not another
    library's, which names a ``quant_method``).

    A config without such a block gives ``(None, {})``. Scalar keys other than ``group_size`` /
    ``bits`` / ``mode`` are ignored. A block with bits or a group size MLX cannot run, or a
    quantization mode other than affine, is a ``ConfigError`` naming the key.
    """
    block = config.get("quantization")
    if block is None:
        fallback = config.get("quantization_config")
        if isinstance(fallback, Mapping) and "quant_method" not in fallback:
            block = fallback
    if block is None:
        return None, {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"quantization must be a JSON object, got {block!r}")
    if block.get("mode", "affine") != "affine":
        raise ConfigError(f"unsupported quantization mode {block['mode']!r} (supported: affine)")
    default = _spec("quantization", block) if "group_size" in block or "bits" in block else None
    overrides: dict[str, QuantSpec | None] = {}
    for key, value in block.items():
        if value is False:
            overrides[key] = None
        elif isinstance(value, Mapping):
            overrides[key] = _spec(f"quantization.{key}", value)
    return default, overrides


def _spec(where: str, block: Mapping[str, Any]) -> QuantSpec:
    group, bits = block.get("group_size"), block.get("bits")
    if group not in SUPPORTED_GROUP_SIZES or isinstance(group, bool):
        raise ConfigError(f"{where}.group_size must be one of {SUPPORTED_GROUP_SIZES}, "
                          f"got {group!r}")
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        raise ConfigError(f"{where}.bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return QuantSpec(int(group), int(bits))


def spec_for(module: str, default: QuantSpec | None,
             overrides: Mapping[str, QuantSpec | None]) -> QuantSpec | None:
    """The spec of ``module``: its override if it has one, else the default."""
    return overrides[module] if module in overrides else default


def describe_quantization(config: Mapping[str, Any]) -> str | None:
    """``"4-bit g32"`` when every quantized module shares one spec; with per-module overrides
    the default spec first, then the others (``"4-bit g32 + 8-bit g32"``); ``None`` for a
    floating-point model."""
    default, overrides = read_quantization(config)
    others = sorted({spec for spec in overrides.values() if spec is not None} - {default},
                    key=lambda spec: (spec.bits, spec.group_size))
    specs = ([default] if default is not None else []) + others
    if not specs:
        return None
    return " + ".join(spec.describe() for spec in specs)


def widen_codes(weight: mx.array, spec: QuantSpec) -> mx.array:
    """``weight``'s ``spec.bits``-bit codes repacked as 8-bit codes (``QuantSpec(
    spec.group_size, 8)``), values unchanged: with the same scales and biases it dequantizes to
    the same weights bit for bit. For kernels that read 4- and 8-bit codes only."""
    *lead, words = weight.shape
    groups = words * 32 // spec.bits // spec.group_size
    ones = mx.ones((*lead, groups), dtype=mx.float32)
    codes = mx.dequantize(weight, ones, mx.zeros_like(ones), spec.group_size, spec.bits,
                          stream=mx.cpu)  # exact: small integers in float32
    return codes.astype(mx.uint8).view(mx.uint32)

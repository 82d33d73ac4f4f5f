"""Load a Hugging Face style model folder into an MLX model.

A folder holds ``config.json`` and one or more ``*.safetensors`` files (sharded with
``model.safetensors.index.json`` or not), optionally quantized in the mlx-community layout
(``quantization`` block in config; ``.scales``/``.biases`` beside packed weights).

Compute dtype: float32 on the CPU, where MLX's bf16/f16 matmuls and quantized matmuls with
reduced-precision scales are many times slower; bfloat16 on a GPU (float16 checkpoints keep
float16). On the CPU, quantized weights are dequantized to float32 at load time when the result
fits comfortably in memory (``ARBOR_DEQUANTIZE_LIMIT`` bytes, default 8 GiB), because that is
the fastest path through MLX's own CPU ops; otherwise they stay quantized with float32 scales.
When Arbor's native CPU kernels are built (``backend.kernels``), linear layers use them for
decode instead (``cpu_linear.py``) and quantized weights stay quantized.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from backend import kernels
from backend.errors import ModelLoadError, UnknownArchitectureError
from backend.models import ARCHITECTURES
from backend.models.cpu_linear import use_cpu_kernels
from backend.models.files import check_safetensors, read_config, weight_files

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    config: dict
    folder: Path
    dtype: mx.Dtype
    quantization: dict | None  # as in config, when the weights stay quantized
    source_quantization: dict | None  # what the checkpoint had

    @property
    def parameter_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


def default_dtype(config: dict) -> mx.Dtype:
    if mx.default_device() == mx.cpu:
        return mx.float32
    source = config.get("torch_dtype") or config.get("dtype")
    return mx.float16 if source == "float16" else mx.bfloat16


def _dequantize_all(weights: dict[str, mx.array], quant: dict, dtype: mx.Dtype) -> dict:
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".scales")]:
        prefix = key[: -len(".scales")]
        spec = quant.get(prefix, quant)
        w = mx.dequantize(weights[prefix + ".weight"], weights[key].astype(mx.float32),
                          weights[prefix + ".biases"].astype(mx.float32),
                          spec.get("group_size", 64), spec.get("bits", 4))
        out[prefix + ".weight"] = w.astype(dtype)
        del out[key], out[prefix + ".biases"]
    return out


def _should_dequantize(weights: dict[str, mx.array]) -> bool:
    if mx.default_device() != mx.cpu:
        return False
    limit = int(os.environ.get("ARBOR_DEQUANTIZE_LIMIT", 8 << 30))
    estimate = 0
    for k, w in weights.items():
        estimate += w.size * 4 * (32 // 4) if w.dtype == mx.uint32 else w.size * 4
    return estimate <= limit


def _kernel_weights(model: nn.Module) -> set[str]:
    """Weights of the plain linear and embedding layers, which the CPU kernels will run."""
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    return {f"{path}.weight" for path, m in leaves if type(m) in (nn.Linear, nn.Embedding)}


def _cast_weights(weights: dict[str, mx.array], compute: mx.Dtype, quantized: bool,
                  keep_16bit: set[str]) -> dict[str, mx.array]:
    """Cast to the compute dtype, except: quantization scales/biases become float32 on the CPU
    (MLX's CPU quantized ops are slow with 16-bit scales), and 16-bit weights named in
    ``keep_16bit`` stay 16-bit: the CPU kernels widen them to float32 exactly while streaming,
    so decode reads half the bytes with the same results as float32 weights."""
    scale_dtype = mx.float32 if mx.default_device() == mx.cpu else compute
    out = {}
    for name, value in weights.items():
        if quantized and name.endswith((".scales", ".biases")):
            out[name] = value.astype(scale_dtype)
        elif name in keep_16bit and value.dtype in (mx.bfloat16, mx.float16):
            out[name] = value
        elif mx.issubdtype(value.dtype, mx.floating):
            out[name] = value.astype(compute)
        else:
            out[name] = value
    return out


def load_model(folder: str | Path, dtype: str | None = None,
               cpu_kernels: bool | None = None) -> LoadedModel:
    """Load ``folder``; every user-caused failure is a one-line ``ModelLoadError``.

    ``cpu_kernels``: route linear layers through the native CPU kernels (None: when on the CPU
    in float32 and the kernels are built; False: never, e.g. to compare against plain MLX).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a model folder")
    config = read_config(folder)
    model_type = config.get("model_type")
    module = ARCHITECTURES.get(model_type)
    if module is None:
        raise UnknownArchitectureError(
            f"{folder}: unknown architecture model_type={model_type!r} "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    try:
        args = module.ModelArgs.from_config(config)
    except (TypeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{folder}/config.json: invalid value ({exc})") from None
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    compute = DTYPES[dtype] if dtype else default_dtype(config)

    weights: dict[str, mx.array] = {}
    for path in weight_files(folder):
        check_safetensors(path)
        try:
            weights.update(mx.load(str(path)))
        except Exception as exc:  # MLX raises plain RuntimeError/ValueError for bad files
            raise ModelLoadError(f"{path}: unreadable safetensors ({exc})") from None

    model = module.Model(args)
    weights = model.sanitize(weights)
    source_quant = config.get("quantization") or config.get("quantization_config")
    quant = source_quant if any(k.endswith(".scales") for k in weights) else None
    # With the native kernels, quantized weights stay quantized on the CPU (decode streams
    # fewer bytes); without them, dequantizing to float32 is the fastest CPU path.
    if cpu_kernels is None or cpu_kernels:
        cpu_kernels = (mx.default_device() == mx.cpu and compute == mx.float32
                       and kernels.available())
    if quant is not None and not cpu_kernels and _should_dequantize(weights):
        weights = _dequantize_all(weights, quant, compute)
        quant = None
    if quant is not None:
        def quantized(path: str, module_: nn.Module) -> bool | dict:
            if f"{path}.scales" not in weights:
                return False
            spec = quant.get(path, quant)
            return {"group_size": spec.get("group_size", 64), "bits": spec.get("bits", 4)}
        nn.quantize(model, class_predicate=quantized)
    keep = _kernel_weights(model) if cpu_kernels else set()
    weights = _cast_weights(weights, compute, quantized=quant is not None, keep_16bit=keep)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{folder}: weights do not match the config ({str(exc)[:300]})") from None
    mx.eval(model.parameters())
    if cpu_kernels:
        use_cpu_kernels(model)
    return LoadedModel(model, config, folder, compute, quant, source_quant)

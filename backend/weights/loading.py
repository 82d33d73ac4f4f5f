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
decode instead (``models/cpu_setup.py``) and quantized weights stay quantized; codes the kernels
do not read (2, 3, 5, 6 bits; GGUF imports) are widened to 8-bit codes of the same values.
Groups of 16 (GGUF Q2_K/Q3_K/Q6_K) are a layout MLX dequantizes but does not multiply: they run
on the kernels or are dequantized.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from backend import kernels
from backend.errors import CheckpointError, ConfigError, ModelLoadError
from backend.models import architecture_args
from backend.models.base import LanguageModel
from backend.models.cpu_linear import KernelQuantizedEmbedding, KernelQuantizedLinear
from backend.models.cpu_setup import use_cpu_kernels
from backend.models.moe import QuantizedSwitchLinear, SwitchLinear
from backend.weights.files import check_safetensors, read_config, weight_files
from backend.weights.quantize import (
    MATMUL_GROUP_SIZES,
    QuantSpec,
    read_quantization,
    spec_for,
    widen_codes,
)

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

#: Module kinds ``nn.quantize`` turns into quantized ones (what a ``.scales`` tensor may serve).
_QUANTIZABLE = (nn.Linear, nn.Embedding, SwitchLinear)

Quantization = tuple[QuantSpec | None, dict[str, QuantSpec | None]]  # read_quantization's


@dataclass
class LoadedModel:
    model: LanguageModel
    config: dict
    folder: Path
    dtype: mx.Dtype
    quantization: dict | None  # the config block, when the weights stay quantized
    cpu_kernels: bool = False  # linear layers run on the native CPU kernels

    @property
    def parameter_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


def default_dtype(config: dict) -> mx.Dtype:
    if mx.default_device() == mx.cpu:
        return mx.float32
    source = config.get("torch_dtype") or config.get("dtype")
    return mx.float16 if source == "float16" else mx.bfloat16


def _dequantize_all(weights: dict[str, mx.array], quant: Quantization,
                    dtype: mx.Dtype) -> dict:
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".scales")]:
        prefix = key[: -len(".scales")]
        spec = spec_for(prefix, *quant)
        w = mx.dequantize(weights[prefix + ".weight"], weights[key].astype(mx.float32),
                          weights[prefix + ".biases"].astype(mx.float32),
                          spec.group_size, spec.bits)
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


def _fit_quantized_layouts(model: LanguageModel, weights: dict[str, mx.array],
                           quant: Quantization, cpu_kernels: bool, compute: mx.Dtype
                           ) -> tuple[dict[str, mx.array], Quantization, dict[str, nn.Module]]:
    """Quantized layers in a form this run can multiply, values unchanged:

    * on the CPU kernels, linear and embedding layers whose codes the kernels do not read (2,
      3, 5 or 6 bits, or 4 bits in groups of 16: GGUF Q5_x, Q2_K..Q6_K) get the same values as
      8-bit codes (``widen_codes``); stacked experts only in groups of 16;
    * groups of 16 (GGUF Q2_K, Q3_K, Q6_K), which MLX dequantizes but its matmuls do not take:
      kernel layers (stacked experts: ``QuantizedSwitchLinear.from_arrays``, whose gathered
      products take the kernel) built from the arrays on the kernel path (returned by module
      path, for the caller to put in place of ``nn.quantize``), otherwise dequantized to
      ``compute``.

    Returns the weights, the quantization with updated per-module specs, and those layers."""
    default, overrides = quant[0], dict(quant[1])
    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    out = dict(weights)
    prebuilt: dict[str, nn.Module] = {}
    for path in [k[: -len(".scales")] for k in weights if k.endswith(".scales")]:
        spec = spec_for(path, default, overrides)
        kind = type(modules[path])
        on_kernels = cpu_kernels and kind in (nn.Linear, nn.Embedding, SwitchLinear)
        # Stacked experts hold most of an MoE's bytes: their codes are widened only where MLX
        # cannot multiply them (groups of 16); other layouts keep MLX's gather_qmm.
        widen = kind is not SwitchLinear or spec.group_size not in MATMUL_GROUP_SIZES
        if on_kernels and widen and not kernels.quantized_layout_supported(spec.bits,
                                                                            spec.group_size):
            out[f"{path}.weight"] = widen_codes(out[f"{path}.weight"], spec)
            spec = overrides[path] = QuantSpec(spec.group_size, 8)
        if spec.group_size in MATMUL_GROUP_SIZES:
            continue
        arrays = [out[f"{path}.{name}"] for name in ("weight", "scales", "biases")]
        if on_kernels:
            arrays[1:] = [a.astype(mx.float32) for a in arrays[1:]]
            if kind is nn.Linear:
                prebuilt[path] = KernelQuantizedLinear(*arrays, spec.group_size, spec.bits,
                                                       out.get(f"{path}.bias"))
            elif kind is SwitchLinear:
                prebuilt[path] = QuantizedSwitchLinear.from_arrays(*arrays, spec.group_size,
                                                                   spec.bits)
            else:
                prebuilt[path] = KernelQuantizedEmbedding(*arrays, spec.group_size, spec.bits)
            continue
        dense = mx.dequantize(arrays[0], arrays[1].astype(mx.float32),
                              arrays[2].astype(mx.float32), spec.group_size, spec.bits,
                              stream=mx.cpu)
        out[f"{path}.weight"] = dense.astype(compute)
        del out[f"{path}.scales"], out[f"{path}.biases"]
        overrides[path] = None
    return out, (default, overrides), prebuilt


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


def read_checkpoint(folder: Path, source: Path | None = None
                    ) -> tuple[dict, LanguageModel, dict[str, mx.array], Quantization]:
    """Config, model (not yet loaded) and sanitized weights of ``folder``, checked against each
    other; nothing is evaluated, so this is cheap enough to vet a folder before importing it.

    Every fault is a one-line ``ModelLoadError`` naming ``source`` (default: the folder): a bad
    config value (``ConfigError``), a weight that is missing, unexpected, misshapen or of the
    wrong kind (``CheckpointError``), an unreadable file.
    """
    config_source = folder / "config.json" if source is None else source
    source = source or folder
    config = read_config(folder)
    module, args = architecture_args(config, config_source)
    try:
        quant = read_quantization(config)
    except ConfigError as exc:
        raise ConfigError(f"{config_source}: {exc}") from None
    weights: dict[str, mx.array] = {}
    for path in weight_files(folder):
        check_safetensors(path)
        try:
            weights.update(mx.load(str(path)))
        except Exception as exc:  # MLX raises plain RuntimeError/ValueError for bad files
            raise ModelLoadError(f"{path}: unreadable safetensors ({exc})") from None
    model = module.Model(args)
    quant = _renamed_overrides(model, quant)
    try:
        weights = model.sanitize(weights)
        check_weights(model, weights, quant)
    except CheckpointError as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    return config, model, weights, quant


def _renamed_overrides(model: LanguageModel, quant: Quantization) -> Quantization:
    """Per-module quantization overrides under the model's own module names: the config names
    modules as the checkpoint does, which may nest the decoder (``language_model.model.*``)."""
    default, overrides = quant
    renamed = {}
    for name, spec in overrides.items():
        own = model.parameter_name(name)
        if own is not None:
            renamed[own] = spec
    return default, renamed


def check_weights(model: LanguageModel, weights: dict[str, mx.array],
                  quant: Quantization) -> None:
    """Every parameter of the (unquantized) module tree is in ``weights`` with the shape and
    kind it needs, and nothing else is; ``CheckpointError`` naming the tensor otherwise.

    A module with ``<module>.scales`` in ``weights`` is quantized with its spec from ``quant``:
    packed uint32 ``weight`` and floating ``scales`` / ``biases`` of the shapes that spec gives.
    Checked before any array op, so no op can fail on a misshapen tensor later.
    """
    parameters = dict(tree_flatten(model.parameters()))
    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    needed: dict[str, tuple[tuple[int, ...], bool]] = {}  # name -> (shape, packed codes?)
    for name, param in parameters.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and f"{module}.scales" in weights):
            needed[name] = (tuple(param.shape), False)
            continue
        spec = spec_for(module, *quant)
        if spec is None:
            raise CheckpointError(f"{module} is quantized ({module}.scales) but config.json "
                                  "gives no quantization for it")
        if not isinstance(modules.get(module), _QUANTIZABLE):
            raise CheckpointError(f"{module}.scales: {module} is not a layer that can be "
                                  "quantized")
        *lead, inputs = param.shape
        if inputs % spec.group_size:
            raise CheckpointError(f"{name}: {inputs} inputs do not split into groups of "
                                  f"{spec.group_size}")
        needed[name] = ((*lead, inputs * spec.bits // 32), True)
        groups = (*lead, inputs // spec.group_size)
        needed[f"{module}.scales"] = needed[f"{module}.biases"] = (groups, False)
    missing = [n for n in needed if n not in weights]
    if missing:
        raise CheckpointError(f"missing tensors {_names(missing)}")
    unexpected = [n for n in weights if n not in needed]
    if unexpected:
        raise CheckpointError(f"unexpected tensors {_names(unexpected)} (not used by "
                              f"model_type {model.args.model_type!r})")
    for name, (shape, packed) in needed.items():
        value = weights[name]
        if tuple(value.shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {list(value.shape)}, the config "
                                  f"needs {list(shape)}")
        if packed and value.dtype != mx.uint32:
            raise CheckpointError(f"tensor {name} has dtype {_dtype_name(value)}, quantized "
                                  "weights are packed uint32")
        if not packed and name in parameters and \
                mx.issubdtype(parameters[name].dtype, mx.integer):  # ids (a lookup table)
            if not mx.issubdtype(value.dtype, mx.integer):
                raise CheckpointError(f"tensor {name} has dtype {_dtype_name(value)}, expected "
                                      "integer ids")
        elif not packed and not mx.issubdtype(value.dtype, mx.floating):
            raise CheckpointError(f"tensor {name} has dtype {_dtype_name(value)}, expected "
                                  "a floating-point type")


def _names(names: list[str]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(sorted(names)[:3]) + more


def _dtype_name(value: mx.array) -> str:
    return str(value.dtype).removeprefix("mlx.core.")


def load_model(folder: str | Path, dtype: str | None = None,
               cpu_kernels: bool | None = None) -> LoadedModel:
    """Load ``folder``; every user-caused failure is a one-line ``ModelLoadError``.

    ``cpu_kernels``: route linear layers through the native CPU kernels (None: when on the CPU
    in float32 and the kernels are built; False: never, e.g. to compare against plain MLX).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a model folder")
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    config, model, weights, quant = read_checkpoint(folder)
    compute = DTYPES[dtype] if dtype else default_dtype(config)
    quantized = any(k.endswith(".scales") for k in weights)
    # With the native kernels, quantized weights stay quantized on the CPU (decode streams
    # fewer bytes); without them, dequantizing to float32 is the fastest CPU path.
    if cpu_kernels is None or cpu_kernels:
        cpu_kernels = (mx.default_device() == mx.cpu and compute == mx.float32
                       and kernels.available())
    if quantized and not cpu_kernels and _should_dequantize(weights):
        weights = _dequantize_all(weights, quant, compute)
        quantized = False
    if quantized:
        weights, quant, prebuilt = _fit_quantized_layouts(model, weights, quant, cpu_kernels,
                                                          compute)

        def quantized_layer(path: str, module_: nn.Module) -> bool | dict:
            if f"{path}.scales" not in weights or path in prebuilt:
                return False
            return spec_for(path, *quant).as_config()
        nn.quantize(model, class_predicate=quantized_layer)
        if prebuilt:
            model.update_modules(tree_map_with_path(lambda path, m: prebuilt.get(path, m),
                                                    model.leaf_modules(),
                                                    is_leaf=nn.Module.is_module))
    keep = _kernel_weights(model) if cpu_kernels else set()
    weights = _cast_weights(weights, compute, quantized=quantized, keep_16bit=keep)
    model.load_weights(list(weights.items()), strict=True)  # check_weights vetted every name
    mx.eval(model.parameters())
    if cpu_kernels:
        use_cpu_kernels(model)
    block = config.get("quantization") or config.get("quantization_config")
    return LoadedModel(model, config, folder, compute, block if quantized else None,
                       cpu_kernels=bool(cpu_kernels))

"""Put a loaded model on the CPU fast path: the one place that turns the native kernels on.

``use_cpu_kernels`` swaps the model's linear and embedding layers for the kernel layers of
``cpu_linear.py``, switches the shared layers' ``native_ops``, stacks the projections that share
an input and builds each layer's fused few-row forward (``fused_layer.py``); ``use_int8_inputs``
lets a draft model's 4-bit products round their inputs to int8. The dependencies run one way:
``cpu_setup`` -> ``fused_layer`` -> ``cpu_linear`` (no import circle).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from backend import kernels
from backend.models.cpu_linear import (
    KernelEmbedding,
    KernelLinear,
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    StackedProjections,
)
from backend.models.fused_layer import FusedLayer


def _swap(_path: str, module: nn.Module) -> nn.Module:
    affine = getattr(module, "mode", "affine") == "affine"
    if isinstance(module, nn.QuantizedLinear) and module.bits in (4, 8) and affine:
        return KernelQuantizedLinear.from_layer(module)
    if isinstance(module, nn.Linear) and type(module) is nn.Linear:
        return KernelLinear(module.weight, module.get("bias"))
    if type(module) is nn.QuantizedEmbedding and module.bits in (4, 8) and affine:
        return KernelQuantizedEmbedding.from_layer(module)
    if type(module) is nn.Embedding:
        return KernelEmbedding(module)
    return module


def use_cpu_kernels(model: nn.Module) -> bool:
    """Route the model's linear layers, and its RMS norms, RoPE, attention and gates (those
    with a ``native_ops`` switch) through the native kernels, stack the projections that
    share an input (``stackable_projections``) and give the layers that allow it their fused
    few-row forward (``fused``, models/fused_layer.py); False if unavailable."""
    if not kernels.available():
        return False
    model.update_modules(tree_map_with_path(_swap, model.leaf_modules(),
                                            is_leaf=nn.Module.is_module))
    for _, module in model.named_modules():
        if hasattr(module, "native_ops"):
            module.native_ops = True
        names = getattr(module, "stackable_projections", ())
        if names:
            module.stacked = StackedProjections.build([module[name] for name in names])
    for _, module in model.named_modules():
        if hasattr(module, "fused"):
            module.fused = FusedLayer.build(module)
    return True


def has_panels(model: nn.Module) -> bool:
    """Whether any of the model's linear layers or embedding tables holds float32 panels."""
    return any(isinstance(module, (KernelLinear, KernelEmbedding)) and module.weight.ndim == 3
               for _, module in model.named_modules())


def products_all_on_panels(model: nn.Module) -> bool:
    """Whether every matrix product of the model runs on float32 panels (``KernelLinear``
    with packed weights; the tied embedding's head aside, whose kernel is row-invariant too):
    then prefill in the row-invariant 64-row chunks costs nothing (panels outrun BLAS from 8
    rows on), and the engine makes it its default. Quantized layers (their 64-row kernel
    prefills 1.5-1.7x slower than dequantize + BLAS), 16-bit row-major weights, experts and
    convolutions keep the plain prefill."""
    panels = False
    for _, module in model.named_modules():
        weight = module.get("weight") if not isinstance(module, KernelEmbedding) else None
        if not isinstance(weight, mx.array) or weight.ndim < 2:
            continue  # no matrix here (or the tied head's table)
        if not (isinstance(module, KernelLinear) and weight.ndim == 3):
            return False
        panels = True
    return panels


def use_int8_inputs(model: nn.Module) -> int:
    """Let the model's 4-bit kernel products (groups of 64 or 128) round their inputs to int8,
    for a draft model: its decode steps take ~20% less time (SmolLM2-135M here), at ~2%
    relative error in each product, and what it drafts is only a proposal the target
    verifies, so replies do not change (acceptance may, a little). Rebuilds the fused layers,
    which copy the setting.
    Returns how many layers it switched; 0 for models off the kernels or not so quantized."""
    switched = 0
    for _, module in model.named_modules():
        if isinstance(module, (KernelQuantizedLinear, KernelQuantizedEmbedding)) and \
                kernels.int8_inputs_supported(module.bits, module.group_size):
            module.int8_inputs = True
            switched += 1
    if switched:
        for _, module in model.named_modules():
            if getattr(module, "fused", None) is not None:
                module.fused = FusedLayer.build(module)
    return switched

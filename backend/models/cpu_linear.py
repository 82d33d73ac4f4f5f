"""CPU compute path for linear layers: native matvec kernels for decode, BLAS for prefill.

Decode multiplies one (or, when verifying drafts, a few) activation rows by every weight
matrix, so it is bound by how fast the weights stream from memory. Through BLAS sgemv that is
well under the memory bandwidth on this class of CPU, and MLX's own quantized matmul on the CPU
is slower still; the optional native kernels (``backend.kernels``) stream float32 and
affine-quantized weights at close to bandwidth. Prefill (many rows) is compute bound and stays
on BLAS sgemm: quantized weights are dequantized per call for it, which costs one pass over the
weights per chunk and keeps only the quantized copy resident.

``cpu_setup.use_cpu_kernels(model)`` swaps every ``nn.Linear`` / ``nn.QuantizedLinear`` and
the embedding's output projection (tied embeddings) for these modules. Parameter names do not
change, so loading and saving are unaffected. This module holds only the layers: the set-up
that swaps them in (and builds the fused layers on top of them) is ``cpu_setup.py``, so the
fused layers can import these without an import circle.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from backend import kernels

#: Up to this many activation rows go to the kernels (decode, draft verification).
MAX_KERNEL_ROWS = kernels.MAX_KERNEL_ROWS


def _quantized_product(layer: nn.Module, x: mx.array) -> mx.array:
    """x @ W.T for an affine-quantized W: kernel for decode and short prefills, dequantize +
    BLAS for long ones (``kernels.quantized_linear`` picks)."""
    return kernels.quantized_linear(x, layer.weight, layer.scales, layer.biases,
                                    layer.group_size, layer.bits, layer.int8_inputs)


class KernelLinear(nn.Module):
    """Linear layer with float32 activations and float32 or 16-bit weights: float32 weights
    (out a multiple of 16) as panels (``kernels.pack_panels``: (out / 16, in, 16)) that the
    kernel takes for any number of rows; others row-major, kernel matvec for few rows, BLAS
    (on weights widened to float32) otherwise."""

    def __init__(self, weight: mx.array, bias: mx.array | None):
        super().__init__()
        self.weight = kernels.as_panels(weight)  # (out, in), or its panels
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        y = kernels.linear(x, self.weight)
        return y + self.bias if "bias" in self else y


class KernelQuantizedLinear(nn.Module):
    """Affine-quantized linear layer (float32 scales): kernel for few rows, else dequantize +
    BLAS. ``int8_inputs`` (set by ``use_int8_inputs``): the kernel rounds inputs to int8.
    Built from arrays, so it also holds layouts ``nn.QuantizedLinear`` cannot (8-bit codes in
    groups of 16, from GGUF K-quants)."""

    def __init__(self, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int, bias: mx.array | None = None):
        super().__init__()
        self.group_size, self.bits = group_size, bits
        self.int8_inputs = False
        self.weight, self.scales = weight, scales.astype(mx.float32)
        self.biases = biases.astype(mx.float32)
        if bias is not None:
            self.bias = bias
        self.freeze()

    @classmethod
    def from_layer(cls, layer: nn.QuantizedLinear) -> "KernelQuantizedLinear":
        return cls(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits,
                   layer.get("bias"))

    def __call__(self, x: mx.array) -> mx.array:
        y = _quantized_product(self, x)
        return y + self.bias if "bias" in self else y


class KernelEmbedding(nn.Embedding):
    """Embedding whose tied output projection (``as_linear``) uses the kernel; rows of a
    16-bit table are widened to float32 on lookup. A float32 table (vocabulary a multiple of
    16) is kept as panels, like ``KernelLinear``'s weights: the projection of a batched step
    then runs the panel kernel, and lookups gather each row's values from their panel. Code
    that needs rows calls the module (``embedding(ids)``), never indexes ``weight``."""

    def __init__(self, layer: nn.Embedding):
        super().__init__(*layer.weight.shape)
        self.weight = kernels.as_panels(layer.weight)

    def __call__(self, x: mx.array) -> mx.array:
        if self.weight.ndim == 3:
            return kernels.panel_rows(self.weight, x)
        return self.weight[x].astype(mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return kernels.linear(x, self.weight)


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """Quantized embedding: lookups as MLX does them (``mx.dequantize`` of the rows, which
    takes every group size), the tied projection through the kernel. Built from arrays, like
    ``KernelQuantizedLinear``."""

    def __init__(self, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int):
        nn.Module.__init__(self)  # not nn.QuantizedEmbedding's: it quantizes a random table
        self.num_embeddings, self.dims = weight.shape[0], weight.shape[1] * 32 // bits
        self.group_size, self.bits, self.mode = group_size, bits, "affine"
        self.int8_inputs = False
        self.weight, self.scales = weight, scales.astype(mx.float32)
        self.biases = biases.astype(mx.float32)
        self.freeze()

    @classmethod
    def from_layer(cls, layer: nn.QuantizedEmbedding) -> "KernelQuantizedEmbedding":
        return cls(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return _quantized_product(self, x)


class StackedProjections:
    """Kernel linear layers that read the same input (q/k/v, gate/up) stacked by rows into one
    matrix, so decode makes one kernel call instead of several (each call costs a graph node
    and a thread-pool hand-off) and prefill one larger BLAS product. The layers' own parameters
    become row slices of the stacked arrays, which MLX keeps as views of one buffer: no weight
    is stored twice. Decode outputs equal the separate layers' exactly.
    Built once the weights are loaded: replacing a layer's arrays afterwards would not reach
    the stacked matrix."""

    def __init__(self, layers: list[nn.Module], names: list[str]):
        self.layers = layers
        self.quantized = isinstance(layers[0], KernelQuantizedLinear)
        self.widths = [kernels.outputs(layer.weight) for layer in layers]
        self.stacked: dict[str, mx.array] = {}
        for name in names:
            whole = mx.concatenate([layer[name] for layer in layers], axis=0)
            mx.eval(whole)
            self.stacked[name] = whole
            unit = kernels.PANEL if whole.ndim == 3 else 1  # panels hold 16 outputs each
            start = 0
            for layer, width in zip(layers, self.widths):
                layer[name] = whole[start // unit:(start + width) // unit]
                start += width
            mx.eval([layer[name] for layer in layers])
        self.splits = [sum(self.widths[:i]) for i in range(1, len(layers))]

    @classmethod
    def build(cls, layers: list[nn.Module]) -> "StackedProjections | None":
        """Stack ``layers`` when they are kernel layers of one kind over one input width (same
        weight dtype, or same bits and group size; biases on all or none), else None."""
        first = layers[0]
        if not all(type(layer) is type(first) for layer in layers):
            return None
        if not isinstance(first, (KernelLinear, KernelQuantizedLinear)):
            return None
        if len({"bias" in layer for layer in layers}) != 1:
            return None
        same = all(layer.weight.shape[1] == first.weight.shape[1]
                   and layer.weight.dtype == first.weight.dtype for layer in layers)
        names = ["weight"] + (["bias"] if "bias" in first else [])
        if isinstance(first, KernelQuantizedLinear):
            same = same and all((layer.bits, layer.group_size) == (first.bits, first.group_size)
                                for layer in layers)
            names += ["scales", "biases"]
        if not same:
            return None
        if len({layer.weight.ndim for layer in layers}) > 1:
            # Some in panels, some not (outputs off a multiple of 16): all go back to rows,
            # as panels cannot be cut between two layers' outputs.
            for layer in layers:
                if layer.weight.ndim == 3:
                    layer.weight = kernels.unpack_panels(layer.weight)
                    mx.eval(layer.weight)
        return cls(layers, names)

    def __call__(self, x: mx.array) -> list[mx.array]:
        w = self.stacked
        if self.quantized:
            first = self.layers[0]
            y = kernels.quantized_linear(x, w["weight"], w["scales"], w["biases"],
                                         first.group_size, first.bits, first.int8_inputs)
        else:
            y = kernels.linear(x, w["weight"])
        if "bias" in w:
            y = y + w["bias"]
        return mx.split(y, self.splits, axis=-1)

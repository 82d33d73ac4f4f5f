"""Optional native MLX CPU kernels for decode-time matrix-vector products.

On Linux x86-64, MLX's CPU backend sends ``x @ w.T`` with one to a few rows of ``x`` to
BLAS sgemv, which streams the weights well below the memory bandwidth. The extension
built from this folder adds two MLX primitives (they stay in MLX's lazy graph, work with
``mx.async_eval`` and ``mx.compile``) that stream each weight row once with AVX-512 or
AVX2 FMA on a small thread pool:

* ``matvec(x, w)``: ``x`` (..., K) float32, ``w`` (N, K) float32, bfloat16 or float16
  -> ``x @ w.T`` in float32 (16-bit weights widen exactly: a bf16 checkpoint streams
  half the bytes of its float32 upcast, same result).
* the same ``matvec`` with ``w`` float32 *panels* (``pack_panels``: (N / 16, K, 16), each
  panel 16 outputs' weights k-major): every output is one chain of fused multiply-adds over
  k, so a row's result is the same whatever the rows around it, on AVX-512 and AVX2 alike,
  and several rows share each weight load without horizontal sums (30 layers of SmolLM2-135M:
  8 rows 1.7x as fast as row-major weights, 64 rows 1.3x BLAS). The kernel linear and embedding
  layers keep float32 weights so (``as_panels``) and run every product through it, prefill
  included.
* ``matvec_q(x, wq, scales, biases, group_size, bits)``: the same for weights in MLX's
  affine quantized layout (``mx.quantize``), bits 4 or 8, group size 32/64/128, float32
  scales and biases; equals ``mx.quantized_matmul(..., transpose=True)``.

Both are meant for a handful of rows of ``x`` (decode, speculative verification: up to
~8); callers keep MLX's own matmul for prefill.

Three more primitives cover the rest of a decode step, where MLX's CPU backend runs a graph
of tiny ops (a dispatch each) for what is one pass over a few KB:

* ``attention(q, k, v, scale, causal)``: softmax attention of up to 8 float32 queries per head
  over a cache view (grouped-query heads read each key/value row once);
* ``rms_norm(x, weight, eps)`` and ``rope(x, dims, offset, scale, inv_freqs)``: the
  ``mx.fast`` ops for decode-sized float32 inputs (larger ones stay with MLX).

Two fused blocks make a Llama-style layer's few-row forward four graph nodes instead of ~26
(with the cache's two in-place writes between them; at decode sizes a node's building and
dispatch cost more than its arithmetic), calling the same functions as the ops above, so
their results are the same bit for bit:

* ``attention_inputs``: RMS norm, the stacked q/k/v product, RoPE of q and k;
* ``attention_mlp``: attention over a cache's buffers, output projection, residual, RMS norm,
  gated MLP, residual.

Stacked matrices (MoE experts, per-head projections) have a gathered form: ``gather_linear`` /
``gather_quantized_linear`` multiply each row by the matrix its index picks, rows that pick the
same matrix in one pass over it (MLX's ``gather_mm`` on the CPU runs a slow product per row).

Models turn them on per module (``native_ops``) when ``use_cpu_kernels`` runs. ``linear`` / ``quantized_linear`` make
that choice (kernel when available and it applies, plain MLX otherwise). Nothing here raises when the extension is absent: ``available()`` is False
(not built, built for another MLX, macOS, non-x86 CPU, or ``ARBOR_KERNELS=0``) and
callers use plain MLX. ``ensure_built()`` compiles it on first use where a compiler and
nanobind are present; ``python -m backend.kernels.build`` does the same from a shell.

Environment: ``ARBOR_KERNELS=0`` disables the extension; ``ARBOR_MATVEC_THREADS`` caps
its threads (default: usable cores); ``ARBOR_MATVEC_ISA=generic|avx2|avx512`` forces an
instruction set; ``ARBOR_MATVEC_SPIN_US`` is how long idle workers spin (default 300);
``ARBOR_PANELS=0`` keeps float32 weights row-major (the earlier kernels; for comparisons).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from types import ModuleType
from typing import Any, NamedTuple

__all__ = [
    "available",
    "ensure_built",
    "isa",
    "clone_level",
    "numerics",
    "attention",
    "dequantize",
    "gather_linear",
    "gather_quantized_linear",
    "linear",
    "matvec",
    "matvec_q",
    "as_panels",
    "pack_panels",
    "panels_apply",
    "quantized_linear",
    "rms_norm",
    "rope",
    "set_num_threads",
    "silu_mul",
    "unavailable_reason",
]

_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None  # why the module is not loaded, once we tried
_tried = False


def _try_load() -> ModuleType | None:
    """Loads the compiled module once; records why not on failure. Never raises."""
    global _module, _reason, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _module, _reason = _load()
        _tried = True
    return _module


def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get("ARBOR_KERNELS", "").strip().lower() in ("0", "off", "false", "no"):
        return None, "disabled by ARBOR_KERNELS"
    try:
        from backend.kernels import build as _build
    except Exception as e:  # noqa: BLE001
        return None, f"build helper unavailable: {e}"
    ok, why = _build.supported_platform()
    if not ok:
        return None, why
    path = _build.module_path()
    if not path.is_file() or not _build.INFO_FILE.is_file():
        return None, "not built (run python -m backend.kernels.build)"
    try:
        import mlx.core as mx

        info = json.loads(_build.INFO_FILE.read_text())
        if info.get("mlx") != mx.__version__:
            return None, f"built for MLX {info.get('mlx')}, running {mx.__version__}"
        if info.get("python") != _build.sysconfig.get_config_var("EXT_SUFFIX"):
            return None, f"built for another Python ({info.get('python')})"
        name = f"{__name__}._arbor_kernels"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None, f"cannot load {path}"
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
        runtime = mod.runtime_mlx_version()
        if not runtime.startswith(mod.built_for_mlx):
            return None, f"built against MLX {mod.built_for_mlx} headers, running {runtime}"
        return mod, None
    except Exception as e:  # noqa: BLE001 - a broken build must only disable the kernels
        return None, f"failed to load {path.name}: {type(e).__name__}: {e}"


def available() -> bool:
    """True when the native kernels are built for this MLX and loadable here."""
    return _try_load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    _try_load()
    return _reason


def ensure_built(quiet: bool = True) -> bool:
    """Builds the extension if needed (compiler and nanobind permitting); True if usable.

    Never raises: on any failure the kernels stay unavailable and the reason is kept for
    ``unavailable_reason()``.
    """
    global _tried, _reason
    if _module is not None:
        return True
    try:
        from backend.kernels import build as _build

        ok, why = _build.supported_platform()
        if not ok:
            _reason = why
            return False
        _build.build(quiet=quiet)
    except Exception as e:  # noqa: BLE001 - BuildError, OSError, timeouts...
        with _lock:
            _tried, _reason = True, f"build failed: {e}"
        return False
    with _lock:
        _tried = False  # reload with the fresh build
    return available()


def _mod() -> Any:
    mod = _try_load()
    if mod is None:
        raise RuntimeError(f"Arbor native kernels are unavailable: {_reason}")
    return mod


def matvec(x: Any, w: Any) -> Any:
    """``x @ w.T`` for float32 ``x`` (..., K) and ``w`` (N, K) -> (..., N), lazily.

    Raises ValueError naming the shapes when they do not fit, RuntimeError when the
    extension is unavailable (check ``available()`` first). Strided inputs are accepted
    (weights with unit-stride rows directly, anything else through a copy).
    """
    return _mod().matvec(x, w)


def matvec_q(x: Any, wq: Any, scales: Any, biases: Any, group_size: int = 64, bits: int = 4,
             int8_inputs: bool = False) -> Any:
    """``mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size, bits)``.

    For float32 ``x`` (..., K), ``wq`` uint32 (N, K*bits/32) as ``mx.quantize`` packs it,
    float32 ``scales``/``biases`` (N, K/group_size); bits 4 or 8, group_size 32, 64 or 128.
    ``int8_inputs``: round each block of 64 inputs to int8 first (by its own scale, max |x| /
    127), 4-bit weights in groups of 64 or 128 only: ~1.5x as fast, ~2% relative error.
    Raises ValueError naming the shapes (or the unsupported layout) otherwise.
    """
    return _mod().matvec_q(x, wq, scales, biases, int(group_size), int(bits), bool(int8_inputs))


#: Most rows (tokens: the product of the leading dims) that the few-row ops send to the
#: kernels: ``linear``, ``quantized_linear``, ``attention`` (queries per head), ``rms_norm``,
#: ``rope`` and the fused layer blocks. The kernels reduce every row exactly as a one-row call
#: would, so anything up to here (a verify block, a batched step, an exact-prefill chunk)
#: computes each row bit for bit as a decode step does; more rows go to MLX (BLAS), faster
#: for long prefill chunks but rounded otherwise (products with float32 panels excepted: the
#: kernel takes any number of rows). 64: past it a 4x4-tiled product gains little; with
#: panels an exact-prefill chunk of 64 rows prefills 1.1-1.15x faster than BLAS's chunks.
MAX_KERNEL_ROWS = 64

#: The affine layouts ``matvec_q`` / ``dequantize`` (and the fused blocks) take: 4- or 8-bit
#: codes in groups of 32, 64 or 128, and 8-bit codes in groups of 16 (``quantized_layout_supported``).
QUANTIZED_BITS = (4, 8)
QUANTIZED_GROUP_SIZES = (32, 64, 128)
#: The smaller group the 8-bit kernels also take: GGUF K-quants' 16-weight sub-blocks.
SMALL_GROUP_SIZE = 16
#: The group sizes MLX's own quantized products (``mx.quantized_matmul``, ``mx.gather_qmm``)
#: take; MLX dequantizes groups of 16 but does not multiply by them.
MLX_MATMUL_GROUP_SIZES = (32, 64, 128)


def quantized_layout_supported(bits: int, group_size: int) -> bool:
    """Whether the quantized kernels take weights of ``bits`` in groups of ``group_size``."""
    return (bits in QUANTIZED_BITS and group_size in QUANTIZED_GROUP_SIZES) or (
        bits == 8 and group_size == SMALL_GROUP_SIZE)

#: The layouts whose products can round their inputs to int8 (``int8_inputs``).
INT8_INPUT_BITS = 4
INT8_INPUT_GROUP_SIZES = (64, 128)


def int8_inputs_supported(bits: int, group_size: int) -> bool:
    """Whether ``quantized_linear(..., int8_inputs=True)`` applies to weights of this kind."""
    return bits == INT8_INPUT_BITS and group_size in INT8_INPUT_GROUP_SIZES


_DENSE_W = None


def _rows(x: Any) -> int:
    m = 1
    for d in x.shape[:-1]:
        m *= d
    return m


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


#: Outputs per panel (``pack_panels``).
PANEL = 16


def panels_apply(w: Any) -> bool:
    """Whether ``w`` is kept as panels: a float32 (N, K) matrix, N a multiple of PANEL, with
    the kernels available on the CPU device (and ``ARBOR_PANELS`` not 0)."""
    import mlx.core as mx

    return (w.ndim == 2 and w.dtype == mx.float32 and w.shape[0] % PANEL == 0
            and w.shape[0] > 0 and os.environ.get("ARBOR_PANELS", "1") != "0"
            and available() and _on_cpu())


def pack_panels(w: Any) -> Any:
    """float32 ``w`` (N, K) as panels (N / PANEL, K, PANEL): panel p holds outputs
    PANEL * p .. PANEL * p + PANEL - 1, k-major (evaluated, so ``w`` may be freed)."""
    import mlx.core as mx

    n, k = w.shape
    panels = mx.contiguous(w.reshape(n // PANEL, PANEL, k).swapaxes(1, 2))
    mx.eval(panels)
    return panels


def as_panels(w: Any) -> Any:
    """``w`` as the kernel layers hold it: panels where ``panels_apply``, else as it is."""
    return pack_panels(w) if panels_apply(w) else w


def unpack_panels(panels: Any) -> Any:
    """The (N, K) matrix of ``pack_panels``' panels (lazy)."""
    p, k, width = panels.shape
    return panels.swapaxes(1, 2).reshape(p * width, k)


def panel_rows(panels: Any, ids: Any) -> Any:
    """Rows ``ids`` (any shape) of the (N, K) matrix held as ``panels``: (*ids.shape, K)."""
    import mlx.core as mx

    _, k, width = panels.shape
    ids = ids.astype(mx.int32)
    start = (ids // width) * (k * width) + ids % width  # each row's value at k = 0
    return mx.take(panels.reshape(-1), start[..., None] + mx.arange(k) * width)


def outputs(w: Any) -> int:
    """N of a dense weight: (N, K) rows or (N / PANEL, K, PANEL) panels."""
    return w.shape[0] * w.shape[2] if w.ndim == 3 else w.shape[0]


def linear(x: Any, w: Any) -> Any:
    """``x @ w.T``: the native kernel for float32 ``x`` with at most MAX_KERNEL_ROWS rows
    on the CPU device (w float32/bfloat16/float16), MLX's matmul otherwise. ``w`` may be
    panels (``pack_panels``): then the kernel takes any number of rows (its products are
    row-invariant and outrun BLAS from 8 rows on)."""
    global _DENSE_W
    import mlx.core as mx

    if w.ndim == 3:
        if x.dtype == mx.float32 and x.ndim >= 1 and available() and _on_cpu():
            return _module.matvec(x, w)
        return x @ unpack_panels(w).T
    if _DENSE_W is None:
        _DENSE_W = (mx.float32, mx.bfloat16, mx.float16)
    if (
        x.dtype == mx.float32
        and w.dtype in _DENSE_W
        and w.ndim == 2
        and x.ndim >= 1
        and x.shape[-1] == w.shape[1]
        and _rows(x) <= MAX_KERNEL_ROWS
        and available()
        and _on_cpu()
    ):
        return _module.matvec(x, w)
    return x @ w.T


def quantized_linear(
    x: Any, wq: Any, scales: Any, biases: Any, group_size: int = 64, bits: int = 4,
    int8_inputs: bool = False,
) -> Any:
    """``mx.quantized_matmul(x, wq, scales, biases, transpose=True, ...)``, through the
    native kernel when it applies (float32 x/scales/biases, ``quantized_layout_supported``, at
    most MAX_KERNEL_ROWS rows, CPU device); otherwise ``dequantize`` + matmul (more
    rows, or groups MLX does not multiply by), or MLX's own product.

    ``int8_inputs`` (4-bit weights in groups of 64 or 128, see ``int8_inputs_supported``): the
    kernel rounds each block of 64 inputs to int8 first, ~1.5x as fast at ~2% relative
    error in the products: for a draft model, whose tokens the target verifies. Products on
    the other paths (long prefills) stay exact."""
    import mlx.core as mx

    if (
        quantized_layout_supported(bits, group_size)
        and x.dtype == mx.float32
        and scales.dtype == mx.float32
        and biases is not None
        and biases.dtype == mx.float32
        and _rows(x) <= MAX_KERNEL_ROWS
        and available()
        and _on_cpu()
    ):
        try:
            return _module.matvec_q(x, wq, scales, biases, group_size, bits,
                                    int8_inputs and int8_inputs_supported(bits, group_size))
        except ValueError:
            pass  # shapes MLX may still accept (or reject with its own message)
    if biases is not None and (group_size not in MLX_MATMUL_GROUP_SIZES or (
            x.dtype == mx.float32 and _rows(x) > MAX_KERNEL_ROWS)):
        return x @ dequantize(wq, scales, biases, group_size, bits).astype(x.dtype).T
    return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)


def dequantize(wq: Any, scales: Any, biases: Any, group_size: int = 64, bits: int = 4) -> Any:
    """``mx.dequantize`` to float32; the native (threaded, ~7x faster) kernel for float32
    scales/biases in a ``quantized_layout_supported`` layout on the CPU, MLX otherwise."""
    import mlx.core as mx

    if (
        quantized_layout_supported(bits, group_size)
        and scales.dtype == mx.float32
        and biases is not None
        and biases.dtype == mx.float32
        and available()
        and _on_cpu()
    ):
        try:
            return _module.dequantize(wq, scales, biases, group_size, bits)
        except ValueError:
            pass
    return mx.dequantize(wq, scales, biases, group_size, bits).astype(mx.float32)


#: Most query rows per head that ``attention`` sends to the kernel (decode, verify blocks,
#: exact-prefill chunks); each query is reduced over exactly its visible keys, as a one-query
#: call would.
MAX_ATTENTION_QUERIES = MAX_KERNEL_ROWS

#: Largest input (elements) ``rms_norm`` / ``rope`` send to the kernels: MAX_KERNEL_ROWS
#: tokens of up to 8192 features each (a hidden state, or all heads of a query), so every
#: chunk the other kernels take runs its norms and rotations alike too (a norm over heads sees
#: tokens x heads rows; only elements tell tokens apart from heads). Longer prefill keeps MLX.
MAX_NORM_ELEMENTS = MAX_KERNEL_ROWS * 8192


def _f32_on_cpu(*arrays: Any) -> bool:
    import mlx.core as mx

    return all(a.dtype == mx.float32 for a in arrays) and available() and _on_cpu()


def attention(q: Any, k: Any, v: Any, scale: float, causal: bool,
              window: int | None = None) -> Any | None:
    """``softmax(scale * q @ k.T) @ v`` through the kernel, or None when it does not apply
    (then use MLX). q (B, Hq, M, D), k/v (B, Hkv, L, D|Dv); ``causal`` is aligned to the
    last key (query i sees keys 0 .. L - M + i), as MLX's ``mask="causal"``; ``window``
    (causal only) keeps the last ``window`` of those."""
    if (
        q.ndim == 4 and k.ndim == 4 and v.ndim == 4
        and q.shape[2] <= MAX_ATTENTION_QUERIES
        and _f32_on_cpu(q, k, v)
    ):
        return _module.attention(q, k, v, float(scale), bool(causal), int(window or 0))
    return None


def causal_softmax(scores: Any, window: int | None = None) -> Any | None:
    """Softmax over the last axis of float32 scores (..., M, L) under the causal mask aligned
    to the last key (the last ``window`` keys of each query when given); None when the kernel
    does not apply (then use MLX). One vectorized pass instead of MLX's scalar exponentials."""
    if scores.ndim >= 2 and scores.shape[-1] >= scores.shape[-2] and _f32_on_cpu(scores):
        return _module.causal_softmax(scores, int(window or 0))
    return None


def rms_norm(x: Any, weight: Any | None, eps: float) -> Any:
    """``mx.fast.rms_norm(x, weight, eps)``; float32 inputs up to MAX_NORM_ELEMENTS go to the
    kernel (a row's norm must not depend on how many rows came with it)."""
    import mlx.core as mx

    if x.size <= MAX_NORM_ELEMENTS and x.ndim >= 1 and _f32_on_cpu(
            x, *([] if weight is None else [weight])):
        return _module.rms_norm(x, weight, float(eps))
    return mx.fast.rms_norm(x, weight, eps)


def rope(x: Any, dims: int, offset: Any, scale: float, inv_freqs: Any) -> Any | None:
    """Non-traditional RoPE of ``x`` (N0, N1, T, D) at an integer ``offset`` through the
    kernel (angle i of position p: ``p * scale * inv_freqs[i]``), or None when it does not
    apply (then use ``mx.fast.rope``)."""
    if (
        isinstance(offset, int)
        and x.ndim == 4
        and x.size <= MAX_NORM_ELEMENTS
        and _f32_on_cpu(x, inv_freqs)
    ):
        return _module.rope(x, int(dims), offset, float(scale), inv_freqs)
    return None


def silu_mul(g: Any, u: Any) -> Any:
    """``silu(g) * u`` (the SwiGLU gate): one threaded pass for float32 on the CPU, where
    MLX's compiled kernel calls a scalar ``fmaf`` per element; MLX otherwise."""
    import mlx.core as mx

    if g.shape == u.shape and _f32_on_cpu(g, u):
        return _module.silu_mul(g, u)
    return g * mx.sigmoid(g) * u


class KernelWeight(NamedTuple):
    """A weight matrix as the fused blocks take it: ``arrays`` is (w,) for a dense float32 /
    bfloat16 / float16 matrix (``bits`` 0), or (wq, scales, biases) in MLX's affine layout
    with float32 scales and biases (``bits`` 4 or 8, ``group_size`` 32 / 64 / 128);
    ``int8_inputs``: its products round their inputs to int8 (``quantized_linear``)."""

    arrays: tuple
    bits: int = 0
    group_size: int = 0
    int8_inputs: bool = False


def fused_rows_apply(x: Any) -> bool:
    """Whether the fused layer blocks take ``x`` (B, N, H): float32 on the CPU with at most
    MAX_KERNEL_ROWS rows, where every product in them runs the matvec kernel."""
    import mlx.core as mx

    if x.ndim != 3 or x.dtype != mx.float32:
        return False
    batch, rows, _ = x.shape
    return batch * rows <= MAX_KERNEL_ROWS and available() and _on_cpu()


def attention_inputs(x: Any, norm_weight: Any, eps: float, qkv: KernelWeight, heads: int,
                     kv_heads: int, head_dim: int, rope_dims: int, offset: int,
                     rope_scale: float, inv_freqs: Any) -> list:
    """[q, k, v] (B, heads | kv_heads, N, head_dim) of a pre-norm attention layer for ``x``
    (B, N, H) (check ``fused_rows_apply`` first): ``rms_norm(x) @ qkv.T`` split by heads, q
    and k rotated as ``rope`` does at positions ``offset + t``. Equal bit for bit to those
    ops run one by one."""
    return attention_inputs_segments(x, norm_weight, eps, qkv, heads, kv_heads, head_dim,
                                     rope_dims, [offset], [x.shape[1]], rope_scale, inv_freqs)


def attention_inputs_segments(x: Any, norm_weight: Any, eps: float, qkv: KernelWeight,
                              heads: int, kv_heads: int, head_dim: int, rope_dims: int,
                              offsets: list[int], rows: list[int], rope_scale: float,
                              inv_freqs: Any) -> list:
    """``attention_inputs`` of several sequences' rows stacked in ``x`` (1, N, H): segment s is
    ``rows[s]`` rows at positions ``offsets[s] + t``. Returns [q (1, heads, N, D), then k and v
    (1, kv_heads, rows[s], D) of each segment]; every row equals its sequence's rows alone."""
    return _module.attention_inputs(x, norm_weight, float(eps), qkv, heads, kv_heads, head_dim,
                                    rope_dims, [int(o) for o in offsets], list(rows),
                                    float(rope_scale), inv_freqs)


def attention_mlp(q: Any, keys: Any, values: Any, length: int, scale: float, window: int,
                  x: Any, norm_weight: Any, eps: float, o: KernelWeight, gate_up: KernelWeight,
                  down: KernelWeight) -> Any:
    """The rest of a pre-norm layer after its attention inputs, as one graph node: the causal
    attention of ``q`` (B, Hq, N, D) over the first ``length`` positions of a full-attention
    cache's buffers ``keys`` / ``values`` (B, Hkv, capacity, D), read in place (the last
    ``window`` keys when > 0), then ``h = x + o(attention)`` and ``h + down(silu(g) * u)`` with
    ``[g | u]`` the stacked gate/up product of ``rms_norm(h)``. Equal bit for bit to those ops
    run one by one."""
    return attention_mlp_segments(q, [keys], [values], [length], [x.shape[1]], scale, window,
                                  x, norm_weight, eps, o, gate_up, down)


def attention_mlp_segments(q: Any, keys: list, values: list, lengths: list[int],
                           rows: list[int], scale: float, window: int, x: Any, norm_weight: Any,
                           eps: float, o: KernelWeight, gate_up: KernelWeight,
                           down: KernelWeight) -> Any:
    """``attention_mlp`` of several sequences' rows stacked in ``q`` / ``x``: segment s's
    ``rows[s]`` queries attend to its own cache buffers ``keys[s]`` / ``values[s]``, which hold
    ``lengths[s]`` positions; every row equals its sequence's rows alone."""
    return _module.attention_mlp(q, list(keys), list(values), [int(n) for n in lengths],
                                 list(rows), float(scale), int(window), x, norm_weight,
                                 float(eps), o, gate_up, down)


def _gather_applies(x: Any, indices: Any) -> bool:
    import mlx.core as mx

    return (x.dtype == mx.float32 and indices.dtype in (mx.int32, mx.uint32)
            and indices.shape == x.shape[:-1] and available() and _on_cpu())


def gather_linear(x: Any, w: Any, indices: Any) -> Any | None:
    """Row r of ``x`` (..., K) times ``w[indices[r]].T`` for stacked ``w`` (E, N, K) ->
    (..., N) float32, through the kernel (float32 x; w float32, bfloat16 or float16; int32 or
    uint32 indices of x's leading shape; CPU device), else None (then use ``mx.gather_mm``).
    Each row is reduced as a one-row ``matvec`` with its matrix would be (row invariance);
    an out-of-range index gives a row of zeros."""
    import mlx.core as mx

    if _gather_applies(x, indices) and w.ndim == 3 and w.dtype in (
            mx.float32, mx.bfloat16, mx.float16) and w.shape[2] == x.shape[-1]:
        return _module.gather_matvec(x, w, indices)
    return None


def gather_quantized_linear(x: Any, wq: Any, scales: Any, biases: Any, indices: Any,
                            group_size: int, bits: int) -> Any | None:
    """``gather_linear`` for stacked weights in MLX's affine layout (``wq`` (E, N, K*bits/32),
    float32 ``scales`` / ``biases`` (E, N, K/group_size), ``quantized_layout_supported``), else
    None (then use ``mx.gather_qmm``, or dequantize where MLX does not multiply the layout)."""
    import mlx.core as mx

    if (_gather_applies(x, indices) and quantized_layout_supported(bits, group_size)
            and biases is not None
            and scales.dtype == mx.float32 and biases.dtype == mx.float32):
        try:
            return _module.gather_matvec_q(x, wq, scales, biases, indices, group_size, bits)
        except ValueError:
            return None  # shapes gather_qmm may still take (or refuse with its own message)
    return None


def isa() -> str | None:
    """Instruction set the kernels run with here ("avx512", "avx2", "generic"), or None."""
    mod = _try_load()
    return mod.isa() if mod is not None else None


#: Bumped whenever a change makes the kernels' results differ in any bit (a reduction order,
#: which clone runs). The prefix cache's disk tier keys its states by ``numerics()``, so a
#: state computed another way is never restored into this one.
NUMERICS_VERSION = 2


def numerics() -> str | None:
    """What the kernels' results depend on here: instruction set, clone level and
    ``NUMERICS_VERSION`` (None without the kernels)."""
    mod = _try_load()
    if mod is None:
        return None
    return f"{mod.isa()}-{mod.clone_level()}-n{NUMERICS_VERSION}"


def clone_level() -> str | None:
    """Which build of the auto-vectorized helpers (norms, RoPE, softmax, SwiGLU) runs here:
    "high" (x86-64-v4: AVX-512), "mid" (x86-64-v3: AVX2 + FMA), "baseline", "none" (not
    cloned), or None without the kernels."""
    mod = _try_load()
    return mod.clone_level() if mod is not None else None


def set_num_threads(n: int) -> None:
    """Caps the kernels' threads (n <= 0 restores the default). No-op when unavailable."""
    mod = _try_load()
    if mod is not None:
        mod.set_max_threads(int(n))

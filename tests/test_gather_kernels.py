"""The gathered matrix-vector kernels (``kernels.gather_linear`` / ``gather_quantized_linear``):
each row of x against the matrix of a stack its index picks (MoE experts, per-head
projections). Numerics against float64 and MLX's gather matmuls, row invariance (a row's
result does not depend on the other rows of the call), strided and broadcast operands, lazy
graphs, argument checks, and the stacked layers that use them. Skipped only where the
platform is absent (tests/conftest.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from backend import kernels
from backend.models.moe import SwitchLinear


@pytest.fixture(scope="module")
def K(native_kernels):
    return native_kernels


def _reference(x: mx.array, w: mx.array, indices: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """float64 products and the bound |x| @ |w|.T that float32 rounding error scales with."""
    xn, wn = np.array(x, np.float64), np.array(w.astype(mx.float32), np.float64)
    picked = wn[np.array(indices)]  # (..., N, K)
    return (np.einsum("...k,...nk->...n", xn, picked),
            np.einsum("...k,...nk->...n", np.abs(xn), np.abs(picked)))


def _indices(shape: tuple[int, ...], experts: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, experts, shape).astype(np.int32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("k,n", [(64, 37), (577, 129), (1024, 768)])
def test_each_row_gets_its_matrix(K, dtype, k, n):
    w = (mx.random.normal((6, n, k)) * 0.1).astype(dtype)
    x = mx.random.normal((3, 4, k))
    indices = _indices((3, 4), 6)
    got = K.gather_linear(x, w, indices)
    ref, bound = _reference(x, w, indices)
    assert got.shape == (3, 4, n) and got.dtype == mx.float32
    assert np.all(np.abs(np.array(got, np.float64) - ref) <= 2e-6 * bound + 1e-30)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 128)])
def test_quantized_stacks_match_mlx_gather_qmm(K, bits, group):
    w = mx.random.normal((5, 96, 256)) * 0.1
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((2, 3, 256))
    indices = _indices((2, 3), 5, seed=1).astype(mx.uint32)
    got = K.gather_quantized_linear(x, wq, scales, biases, indices, group, bits)
    want = mx.gather_qmm(mx.expand_dims(x, -2), wq, scales, biases, rhs_indices=indices,
                         transpose=True, group_size=group, bits=bits).squeeze(-2)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    ref, bound = _reference(x, mx.dequantize(wq, scales, biases, group, bits), indices)
    assert np.all(np.abs(np.array(got, np.float64) - ref) <= 2e-6 * bound + 1e-30)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q4", "q8"])
def test_a_row_does_not_depend_on_the_other_rows(K, kind):
    """Row invariance: whichever rows share a call (and a matrix), each row is bit for bit
    the one-row call's result: a verify block's expert and head products equal decode steps'."""
    w = mx.random.normal((4, 64, 192)) * 0.1
    x = mx.random.normal((20, 192))
    indices = _indices((20,), 4, seed=2)
    if kind.startswith("q"):
        bits = int(kind[1])
        wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)

        def product(rows, picks):
            return K.gather_quantized_linear(rows, wq, scales, biases, picks, 64, bits)
    else:
        wt = w.astype(getattr(mx, kind))

        def product(rows, picks):
            return K.gather_linear(rows, wt, picks)

    whole = np.array(product(x, indices))
    for i in range(20):
        np.testing.assert_array_equal(np.array(product(x[i:i + 1], indices[i:i + 1]))[0],
                                      whole[i], err_msg=f"row {i}")
    same = mx.zeros((20,), mx.int32) + 3  # every row on one matrix: the no-copy path
    alone = np.array(product(x[5:6], same[5:6]))[0]
    np.testing.assert_array_equal(np.array(product(x, same))[5], alone)


def test_strided_and_broadcast_operands(K):
    w = mx.random.normal((3, 48, 40)) * 0.1
    x = mx.random.normal((1, 5, 40))
    rows = mx.broadcast_to(x, (4, 5, 40))  # stride 0 on the leading axis
    indices = mx.broadcast_to(mx.arange(5) % 3, (4, 5))
    ref, bound = _reference(rows, w, indices)
    got = K.gather_linear(rows, w, indices)
    assert np.all(np.abs(np.array(got, np.float64) - ref) <= 2e-6 * bound + 1e-30)
    w_t = mx.random.normal((3, 40, 48)).swapaxes(-1, -2)  # (3, 48, 40), last stride 48
    ref, bound = _reference(rows, w_t, indices)
    got = K.gather_linear(rows, w_t, indices)
    assert np.all(np.abs(np.array(got, np.float64) - ref) <= 2e-6 * bound + 1e-30)
    wq, scales, biases = mx.quantize(mx.random.normal((6, 48, 64)) * 0.1, 32, 4)
    # Expert-strided stacks, scales and biases at different strides (one copied, as the
    # kernel walks both with one stride).
    sliced = (wq[::2], scales[::2], mx.contiguous(biases[::2]))
    rows, picks = mx.broadcast_to(mx.random.normal((1, 64)), (3, 64)), mx.array([0, 2, 1])
    got = K.gather_quantized_linear(rows, *sliced, picks, 32, 4)
    ref, bound = _reference(rows, mx.dequantize(*sliced, 32, 4), picks)
    assert np.all(np.abs(np.array(got, np.float64) - ref) <= 2e-6 * bound + 1e-30)


def test_out_of_range_rows_are_zero_and_lazy_graphs_work(K):
    w = mx.random.normal((3, 16, 32))
    x = mx.random.normal((4, 32))
    got = np.array(K.gather_linear(x, w, mx.array([0, 7, -1, 2])))
    assert (got[1] == 0).all() and (got[2] == 0).all() and np.abs(got[0]).sum() > 0
    y = mx.tanh(K.gather_linear(mx.sigmoid(x), w, mx.argmax(x[:, :3], axis=-1)))
    mx.async_eval(y)  # the indices come from the same graph, evaluated on the stream
    want = mx.tanh(mx.gather_mm(mx.expand_dims(mx.sigmoid(x), -2), w.swapaxes(-1, -2),
                                rhs_indices=mx.argmax(x[:, :3], axis=-1)).squeeze(-2))
    assert mx.allclose(y, want, rtol=1e-5, atol=1e-5).item()


def test_argument_errors_and_where_the_helpers_step_aside(K):
    from backend.kernels import _module as native

    x, w = mx.zeros((2, 8)), mx.zeros((3, 4, 8))
    with pytest.raises(ValueError, match=r"indices .*\(3,\)"):
        native.gather_matvec(x, w, mx.zeros((3,), mx.int32))
    with pytest.raises(ValueError, match=r"w \(3, 4, 7\)"):
        native.gather_matvec(x, mx.zeros((3, 4, 7)), mx.zeros((2,), mx.int32))
    with pytest.raises(ValueError, match="bits=3"):
        native.gather_matvec_q(x, mx.zeros((3, 4, 1), mx.uint32), mx.zeros((3, 4, 1)),
                               mx.zeros((3, 4, 1)), mx.zeros((2,), mx.int32), 8, 3)
    # Not the kernels' case: the helpers say so and callers keep MLX's gather matmuls.
    assert kernels.gather_linear(x.astype(mx.float16), w, mx.zeros((2,), mx.int32)) is None
    assert kernels.gather_linear(x, w, mx.zeros((2,), mx.float32)) is None
    wq, scales, biases = mx.quantize(mx.zeros((3, 4, 64)), 64, 4)
    assert kernels.gather_quantized_linear(mx.zeros((2, 64)), wq, scales, biases,
                                           mx.zeros((2,), mx.int32), 64, 2) is None


def test_stacked_layers_take_the_kernel_and_agree_with_gather_mm(K):
    layer = SwitchLinear(64, 48, 8)
    mx.eval(layer.parameters())
    x = mx.random.normal((1, 3, 1, 1, 64))  # SwitchGLU's (B, N, 1, 1, D) against (B, N, k)
    indices = _indices((1, 3, 2), 8, seed=4).astype(mx.uint32)
    plain = layer(x, indices)
    layer.native_ops = True
    native = layer(x, indices)
    assert native.shape == plain.shape == (1, 3, 2, 1, 48)
    np.testing.assert_allclose(np.array(native), np.array(plain), rtol=1e-5, atol=1e-5)
    quantized = layer.to_quantized(group_size=32, bits=4)
    want = quantized(x, indices)
    quantized.native_ops = True
    np.testing.assert_allclose(np.array(quantized(x, indices)), np.array(want), rtol=1e-4,
                               atol=1e-4)

"""Native MLX CPU kernels (backend.kernels): numerics against MLX and float64 (float32,
bfloat16 and float16 weights), strided and batched inputs, laziness under async_eval and mx.compile, argument checks, and the
quantized variant against mx.quantized_matmul. Skipped only where the platform is absent
(not Linux x86-64, no C++ compiler); anywhere else a failed build fails them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from backend import kernels


@pytest.fixture(scope="module")
def K(native_kernels):
    """The built kernels (tests/conftest.py: skipped only where the platform is absent)."""
    return native_kernels


def _ref(x: mx.array, w: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """float64 x @ w.T and the bound |x| @ |w|.T that float32 rounding error scales with."""
    xn = np.array(x, dtype=np.float64)
    wn = np.array(w, dtype=np.float64)
    return xn @ wn.T, np.abs(xn) @ np.abs(wn).T


def _close(got: mx.array, x: mx.array, w: mx.array, rel: float = 2e-6) -> None:
    ref, scale = _ref(x, w)
    err = np.abs(np.array(got, dtype=np.float64) - ref)
    assert got.shape == ref.shape
    assert np.all(err <= rel * scale + 1e-30), float(np.max(err / (scale + 1e-30)))


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("ARBOR_KERNELS", "0")
    mod, reason = kernels._load()
    assert mod is None and "ARBOR_KERNELS" in reason


@pytest.mark.parametrize("k", [1, 7, 16, 17, 100, 576])
@pytest.mark.parametrize("n", [1, 3, 33])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_matvec_shapes(K, m, n, k):
    x = mx.random.normal((m, k))
    w = mx.random.normal((n, k))
    got = K.matvec(x, w)
    _close(got, x, w)
    assert mx.allclose(got, x @ w.T, rtol=1e-5, atol=1e-5 * np.sqrt(k)).item()


@pytest.mark.parametrize("panels", [False, True])
@pytest.mark.parametrize("m", [1, 5, 8, 9])
def test_matvec_threaded_sizes(K, m, panels):
    # Large enough to be split across the pool; results must not depend on the thread count
    # (row-major weights, and float32 panels: tests/test_panel_kernels.py).
    x = mx.random.normal((m, 576))
    w = mx.random.normal((1536 if panels else 1537, 576)) * 0.05
    held = kernels.pack_panels(w) if panels else w
    got = K.matvec(x, held)
    _close(got, x, w)
    K.set_num_threads(1)
    try:
        serial = K.matvec(x, held)
        mx.eval(serial)
    finally:
        K.set_num_threads(0)
    assert mx.array_equal(got, serial).item()


def test_matvec_batch_dims_and_vector(K):
    w = mx.random.normal((19, 40))
    for shape in [(40,), (2, 40), (2, 3, 40), (1, 1, 40), (2, 1, 2, 40)]:
        x = mx.random.normal(shape)
        got = K.matvec(x, w)
        assert got.shape == shape[:-1] + (19,)
        _close(got.reshape(-1, 19), x.reshape(-1, 40), w)


def test_matvec_empty(K):
    w = mx.random.normal((5, 8))
    assert K.matvec(mx.zeros((0, 8)), w).shape == (0, 5)
    assert K.matvec(mx.zeros((2, 8)), mx.zeros((0, 8))).shape == (2, 0)
    out = K.matvec(mx.zeros((2, 0)), mx.zeros((3, 0)))
    assert out.shape == (2, 3) and not mx.any(out).item()


def test_matvec_strided_inputs(K):
    base = mx.random.normal((64, 96))
    x = mx.random.normal((3, 96))
    cases = {
        "row slice": (x, base[8:40]),
        "every other row": (x, base[::2]),
        "transposed": (x, mx.random.normal((96, 64)).T),
        "column slice": (x[:, 10:50], base[:, 10:50]),
        "broadcast rows": (x, mx.broadcast_to(base[:1], (7, 96))),
        "x transposed": (mx.random.normal((96, 3)).T, base),
        "x column slice": (mx.random.normal((3, 200))[:, 4:100], base),
    }
    for name, (xi, wi) in cases.items():
        got = K.matvec(xi, wi)
        mx.eval(got)
        try:
            _close(got, xi, wi)
        except AssertionError as e:
            raise AssertionError(name) from e


def test_matvec_in_lazy_graph_with_async_eval(K):
    ws = [mx.random.normal((48, 48)) * 0.2 for _ in range(6)]
    x0 = mx.random.normal((1, 1, 48))
    mx.eval(ws, x0)

    def step(x, mm):
        for w in ws:
            x = x + mx.tanh(mm(mx.sigmoid(x) * 2.0 - 1.0, w))
        return x

    want = step(x0, lambda a, b: a @ b.T)
    outs, x = [], x0
    for _ in range(4):  # pipelined like decode: queue the next step before reading the last
        x = step(x, K.matvec)
        mx.async_eval(x)
        outs.append(x)
    mx.eval(outs)
    assert mx.allclose(outs[0], want, rtol=1e-5, atol=1e-5).item()
    ref = x0
    for got in outs:
        ref = step(ref, lambda a, b: a @ b.T)
        assert mx.allclose(got, ref, rtol=1e-4, atol=1e-4).item()


def test_matvec_under_compile(K):
    w1, w2 = mx.random.normal((64, 32)), mx.random.normal((32, 64))

    @mx.compile
    def f(x):
        return K.matvec(mx.maximum(K.matvec(x, w1), 0.0), w2) * 0.5

    x = mx.random.normal((2, 32))
    want = (mx.maximum(x @ w1.T, 0.0) @ w2.T) * 0.5
    for _ in range(2):
        assert mx.allclose(f(x), want, rtol=1e-5, atol=1e-4).item()


def test_matvec_argument_errors(K):
    x = mx.zeros((2, 8))
    with pytest.raises(ValueError, match=r"\(2, 8\).*\(4, 7\)"):
        K.matvec(x, mx.zeros((4, 7)))
    with pytest.raises(ValueError, match=r"w \(2, 4, 8\)"):
        K.matvec(x, mx.zeros((2, 4, 8)))
    with pytest.raises(ValueError, match="float32"):
        K.matvec(x.astype(mx.float16), mx.zeros((4, 8)))
    with pytest.raises(ValueError, match="float32"):
        K.matvec(x, mx.zeros((4, 8), dtype=mx.int32))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_matvec_16bit_weights(K, dtype):
    # 16-bit weights widen exactly, so the result is x @ w.astype(float32).T in float32.
    for m, k, n in [(1, 576, 1537), (3, 17, 5), (2, 100, 33), (1, 1, 1)]:
        x = mx.random.normal((m, k))
        w = mx.random.normal((n, k)).astype(dtype)
        got = K.matvec(x, w)
        assert got.dtype == mx.float32
        _close(got, x, w.astype(mx.float32))
    # Strided rows and float16 subnormals / extremes.
    w = mx.array([[6.0e-8, -6.0e-8, 1.0e-5, 65504.0], [-65504.0, 0.5, -0.0, 3.0]] * 3).astype(dtype)[::2]
    x = mx.array([[1.0, 2.0, 3.0, 1e-3]])
    _close(K.matvec(x, w), x, w.astype(mx.float32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matvec_q_matches_quantized_matmul(K, bits, group_size):
    for m, k, n in [(1, 128, 1), (2, 384, 67), (3, 256, 5), (4, 640, 130)]:
        w = mx.random.normal((n, k))
        wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
        x = mx.random.normal((m, k))
        got = K.matvec_q(x, wq, s, b, group_size=group_size, bits=bits)
        want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group_size, bits=bits)
        _close(got, x, mx.dequantize(wq, s, b, group_size=group_size, bits=bits))
        assert mx.allclose(got, want, rtol=1e-5, atol=2e-5 * np.sqrt(k)).item(), (m, k, n)


def test_matvec_q_threaded_batched_lazy(K):
    w = mx.random.normal((1536, 576)) * 0.05
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((2, 3, 576))
    y = K.matvec_q(mx.sin(x), wq, s, b, group_size=64, bits=4) * 2 + 1
    mx.async_eval(y)
    want = mx.quantized_matmul(mx.sin(x), wq, s, b, transpose=True, group_size=64, bits=4) * 2 + 1
    assert y.shape == (2, 3, 1536)
    assert mx.allclose(y, want, rtol=1e-5, atol=1e-4).item()
    # A row slice of the packed weights (unit-stride rows, other row stride still contiguous).
    got = K.matvec_q(x, wq[100:300], s[100:300], b[100:300], group_size=64, bits=4)
    want = mx.quantized_matmul(x, wq[100:300], s[100:300], b[100:300], transpose=True, group_size=64, bits=4)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()


def test_matvec_q_argument_errors(K):
    w = mx.random.normal((8, 128))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.zeros((1, 128))
    with pytest.raises(ValueError, match="bits"):
        K.matvec_q(x, wq, s, b, group_size=64, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        K.matvec_q(x, wq, s, b, group_size=16, bits=4)
    with pytest.raises(ValueError, match=r"x \(1, 64\)"):
        K.matvec_q(mx.zeros((1, 64)), wq, s, b, group_size=64, bits=4)
    with pytest.raises(ValueError, match="scales"):
        K.matvec_q(x, wq, s[:, :1], b, group_size=64, bits=4)
    with pytest.raises(ValueError, match="float32"):
        K.matvec_q(x, wq, s.astype(mx.float16), b.astype(mx.float16), group_size=64, bits=4)


def int8_input_reference(x: mx.array, wq, scales, biases, group_size: int):
    """What the int8-input kernel computes, in float64: each block of 64 inputs rounded to
    int8 by its own scale (max |x| / 127, ties to even), times the weights' scaled values, plus
    each group's bias times the exact sum of its inputs. Also the bound |terms| that float32
    rounding error scales with."""
    xn = np.array(x, dtype=np.float32)
    m, k = xn.shape
    blocks = xn.reshape(m, k // 64, 64)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -127, 127)  # float32 product, as the kernel rounds it
    xhat = (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(m, k)
    scaled = np.array(mx.dequantize(wq, scales, mx.zeros_like(biases), group_size=group_size,
                                    bits=4), dtype=np.float64)
    sums = xn.astype(np.float64).reshape(m, k // group_size, group_size).sum(axis=-1)
    b = np.array(biases, dtype=np.float64)
    return xhat @ scaled.T + sums @ b.T, np.abs(xhat) @ np.abs(scaled).T + np.abs(sums) @ np.abs(b).T


@pytest.mark.parametrize("group_size", [64, 128])
def test_int8_inputs_compute_their_rounding_exactly(K, group_size):
    """The int8-input product is the exact product of the rounded inputs (up to float32
    sums), whatever the row count and wherever a block is all zeros; against the float32
    inputs it is off by about 1% (over many outputs: one near zero can be off by far more)."""
    mx.random.seed(11)
    for m, k, n in [(1, 128, 1), (2, 384, 67), (3, 640, 130), (5, 1536, 40)]:
        if k % group_size:
            continue
        w = mx.random.normal((n, k)) * 0.1
        wq, s, b = mx.quantize(w, group_size=group_size, bits=4)
        x = mx.random.normal((m, k))
        x[0, 64:128] = 0.0  # a block with no scale of its own
        got = np.array(K.matvec_q(x, wq, s, b, group_size, 4, int8_inputs=True), np.float64)
        want, bound = int8_input_reference(x, wq, s, b, group_size)
        assert np.all(np.abs(got - want) <= 2e-6 * bound + 1e-30), (m, k, n)
        if m * n >= 100:
            exact = np.array(K.matvec_q(x, wq, s, b, group_size, 4), np.float64)
            rel = np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact ** 2))
            assert 1e-4 < rel < 0.03, (m, k, n, rel)  # approximate, yet close


def test_the_portable_int8_input_kernel_computes_the_same(K, tmp_path):
    """The scalar kernel (CPUs without AVX2; ARBOR_MATVEC_ISA=generic) rounds alike."""
    import subprocess
    import sys
    from pathlib import Path

    w = mx.random.normal((70, 640)) * 0.1
    wq, s, b = mx.quantize(w, group_size=128, bits=4)
    x = mx.random.normal((3, 640))
    np.savez(tmp_path / "args.npz", x=np.array(x), wq=np.array(wq), s=np.array(s), b=np.array(b))
    script = (
        "import sys, numpy as np, backend, mlx.core as mx\n"
        "from backend import kernels\n"
        "assert kernels.isa() == 'generic', kernels.isa()\n"
        "a = {k: mx.array(v) for k, v in np.load(sys.argv[1]).items()}\n"
        "out = kernels.matvec_q(a['x'], a['wq'], a['s'], a['b'], 128, 4, int8_inputs=True)\n"
        "np.save(sys.argv[2], np.array(out))\n")
    env = dict(__import__("os").environ, ARBOR_MATVEC_ISA="generic")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "args.npz"),
                    str(tmp_path / "out.npy")], check=True, env=env,
                   cwd=Path(__file__).resolve().parents[1])
    got = np.load(tmp_path / "out.npy").astype(np.float64)
    want, bound = int8_input_reference(x, wq, s, b, 128)
    assert np.all(np.abs(got - want) <= 2e-6 * bound + 1e-30)


def test_int8_inputs_need_4_bit_groups_of_64_or_128(K):
    x = mx.zeros((1, 128))
    for bits, group_size in ((8, 64), (4, 32)):
        wq, s, b = mx.quantize(mx.zeros((8, 128)), group_size=group_size, bits=bits)
        with pytest.raises(ValueError, match="int8 inputs need 4-bit weights in groups of 64"):
            K.matvec_q(x, wq, s, b, group_size, bits, int8_inputs=True)
        # The Python helper takes the flag as a request: exact products where it cannot apply.
        np.testing.assert_array_equal(
            np.array(kernels.quantized_linear(x, wq, s, b, group_size, bits, int8_inputs=True)),
            np.array(K.matvec_q(x, wq, s, b, group_size, bits)))


def test_linear_helpers_pick_kernel_or_mlx(K):
    w = mx.random.normal((40, 64))
    for shape in [(1, 64), (2, 3, 64), (20, 64)]:  # the last is past MAX_KERNEL_ROWS: MLX
        x = mx.random.normal(shape)
        assert mx.allclose(K.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-4).item()
    xh = mx.random.normal((1, 64)).astype(mx.float16)  # not float32: MLX (float16 result)
    assert K.linear(xh, w.astype(mx.float16)).dtype == mx.float16
    wq, s, b = mx.quantize(w, group_size=32, bits=8)
    for shape in [(1, 64), (16, 64), (32, 64), (33, 64), (2, 50, 64)]:  # kernel, then dequantize
        x = mx.random.normal(shape)
        want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=8)
        got = K.quantized_linear(x, wq, s, b, group_size=32, bits=8)
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()
    wq2, s2, b2 = mx.quantize(w, group_size=32, bits=2)  # unsupported bits: MLX
    x = mx.random.normal((1, 64))
    want = mx.quantized_matmul(x, wq2, s2, b2, transpose=True, group_size=32, bits=2)
    assert mx.allclose(K.quantized_linear(x, wq2, s2, b2, group_size=32, bits=2), want).item()


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 128)])
def test_dequantize_equals_mlx_bitwise(K, bits, group_size):
    w = mx.random.normal((37, 256))
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    assert mx.array_equal(K.dequantize(wq, s, b, group_size, bits),
                          mx.dequantize(wq, s, b, group_size, bits))
    # Strided rows (a slice of a larger matrix) and a threaded size.
    assert mx.array_equal(K.dequantize(wq[::2], s[::2], b[::2], group_size, bits),
                          mx.dequantize(wq[::2], s[::2], b[::2], group_size, bits))
    big = mx.random.normal((3000, 512))
    bq, bs, bb = mx.quantize(big, group_size=group_size, bits=bits)
    assert mx.array_equal(K.dequantize(bq, bs, bb, group_size, bits),
                          mx.dequantize(bq, bs, bb, group_size, bits))


def test_dequantize_argument_errors_and_fallback(K):
    wq, s, b = mx.quantize(mx.random.normal((8, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="group_size"):
        K._mod().dequantize(wq, s[:, :1], b[:, :1], 32, 4)
    # bf16 scales (not the kernel's layout): MLX's own dequantize, as float32.
    got = K.dequantize(wq, s.astype(mx.bfloat16), b.astype(mx.bfloat16), 32, 4)
    assert got.dtype == mx.float32


@pytest.mark.parametrize("dtype,k", [(d, k) for d in ("float32", "bfloat16", "float16")
                                     for k in (64, 577, 1001)]
                         + [(d, k) for d in ("q4", "q8") for k in (64, 576, 992)]
                         + [("q4-int8", k) for k in (64, 576, 1024)])
def test_rows_are_reduced_alike_whatever_the_row_count(K, dtype, k):
    """Row invariance: a product of M <= 16 rows equals, bit for bit, M one-row products (a
    speculative verify block then gives exactly the logits of one-token decode steps)."""
    x = mx.random.normal((16, k))
    w = mx.random.normal((37, k)) * 0.1
    if dtype.startswith("q"):
        bits, int8_inputs = int(dtype[1]), dtype.endswith("int8")
        group = 128 if int8_inputs and k % 128 == 0 else 32 if k % 64 else 64
        wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)

        def product(rows):
            return K.matvec_q(rows, wq, scales, biases, group, bits, int8_inputs=int8_inputs)
    else:
        wt = w.astype(getattr(mx, dtype))

        def product(rows):
            return K.matvec(rows, wt)

    singles = np.concatenate([np.array(product(x[i:i + 1])) for i in range(16)])
    for m in range(1, 17):
        np.testing.assert_array_equal(np.array(product(x[:m])), singles[:m], err_msg=f"M={m}")


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


X86_64_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def test_vectorized_helpers_run_the_clone_this_cpu_supports(K):
    """Norms, RoPE, softmax and SwiGLU are compiled three times and one clone is picked at
    load. It must be picked by the CPU's features: clones named after Intel models
    (arch=haswell) left every AMD CPU on the baseline clone, at a fraction of the speed."""
    import json
    import re

    from backend.kernels.build import INFO_FILE

    compiler = json.loads(INFO_FILE.read_text()).get("compiler", "")
    gcc = re.search(r"\(.*\) (\d+)\.", compiler)
    level = K.clone_level()
    if "clang" in compiler.lower():
        assert level == "none"
        return
    assert level in ("high", "mid", "baseline")
    if gcc and int(gcc.group(1)) >= 12:  # the x86-64-v4 / v3 levels exist from GCC 12 on
        flags = _cpu_flags()
        expected = "high" if X86_64_V4 <= flags else "mid" if X86_64_V3 <= flags else "baseline"
        assert level == expected, (level, sorted(X86_64_V4 - flags))

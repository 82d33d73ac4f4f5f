"""Native decode-time attention, RMS norm and RoPE (backend.kernels) against MLX's own ops:
grouped-query heads, causal blocks, strided cache views, partial rotary dims, large positions,
laziness, argument checks, and the fallbacks when a kernel does not apply. Skipped only where the
platform is absent (not Linux x86-64, no C++ compiler)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from backend import kernels
from backend.models.layers import RMSNorm
from backend.models.rope import RopeSettings, RoPE


@pytest.fixture(scope="module")
def K(native_kernels):
    """The built kernels (tests/conftest.py: skipped only where the platform is absent)."""
    return native_kernels


def max_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return mx.abs(a - b).max().item()


@pytest.mark.parametrize("hq,hkv,m,length,d,dv", [
    (9, 3, 1, 512, 64, 64),    # SmolLM2 decode
    (4, 4, 1, 1, 32, 32),      # first token
    (8, 2, 5, 37, 48, 16),     # verify block, Dv != D, odd sizes
    (16, 1, 8, 3000, 128, 128),  # long context, multi-query, threaded
])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_mlx(K, hq, hkv, m, length, d, dv, causal):
    mx.random.seed(hq * length + m)
    q = mx.random.normal((2, hq, m, d))
    k = mx.random.normal((2, hkv, length, d))
    v = mx.random.normal((2, hkv, length, dv))
    scale = d ** -0.5
    got = K.attention(q, k, v, scale, causal)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                mask="causal" if causal else None)
    assert max_diff(got, want) < 2e-6


def test_attention_reads_strided_cache_views_and_transposed_queries(K):
    """The cache hands over slices of a larger buffer; queries arrive transposed."""
    buf_k = mx.random.normal((1, 2, 256, 64))
    buf_v = mx.random.normal((1, 2, 256, 64))
    k, v = buf_k[..., :100, :], buf_v[..., :100, :]
    q = mx.random.normal((1, 3, 6, 64)).transpose(0, 2, 1, 3)  # (1, 6 heads, 3 queries, 64)
    got = K.attention(q, k, v, 0.125, True)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert max_diff(got, want) < 2e-6


def test_attention_softmax_is_stable_for_large_scores(K):
    q = mx.full((1, 1, 1, 16), 30.0)
    k = mx.concatenate([mx.full((1, 1, 1, 16), 30.0), mx.zeros((1, 1, 7, 16))], axis=2)
    v = mx.arange(8 * 4, dtype=mx.float32).reshape(1, 1, 8, 4)
    got = K.attention(q, k, v, 1.0, False)
    assert max_diff(got, v[:, :, :1]) < 1e-6  # all weight on the first key, no overflow


def test_attention_falls_back_when_it_does_not_apply(K):
    n = K.MAX_ATTENTION_QUERIES + 1  # more queries than the kernels take (a long prefill chunk)
    q = mx.random.normal((1, 2, n, 16))
    k = v = mx.random.normal((1, 2, n + 3, 16))
    assert K.attention(q, k, v, 0.25, True) is None
    assert K.attention(q[:, :, :1].astype(mx.bfloat16), k.astype(mx.bfloat16),
                       v.astype(mx.bfloat16), 0.25, False) is None


@pytest.mark.parametrize("window", [None, 5, 11])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_attention_queries_are_reduced_alike_whatever_their_count(K, window, heads):
    """Row invariance: M causal queries (a verify block) give bit for bit what M one-query
    calls give, each over its own visible keys (the last ``window`` when windowed)."""
    hq, hkv = heads
    L = 27
    q = mx.random.normal((1, hq, 16, 24))
    k, v = mx.random.normal((1, hkv, L, 24)), mx.random.normal((1, hkv, L, 24))
    for m in range(1, 17):
        block = np.array(K.attention(q[:, :, :m], k[:, :, :L - 16 + m], v[:, :, :L - 16 + m],
                                     0.3, True, window))
        for i in range(m):
            end = L - 16 + i + 1  # keys query i sees end at its own position
            start = 0 if window is None else max(0, end - window)
            one = np.array(K.attention(q[:, :, i:i + 1], k[:, :, start:end], v[:, :, start:end],
                                       0.3, False))
            np.testing.assert_array_equal(block[:, :, i:i + 1], one, err_msg=f"M={m} row {i}")


@pytest.mark.parametrize("d", [64, 128, 80])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("heads", [(6, 2), (9, 3)])
def test_long_query_blocks_are_reduced_alike_whatever_their_count(K, d, window, heads):
    """The same over hundreds of keys: the scores run in blocks of 16 keys and the values in
    spans of a few KB, and with 3 kv heads on 2 threads each head's queries in two parts; a
    query's result must not depend on where any of those fall for it."""
    (hq, hkv), L, M = heads, 300, 40
    q = mx.random.normal((1, hq, M, d))
    k, v = mx.random.normal((1, hkv, L, d)), mx.random.normal((1, hkv, L, d))
    block = np.array(K.attention(q, k, v, 0.2, True, window))
    for i in (0, 1, 17, 19, 20, M - 1):
        end = L - M + i + 1
        start = 0 if window is None else max(0, end - window)
        one = np.array(K.attention(q[:, :, i:i + 1], k[:, :, start:end], v[:, :, start:end],
                                   0.2, False))
        np.testing.assert_array_equal(block[:, :, i:i + 1], one, err_msg=f"row {i}")


@pytest.mark.parametrize("k", [1, 17, 64, 72, 128, 130, 256])
@pytest.mark.parametrize("m", [1, 3, 12, 53])
def test_attention_scores_kernel_equals_the_product_kernel_bit_for_bit(K, k, m):
    """Attention scores go through their own kernel (16 keys reduced together); each score
    must be, bit for bit, the matvec kernel's product, so decode, verify and prefill, and the
    caches written before it, keep their numerics."""
    x = mx.random.normal((m, k))
    for n in (15, 16, 33, 100):
        w = mx.random.normal((n, k))
        np.testing.assert_array_equal(np.array(K._mod().key_rows(x, w)),
                                      np.array(K.matvec(x, w)), err_msg=f"N={n}")


def test_the_avx2_scores_kernel_equals_its_product_kernel(K):
    """The AVX2 build has its own 8-lane tree (on an AVX-512 CPU only ARBOR_MATVEC_ISA=avx2
    reaches it): its scores must equal its matvec bit for bit as well."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    if not {"avx2", "fma", "f16c"} <= set(flags):
        pytest.skip("this CPU has no AVX2")
    script = (
        "import numpy as np, backend, mlx.core as mx\n"
        "from backend import kernels\n"
        "assert kernels.isa() == 'avx2', kernels.isa()\n"
        "for k in (32, 64, 128):\n"
        "    for m in (1, 5, 53):\n"
        "        x, w = mx.random.normal((m, k)), mx.random.normal((37, k))\n"
        "        np.testing.assert_array_equal(np.array(kernels._mod().key_rows(x, w)),\n"
        "                                      np.array(kernels.matvec(x, w)))\n")
    subprocess.run([sys.executable, "-c", script], check=True,
                   env=dict(os.environ, ARBOR_MATVEC_ISA="avx2"),
                   cwd=Path(__file__).resolve().parents[1])


def test_attention_argument_errors(K):
    q = mx.zeros((1, 3, 1, 16))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        K._mod().attention(q, mx.zeros((1, 2, 4, 16)), mx.zeros((1, 2, 4, 16)), 1.0, False)
    with pytest.raises(ValueError, match="float32"):
        K._mod().attention(q.astype(mx.float16), mx.zeros((1, 3, 4, 16)),
                           mx.zeros((1, 3, 4, 16)), 1.0, False)


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 5, 9, 64), (3, 7)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_mlx(K, shape, weighted):
    x = mx.random.normal(shape) * 3
    w = mx.random.normal(shape[-1:]) if weighted else None
    assert max_diff(K.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5)) < 2e-6
    strided = x.swapaxes(0, -2) if x.ndim > 2 else x[::2]
    assert max_diff(K.rms_norm(strided, w, 1e-5), mx.fast.rms_norm(strided, w, 1e-5)) < 2e-6


def test_rms_norm_weight_mismatch_is_an_error(K):
    with pytest.raises(ValueError, match="does not match"):
        K._mod().rms_norm(mx.zeros((2, 8)), mx.zeros((4,)), 1e-5)


@pytest.mark.parametrize("kind,params", [
    ("default", {}),
    ("linear", {"factor": 4.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64}),
])
@pytest.mark.parametrize("dims,head_dim", [(64, 64), (16, 64)])
@pytest.mark.parametrize("offset", [0, 13, 20000])
def test_rope_module_native_equals_mlx(K, kind, params, dims, head_dim, offset):
    rope = RoPE(dims, RopeSettings(kind=kind, theta=10000.0, params=params))
    x = mx.random.normal((1, 4, 3, head_dim))  # (B, heads, T, D)
    x = x.transpose(0, 2, 1, 3).reshape(1, 3, 4, head_dim).transpose(0, 2, 1, 3)  # strided
    plain = rope(x, offset)
    rope.native_ops = True
    native = rope(x, offset)
    # float32 angles at position 20000 carry ~1e-3 absolute error in both; we form them the
    # same way, so the two agree far more closely than either does with exact math.
    assert max_diff(native, plain) < (2e-6 if offset < 1000 else 2e-5)
    assert rope(x, mx.array(offset)).shape == x.shape  # array offsets fall back to MLX


def test_rms_norm_module_native_equals_mlx(K):
    norm = RMSNorm(64, 1e-6, offset=1.0)
    norm.weight = mx.random.normal((64,))
    x = mx.random.normal((1, 1, 64))
    plain = norm(x)
    norm.native_ops = True
    assert max_diff(norm(x), plain) < 2e-6


def test_decode_ops_are_lazy_and_compose_with_async_eval(K):
    q = mx.random.normal((1, 4, 1, 32))
    k = v = mx.random.normal((1, 2, 50, 32))
    inv = mx.exp(-mx.arange(16, dtype=mx.float32) * (math.log(10000.0) / 16))
    out = K.attention(K.rope(q, 32, 49, 1.0, inv), k, v, 0.2, False)
    out = K.rms_norm(out, None, 1e-6)
    mx.async_eval(out)
    want = mx.fast.rms_norm(mx.fast.scaled_dot_product_attention(
        mx.fast.rope(q, 32, traditional=False, base=10000.0, scale=1.0, offset=49), k, v,
        scale=0.2), None, 1e-6)
    assert max_diff(out, want) < 1e-5


@pytest.mark.parametrize("case", ["llama", "qwen3", "gemma3", "qwen3_next", "glm4_moe_lite",
                                  "glm4_moe_lite-4bit"])
def test_model_decode_with_native_ops_equals_plain_mlx(K, tiny_model_dir, case):
    from backend.weights.loading import load_model

    native = load_model(tiny_model_dir(case), dtype="float32", cpu_kernels=True).model
    plain = load_model(tiny_model_dir(case), dtype="float32", cpu_kernels=False).model
    assert any(getattr(m, "native_ops", False) for _, m in native.named_modules())
    assert not any(getattr(m, "native_ops", False) for _, m in plain.named_modules())
    tokens = mx.array([[3, 17, 9, 40, 2, 11, 5, 8, 21, 30, 12, 6]])
    caches = {id(native): native.make_caches(), id(plain): plain.make_caches()}
    for start, end in [(0, 7), (7, 8), (8, 9), (9, 12)]:  # prefill, decode, verify block
        a = native(tokens[:, start:end], caches[id(native)])
        b = plain(tokens[:, start:end], caches[id(plain)])
        assert max_diff(a, b) < 1e-4, (case, start)


@pytest.mark.parametrize("shape", [(1, 1, 1536), (3, 7), (2, 300, 1536)])  # last: threaded
def test_silu_mul_matches_mlx(K, shape):
    g = mx.random.normal(shape) * 6
    u = mx.random.normal(shape)
    assert close_rel(K.silu_mul(g, u), nn_silu(g) * u)
    gt, ut = g.swapaxes(-1, -2), u.swapaxes(-1, -2)  # strided inputs
    assert close_rel(K.silu_mul(gt, ut), nn_silu(gt) * ut)


def test_silu_mul_saturates_without_overflow(K):
    g = mx.array([-1000.0, -88.0, -20.0, 0.0, 20.0, 88.0, 1000.0])
    got = K.silu_mul(g, mx.ones_like(g))
    assert mx.all(mx.isfinite(got)).item()
    assert max_diff(got, nn_silu(g)) < 1e-4


def test_silu_mul_falls_back_for_other_dtypes(K):
    g = mx.random.normal((4, 8)).astype(mx.bfloat16)
    assert K.silu_mul(g, g).dtype == mx.bfloat16


def nn_silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def close_rel(got: mx.array, want: mx.array, rel: float = 1e-6) -> bool:
    """Within ``rel`` of the largest magnitude (a few float32 ulps)."""
    return max_diff(got, want) <= rel * (1.0 + mx.abs(want).max().item())


@pytest.mark.parametrize("shape", [(1, 1, 2 * 96), (2, 5, 2 * 40), (1, 300, 2 * 1536)])
def test_silu_mul_reads_the_halves_of_a_stacked_product_in_place(K, shape):
    y = mx.random.normal(shape) * 4
    g, u = mx.split(y, 2, axis=-1)  # views with a row stride of 2H
    assert close_rel(K.silu_mul(g, u), nn_silu(g) * u)
    assert close_rel(K.silu_mul(u, g), nn_silu(u) * g)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("shape", [(2, 3, 5, 9), (1, 1, 40, 40), (1, 4, 17, 300)])
def test_causal_softmax_matches_masked_softmax(K, shape, window):
    x = mx.random.normal(shape, key=mx.random.key(sum(shape))) * 4
    m, n = shape[-2], shape[-1]
    q = mx.arange(n - m, n)[:, None]
    keys = mx.arange(n)[None]
    allowed = keys <= q
    if window is not None:
        allowed = allowed & (keys > q - window)
    want = mx.softmax(mx.where(allowed, x, -mx.inf), axis=-1)
    got = K.causal_softmax(x, window)
    assert max_diff(got, want) < 5e-6  # the kernel's exp: relative error < 2e-7
    assert float(mx.max(mx.where(allowed, 0.0, got))) == 0.0  # masked keys are exactly 0


def test_long_query_runs_match_mlx_attention(K):
    """Prefill-sized runs (BLAS products, native masked softmax) equal MLX's attention."""
    from backend.caches.attention import scaled_dot_product_attention
    from backend.caches.base import CAUSAL, sliding_window
    from backend.caches.kv import ContiguousHistory

    q = mx.random.normal((1, 6, 300, 32))
    k, v = mx.random.normal((1, 2, 340, 32)), mx.random.normal((1, 2, 340, 32))
    history = ContiguousHistory(k, v, 40, 300)
    for mask in (CAUSAL, sliding_window(50)):
        got = scaled_dot_product_attention(q, history, mask, 0.2, native=True)
        want = scaled_dot_product_attention(q, history, mask, 0.2, native=False)
        assert max_diff(got, want) < 1e-5

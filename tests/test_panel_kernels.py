"""Float32 weights in panels (backend/kernels/kernels_panels.h): the product against float64,
each row's result independent of the rows beside it (any count, prefill-sized too), the same
bits on AVX-512 and AVX2 (and across thread counts: tests/test_kernels.py), and the kernel linear layers that keep their
weights so (stacked projections split at the right outputs, the fused layers take them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from backend import kernels
from backend.models.cpu_linear import KernelLinear, StackedProjections
from tests.test_kernels import _close

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def K(native_kernels):
    return native_kernels


def test_panels_hold_sixteen_outputs_k_major(K):
    w = mx.arange(32 * 3, dtype=mx.float32).reshape(32, 3)
    panels = kernels.pack_panels(w)
    assert panels.shape == (2, 3, 16)
    assert panels[1, 2, 5].item() == w[16 + 5, 2].item()
    np.testing.assert_array_equal(np.array(kernels.unpack_panels(panels)), np.array(w))


@pytest.mark.parametrize("n,k", [(16, 1), (48, 7), (960, 576), (576, 1536), (2064, 64)])
def test_panel_products_equal_float64_and_every_row_alone(K, n, k):
    w = mx.random.normal((n, k)) * 0.1
    panels = kernels.pack_panels(w)
    x = mx.random.normal((100, k))
    whole = K.matvec(x, panels)
    _close(whole, x, w)
    # Every row count from 1 to 100 (tiles of 8, 4, 2 and 1 rows, chunks of few and many
    # rows): a row's bits never depend on the rows computed with it.
    for m in (1, 2, 3, 5, 7, 8, 9, 13, 64, 65, 100):
        part = K.matvec(x[:m], panels)
        assert mx.array_equal(part, whole[:m]).item(), m
    alone = mx.concatenate([K.matvec(x[i:i + 1], panels) for i in (0, 41, 99)])
    assert mx.array_equal(alone, whole[mx.array([0, 41, 99])]).item()


def _cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def test_avx2_and_avx512_give_the_same_bits(K, tmp_path):
    """One chain of FMAs per output: the instruction set changes nothing (unlike row-major
    weights, whose sums follow the vector width)."""
    if not (_cpu_has("avx512f") and _cpu_has("avx2") and _cpu_has("fma")):
        pytest.skip("needs a CPU with AVX-512 and AVX2")
    w = mx.random.normal((96, 200)) * 0.1
    x = mx.random.normal((11, 200))
    np.savez(tmp_path / "args.npz", x=np.array(x), w=np.array(w))
    script = (
        "import sys, numpy as np, backend, mlx.core as mx\n"
        "from backend import kernels\n"
        "a = {k: mx.array(v) for k, v in np.load(sys.argv[1]).items()}\n"
        "np.save(sys.argv[2], np.array(kernels.matvec(a['x'], kernels.pack_panels(a['w']))))\n"
        "print(kernels.isa())\n")
    outs = {}
    for isa in ("avx2", "avx512"):
        env = dict(os.environ, ARBOR_MATVEC_ISA=isa)
        ran = subprocess.run([sys.executable, "-c", script, str(tmp_path / "args.npz"),
                              str(tmp_path / f"{isa}.npy")], check=True, env=env, cwd=ROOT,
                             capture_output=True, text=True)
        assert ran.stdout.strip() == isa
        outs[isa] = np.load(tmp_path / f"{isa}.npy")
    np.testing.assert_array_equal(outs["avx2"], outs["avx512"])


def test_kernel_linear_layers_keep_float32_weights_as_panels(K):
    w = mx.random.normal((64, 32))
    layer = KernelLinear(w, mx.ones((64,)))
    assert layer.weight.shape == (4, 32, 16)  # the parameter itself: no second copy
    x = mx.random.normal((70, 32))  # past MAX_KERNEL_ROWS: still the kernel
    _close(layer(x) - 1, x, w)
    odd = KernelLinear(mx.random.normal((40, 32)), None)  # 40 outputs: not whole panels
    assert odd.weight.shape == (40, 32)
    half = KernelLinear(w.astype(mx.bfloat16), None)  # 16-bit weights stay row-major
    assert half.weight.ndim == 2


def test_stacked_panels_split_at_each_layers_outputs(K):
    ws = [mx.random.normal((n, 48)) for n in (64, 32, 32)]
    layers = [KernelLinear(w, None) for w in ws]
    stacked = StackedProjections.build(layers)
    assert stacked is not None and stacked.stacked["weight"].shape == (8, 48, 16)
    x = mx.random.normal((5, 48))
    for part, layer, w in zip(stacked(x), layers, ws):
        assert mx.array_equal(part, layer(x)).item()
        _close(part, x, w)


def test_a_model_on_the_kernels_runs_on_panels(K):
    from backend.models.cpu_setup import use_cpu_kernels

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(32, 48, bias=False)
            self.b = nn.Linear(48, 20)

    model = Tiny()
    mx.eval(model.parameters())
    x = mx.random.normal((3, 32))
    want = model.b(model.a(x))
    assert use_cpu_kernels(model)
    assert model.a.weight.ndim == 3 and model.b.weight.ndim == 2
    assert mx.allclose(model.b(model.a(x)), want, rtol=1e-5, atol=1e-5).item()


def test_layers_off_whole_panels_stack_as_rows(K):
    """Qwen3.5's four linear-attention projections: two of them have a few outputs (one per
    head), so the four go back to rows and still stack into one product."""
    ws = [mx.random.normal((n, 48)) for n in (64, 32, 4, 4)]
    layers = [KernelLinear(w, None) for w in ws]
    assert [layer.weight.ndim for layer in layers] == [3, 3, 2, 2]
    stacked = StackedProjections.build(layers)
    assert stacked is not None and stacked.stacked["weight"].shape == (104, 48)
    x = mx.random.normal((3, 48))
    for part, w in zip(stacked(x), ws):
        _close(part, x, w)


def test_a_float32_embedding_table_in_panels_looks_up_and_projects_alike(K):
    """The tied output projection of a batched step runs on panels; lookups gather each row
    from its panel (any shape of ids), equal to the table's rows."""
    from backend.models.cpu_linear import KernelEmbedding

    plain = nn.Embedding(96, 40)
    mx.eval(plain.parameters())
    table = plain.weight
    embedding = KernelEmbedding(plain)
    assert embedding.weight.shape == (6, 40, 16)
    ids = mx.array([[0, 5, 17], [95, 16, 31]])
    assert mx.array_equal(embedding(ids), table[ids]).item()
    x = mx.random.normal((9, 40))
    _close(embedding.as_linear(x), x, table)
    odd = nn.Embedding(50, 8)  # a vocabulary off a multiple of 16 stays rows
    assert KernelEmbedding(odd).weight.ndim == 2


def test_a_quantized_model_with_a_float32_table_has_panels(K):
    """The disk tier's key names panels for it (its tied projection's bits moved), while its
    products stay off panels (no exact prefill by default)."""
    from backend.models.cpu_setup import has_panels, products_all_on_panels, use_cpu_kernels

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 64)
            self.proj = nn.QuantizedLinear(64, 64, bias=False, group_size=32, bits=4)

    model = Tiny()
    mx.eval(model.parameters())
    assert use_cpu_kernels(model)
    assert has_panels(model) and not products_all_on_panels(model)

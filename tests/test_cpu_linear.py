"""The CPU compute path: kernel-backed layers equal plain MLX layers for every row count."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from backend.models.cpu_linear import MAX_KERNEL_ROWS
from backend.models.cpu_setup import use_cpu_kernels
from backend.weights.loading import load_model

# Decided when the first test runs, after tests/conftest.py's fixture has built the kernels (a
# skipif at import time would see an unbuilt extension in a fresh clone and skip everything).
pytestmark = pytest.mark.usefixtures("native_kernels")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.proj = nn.Linear(64, 128, bias=True)
        self.down = nn.Linear(128, 64, bias=False)

    def __call__(self, x):
        return self.embed.as_linear(self.down(self.proj(x)))


@pytest.mark.parametrize("quantize", [None, (32, 4), (64, 8)])
@pytest.mark.parametrize("rows", [1, 3, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1, 32, 33, 40])
def test_kernel_layers_match_mlx(quantize, rows):
    mx.random.seed(0)
    plain = Tiny()
    if quantize:
        nn.quantize(plain, group_size=quantize[0], bits=quantize[1])
    mx.eval(plain.parameters())
    fast = Tiny()
    if quantize:
        nn.quantize(fast, group_size=quantize[0], bits=quantize[1])
    fast.update(plain.parameters())
    assert use_cpu_kernels(fast)
    x = mx.random.normal((1, rows, 64))
    expected, got = plain(x), fast(x)
    assert np.allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)
    names = {k for k, _ in plain.parameters().items()}
    assert names == {k for k, _ in fast.parameters().items()}  # names unchanged


def test_default_dtype_model_uses_kernels_and_bf16_does_not(tiny_model_dir):
    from backend.models.cpu_linear import KernelLinear

    f32 = load_model(tiny_model_dir("llama"))
    assert isinstance(f32.model.model.layers[0].mlp.up_proj, KernelLinear)
    bf16 = load_model(tiny_model_dir("llama"), dtype="bfloat16")
    assert type(bf16.model.model.layers[0].mlp.up_proj) is nn.Linear


def test_bf16_checkpoint_keeps_16bit_weights_with_float32_results(tiny_model_dir, tmp_path):
    """A bf16 checkpoint on the CPU: linear weights stay bf16 (half the bytes per decode step),
    the kernels widen them exactly, so logits equal those of the weights upcast at load time."""
    import shutil

    src = tiny_model_dir("qwen2")
    folder = tmp_path / "bf16"
    shutil.copytree(src, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    fast = load_model(folder)
    plain = load_model(folder, cpu_kernels=False)
    layer = fast.model.model.layers[0]
    assert layer.mlp.up_proj.weight.dtype == mx.bfloat16
    assert fast.model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert layer.input_layernorm.weight.dtype == mx.float32
    assert fast.parameter_bytes < 0.6 * plain.parameter_bytes
    tokens = mx.array([[4, 8, 15, 16, 23, 42, 7, 9, 11, 13]])
    expected = plain.model(tokens, plain.model.make_caches())
    caches = fast.model.make_caches()
    prefill = fast.model(tokens[:, :6], caches)  # BLAS path
    steps = [fast.model(tokens[:, i:i + 1], caches) for i in range(6, 10)]  # kernel path
    got = mx.concatenate([prefill] + steps, axis=1)
    assert got.dtype == mx.float32
    assert np.abs(np.array(got) - np.array(expected)).max() < 1e-4


@pytest.mark.parametrize("case,quantize", [("llama", None), ("qwen2", None), ("llama", 4),
                                           ("qwen3_next", None)])
def test_projections_sharing_an_input_are_stacked_without_copies(tiny_model_dir, tmp_path,
                                                                 case, quantize):
    """q/k/v and gate/up become one kernel call each; the layers' weights are views of the
    stacked matrix (no byte stored twice) and outputs equal the separate layers'."""
    import gc

    from mlx.utils import tree_flatten

    from backend.models.cpu_linear import StackedProjections
    from backend.models.layers import Attention, GatedMLP
    from backend.weights.store import import_hf_folder

    folder = tiny_model_dir(case)
    if quantize:
        folder = import_hf_folder(folder, tmp_path / "q", quantize=quantize)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    model = load_model(folder).model
    gc.collect()
    mx.clear_cache()
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    stacked_bytes = sum(v.nbytes for m in model.modules() if getattr(m, "stacked", None)
                        for v in m.stacked.stacked.values())
    assert stacked_bytes > 0.05 * params  # so a second copy could not hide in the 1% slack
    assert params <= mx.get_active_memory() - before < params * 1.01

    stackable = [m for _, m in model.named_modules() if isinstance(m, (Attention, GatedMLP))]
    assert stackable and all(isinstance(m.stacked, StackedProjections) for m in stackable)
    plain = load_model(folder, cpu_kernels=False).model  # quantized: dequantized at load
    if not quantize:
        assert {k for k, _ in tree_flatten(model.parameters())} == {
            k for k, _ in tree_flatten(plain.parameters())}

    tokens = mx.array([[3, 17, 9, 40, 2, 11, 5, 8, 21, 30]])
    caches, plain_caches = model.make_caches(), plain.make_caches()
    for start, end in [(0, 7), (7, 8), (8, 10)]:  # prefill (separate layers), decode, verify
        got = model(tokens[:, start:end], caches)
        want = plain(tokens[:, start:end], plain_caches)
        assert mx.abs(got - want).max().item() < (1e-4 if not quantize else 1e-3)
    x = mx.random.normal((1, 1, stackable[0].stacked.layers[0].weight.shape[1] * (
        32 // getattr(stackable[0].stacked.layers[0], "bits", 32))))
    stacked = stackable[0].stacked
    for ours, theirs in zip(stacked(x), [layer(x) for layer in stacked.layers]):
        assert mx.array_equal(ours, theirs)  # one row: the same sums, bitwise


def test_layers_of_different_kinds_are_not_stacked():
    from backend.models.cpu_linear import KernelLinear, StackedProjections

    a = KernelLinear(mx.zeros((4, 8)), None)
    b = KernelLinear(mx.zeros((4, 8)), mx.zeros((4,)))
    c = KernelLinear(mx.zeros((4, 8)).astype(mx.bfloat16), None)
    assert StackedProjections.build([a, b]) is None  # bias on one only
    assert StackedProjections.build([a, c]) is None  # weight dtypes differ
    assert StackedProjections.build([a, nn.Linear(8, 4)]) is None
    assert StackedProjections.build([a, KernelLinear(mx.ones((2, 8)), None)]) is not None

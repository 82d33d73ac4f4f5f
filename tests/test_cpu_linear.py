"""The CPU compute path: kernel-backed layers equal plain MLX layers for every row count."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from backend import kernels
from backend.models.cpu_linear import MAX_KERNEL_ROWS, use_cpu_kernels
from backend.models.loading import load_model

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"native kernels: {kernels.unavailable_reason()}")


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

"""`arbor bench` writes comparable variants of one checkpoint for both engines."""

import mlx.core as mx
import pytest

from backend.bench import write_variant
from backend.models.loading import load_model
from backend.models.store import import_hf_folder


def forward(model, tokens):
    return model(tokens, model.make_caches())


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "4bit"])
def test_variants_of_a_quantized_source_load_in_both_engines(tiny_model_dir, tmp_path, fmt):
    """Regression: a quantized source (the default model is Q4_1) used to be written with its
    scales/biases but without its quantization block, and then failed to load."""
    from mlx_lm.utils import load_model as mlx_lm_load

    source = import_hf_folder(tiny_model_dir("llama"), tmp_path / "q4", quantize=4)
    folder = write_variant(source, tmp_path / f"v-{fmt}", fmt)
    tokens = mx.array([[1, 5, 9, 3]])
    ours = forward(load_model(folder).model, tokens)
    reference = forward(load_model(source).model, tokens)
    theirs, _ = mlx_lm_load(folder)
    # Arbor computes in float32 on the CPU, mlx-lm in the checkpoint's dtype.
    tol = {"float32": 1e-4, "bfloat16": 0.1, "4bit": 0.5}[fmt]
    assert mx.abs(ours - theirs(tokens)).max().item() < tol
    assert mx.abs(ours - reference).max().item() < tol

"""`arbor bench` writes comparable variants of one checkpoint for both engines."""

import mlx.core as mx
import pytest

from backend.bench.speed import write_variant
from backend.engine import EXACT_PREFILL_CHUNK
from backend.weights.loading import load_model
from backend.weights.store import import_hf_folder


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


def test_best_prefill_keeps_the_best_run_within_the_budget(monkeypatch):
    import time

    from backend.bench import speed as bench

    figures = iter([100.0, 300.0, 200.0, 999.0])
    assert bench.best_prefill(lambda: next(figures)) == 300.0  # three runs at most
    monkeypatch.setattr(bench, "PREFILL_REPEAT_BUDGET_S", 0.01)

    def slow():
        time.sleep(0.02)
        return 5.0

    calls = []
    assert bench.best_prefill(lambda: calls.append(1) or slow()) == 5.0
    assert len(calls) == 1  # a slow engine is timed once


def test_bench_runs_both_engines_on_a_tiny_model(tiny_model_dir, tmp_path):
    from backend.bench import speed as bench

    rows = bench.run(tiny_model_dir("llama"), tmp_path, formats=("float32", "4bit"),
                     prompt_tokens=24, new_tokens=6, log=lambda _m: None)
    assert [(r.fmt, r.engine) for r in rows] == [
        ("float32", "arbor"), ("float32", "mlx-lm"), ("4bit", "arbor"), ("4bit", "mlx-lm")]
    assert all(r.prefill_tps > 0 and r.decode_tps > 0 and r.weight_bytes > 0 for r in rows)
    table = bench.format_table(rows, bandwidth_gbs=10.0)
    assert "ratio arbor/mlx-lm" in table and "4bit" in table
    costs = bench.exact_prefill_costs(tmp_path / f"{tiny_model_dir('llama').name}-float32",
                                      lengths=(20, 90), repeats=1)
    assert [n for n, _, _ in costs] == [20, 90]
    assert all(plain > 0 and exact > 0 for _, plain, exact in costs)
    table = bench.format_exact_costs(costs)
    assert f"exact prefill ({EXACT_PREFILL_CHUNK}-token chunks" in table and "90 tokens" in table

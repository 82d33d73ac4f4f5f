"""``arbor bench gguf`` end to end on a tiny GGUF in llama.cpp's Q4_K_M recipe: the float16
folder is the earlier import's layout (Q8_0 kept, the K-quants as float16 of the same values),
every row runs (Arbor on both folders, mlx-lm on the float16 one), and the table says bytes and
speed. Timings themselves are never asserted."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from backend.bench import gguf as bench_gguf
from backend.weights.gguf import import_gguf
from backend.weights.quantize import read_quantization, spec_for
from tests.fixtures.gguf_files import q4_k_m, write_gguf_like_llama_cpp
from tests.fixtures.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """Q4_K_M with a Q8_0 embedding (a type the earlier import kept)."""
    folder = tmp_path_factory.mktemp("bench-gguf")
    hf = write_tiny_model(folder / "hf", "llama", hidden_size=256, intermediate_size=512)
    recipe = q4_k_m(3, tied=False)

    def choose(name, shape):
        return "Q8_0" if name == "token_embd.weight" else recipe(name, shape)
    return write_gguf_like_llama_cpp(hf, folder / "model.gguf", choose)


def test_float16_import_is_the_earlier_layout(tiny_gguf, tmp_path):
    kept = import_gguf(tiny_gguf, tmp_path / "kept")
    old = bench_gguf.float16_import(kept, tiny_gguf, tmp_path / "float16")
    config = json.loads((old / "config.json").read_text())
    quantization = config["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (8, 32)  # only Q8_0 left
    weights, kept_weights = mx.load(str(old / "model.safetensors")), mx.load(
        str(kept / "model.safetensors"))
    assert weights["model.embed_tokens.scales"].dtype == mx.float32
    down = "model.layers.2.mlp.down_proj"  # Q6_K in the recipe (the last layer)
    assert weights[f"{down}.weight"].dtype == mx.float16 and f"{down}.scales" not in weights
    spec = spec_for(down, *read_quantization(json.loads((kept / "config.json").read_text())))
    assert (spec.bits, spec.group_size) == (6, 16)
    values = mx.dequantize(kept_weights[f"{down}.weight"],
                           kept_weights[f"{down}.scales"].astype(mx.float32),
                           kept_weights[f"{down}.biases"].astype(mx.float32),
                           spec.group_size, spec.bits)
    np.testing.assert_array_equal(np.array(weights[f"{down}.weight"]),
                                  np.array(values.astype(mx.float16)))
    assert bench_gguf._disk_bytes(kept) < bench_gguf._disk_bytes(old)


def test_arbor_bench_gguf_on_the_command_line(tiny_gguf, tmp_path, monkeypatch, capsys):
    from desktop.cli import main

    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    assert main(["bench", "gguf", "--model", str(tiny_gguf), "--new-tokens", "4"]) == 0
    table = capsys.readouterr().out
    assert "| K-quants kept |" in table and "| float16 import |" in table
    assert "| float16 import, mlx-lm |" in table and "kept / float16 import, mlx-lm:" in table
    assert "kept / float16:" in table
    assert main(["bench", "gguf", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "bench gguf needs --model FILE.gguf" in capsys.readouterr().err

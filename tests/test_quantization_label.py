"""One quantization label per model: the loaded engine's (window title) and the model store's
(model manager, ``arbor models list``) both come from ``quantize.describe_quantization``.

The mixed case is the default model's shape (Q4_1 linears with a Q8_0 embedding), where the
engine used to report only the default spec ("4-bit g32") while the store listed both.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from backend.engine import Engine
from backend.weights.store import ModelStore
from tests.test_gguf import tiny_hf_weights, write_gguf


def _mixed_gguf(tmp_path):
    def choose(name: str, data: np.ndarray) -> T:
        if data.ndim == 1:
            return T.F32
        return T.Q8_0 if name == "token_embd.weight" else T.Q4_1

    path = tmp_path / "mixed.gguf"
    write_gguf(path, tiny_hf_weights(seed=3, tie=True), choose)
    return path, None


def _quantized_folder(tmp_path, tiny_model_dir):
    return tiny_model_dir("qwen3"), 8


def _float_folder(tmp_path, tiny_model_dir):
    return tiny_model_dir("llama"), None


@pytest.mark.parametrize("source,label", [
    (lambda tmp, tiny: _mixed_gguf(tmp), "4-bit g32 + 8-bit g32"),
    (_quantized_folder, "8-bit g64"),
    (_float_folder, None),
], ids=["gguf-q4_1-with-q8_0-embedding", "folder-quantized-on-import", "float"])
def test_engine_and_store_report_the_same_label(source, label, tmp_path, tiny_model_dir,
                                                monkeypatch, qapp):
    from desktop.ui.simple_models import ModelTableModel

    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    path, bits = source(tmp_path, tiny_model_dir)
    store = ModelStore()
    stored = store.import_path(path, name="m", quantize=bits)
    engine = Engine.load("m")
    assert stored.quantization == engine.info.quantization == label
    table = ModelTableModel()
    table.set_models(store.list())
    shown = table.data(table.index(0, ModelTableModel.COLUMNS.index("Quantization")))
    assert shown == (label or "none (float)")

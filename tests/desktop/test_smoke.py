"""``arbor app --smoke`` from the source tree: the real window with the real engine loader and
the embedded default model, offscreen; a second start finds the first one's chat and model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from backend.weights.store import DEFAULT_MODEL_NAME
from tests.fixtures.app_smoke import smoke_report

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.usefixtures("default_model_gguf")  # fails, never skips, without the default model
def test_smoke_replies_in_the_real_window_and_a_restart_keeps_it(tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "ARBOR_HOME": str(tmp_path / "home")}
    command = [sys.executable, "-m", "desktop.cli", "app", "--smoke"]

    first = smoke_report(command, env, cwd=REPO)
    assert first["frozen"] is False and first["data_dir"] == str(tmp_path / "home")
    assert first["database_existed"] is False and first["conversations_before"] == 0
    assert first["models_before"] == []

    assert "Paris" in first["reply"]  # greedy: the model's own answer

    second = smoke_report(command, env, cwd=REPO)
    assert second["conversations_before"] == 1  # the first run's chat
    assert DEFAULT_MODEL_NAME in second["models_before"]
    assert second["reply"] == first["reply"]

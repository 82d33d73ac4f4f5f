"""A small run of the GUI responsiveness benchmark (``python -m desktop.bench_ui``) as a user
runs it, in its own process: it finishes without a traceback and reports every phase. Its
timings are the benchmark's business, not this test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PHASES = ("browse", "filter", "stream_replay", "stream_model")


def test_a_small_bench_ui_run_reports_every_phase_without_a_traceback(tiny_model_dir, tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "ARBOR_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [sys.executable, "-m", "desktop.bench_ui", "--conversations", "60", "--model",
         str(tiny_model_dir("llama")), "--tokens", "12", "--json"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    results = json.loads(proc.stdout)
    assert results["conversations"] == 60 and results["sidebar_ready_ms"] is not None
    for phase in PHASES:
        assert "error" not in results[phase], results[phase]
        assert results[phase]["ticks"] > 0 and results[phase]["p99_ms"] >= results[phase]["p50_ms"] >= 0
    assert results["browse"]["loaded"] == 60
    assert results["stream_replay"]["chars"] > 1000
    assert results["stream_model"]["tokens"] > 0

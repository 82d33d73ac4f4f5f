"""Shared test setup: offscreen Qt, an isolated Arbor data dir, tiny model folders."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

import backend  # noqa: E402,F401  (loads the system BLAS before mlx.core)


@pytest.fixture(autouse=True)
def _arbor_home(tmp_path_factory, monkeypatch):
    """Never touch the user's real data dir; the default-model import is shared per session."""
    monkeypatch.setenv("ARBOR_HOME", str(tmp_path_factory.getbasetemp() / "arbor-home"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: path of a tiny random HF model folder for a TINY_CONFIGS case (cached)."""
    from tests.fixtures.tiny_models import write_tiny_model

    made: dict[str, object] = {}

    def make(case: str = "llama"):
        if case not in made:
            made[case] = write_tiny_model(tmp_path_factory.mktemp(case), case)
        return made[case]

    return make

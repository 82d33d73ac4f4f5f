"""One place decides the data dir: the desktop app and the backend's model store agree on it."""

from __future__ import annotations

import ast
from pathlib import Path

import platformdirs

from backend.weights.store import ModelStore
from desktop import paths

ROOT = Path(__file__).resolve().parents[2]


def test_arbor_home_places_conversations_downloads_and_models_together(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    assert paths.data_dir() == tmp_path / "home" and paths.data_dir().is_dir()
    assert paths.database_path() == tmp_path / "home" / "conversations.sqlite3"
    assert paths.downloads_dir() == tmp_path / "home" / "downloads"
    assert ModelStore().root == tmp_path / "home" / "models"


def test_without_arbor_home_both_use_the_platform_data_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("ARBOR_HOME")
    monkeypatch.setattr(platformdirs, "user_data_dir", lambda app: str(tmp_path / "platform" / app))
    assert paths.data_dir() == tmp_path / "platform" / "arbor"
    assert ModelStore().root == tmp_path / "platform" / "arbor" / "models"


def _decides_the_data_dir(source: str) -> bool:
    """Whether code (not a docstring) calls ``user_data_dir`` or reads ``ARBOR_HOME`` itself."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "user_data_dir":
                return True
            if node.func.attr in ("get", "getenv") and any(
                (isinstance(arg, ast.Constant) and arg.value == "ARBOR_HOME")
                or (isinstance(arg, ast.Name) and arg.id == "ENV_HOME")
                for arg in node.args
            ):
                return True
    return False


def test_only_backend_paths_decides_the_data_dir():
    deciders = [
        path.relative_to(ROOT).as_posix()
        for folder in ("backend", "desktop")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if _decides_the_data_dir(path.read_text(encoding="utf-8"))
    ]
    assert deciders == ["backend/paths.py"]

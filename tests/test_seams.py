"""The two halves stay apart: backend/ never imports Qt or desktop/, desktop/ never imports MLX
(it reaches the engine only through backend's public modules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def python_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", python_files("desktop"), ids=lambda p: str(p.relative_to(ROOT)))
def test_desktop_never_imports_mlx(path):
    bad = {m for m in imported_modules(path) if m == "mlx" or m.startswith("mlx.")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", python_files("backend"), ids=lambda p: str(p.relative_to(ROOT)))
def test_backend_never_imports_qt_or_desktop(path):
    bad = {m for m in imported_modules(path)
           if m.split(".")[0] in ("PySide6", "desktop", "shiboken6")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_checks_see_the_code():
    assert len(python_files("desktop")) > 10 and len(python_files("backend")) > 20
    assert "mlx.core" in imported_modules(ROOT / "backend" / "engine.py")

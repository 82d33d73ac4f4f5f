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


# ---------------------------------------------------------------------------------------------
# No import circles inside backend/: neither between modules nor between its packages.


def backend_modules() -> dict[str, Path]:
    """``"backend.models.llama"`` -> its file, for every module and package of backend/."""
    modules = {}
    for path in python_files("backend"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def backend_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The backend modules ``name`` imports, at any depth (an import inside a function closes a
    circle at run time just the same), except under ``if TYPE_CHECKING:``. ``from a import b``
    counts as importing ``a.b`` when that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {module for module in found if module in modules and module != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = backend_modules()
    return {name: backend_imports(name, path, modules) for name, path in modules.items()}


def package_of(module: str) -> str:
    """``backend.models.llama`` -> ``backend.models``; top-level modules are their own node."""
    return ".".join(module.split(".")[:2])


def test_no_import_circle_between_backend_modules():
    assert circles(import_graph()) == []


def test_no_import_circle_between_backend_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        packages.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module))
    assert circles(packages) == []


def test_the_circle_check_sees_circles():
    graph = import_graph()
    assert "backend.models.cpu_linear" in graph["backend.models.fused_layer"]  # it sees imports
    assert "backend.models" in graph["backend.weights.loading"]  # and `from pkg import name`
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []

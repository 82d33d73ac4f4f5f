"""What a plain install of Arbor brings, without the test extras: ``pip install -e .`` (and so
``bash packaging/dev.sh app``) renders replies with highlighted code blocks and Copy links, and
has the default model; a wheel carries the native kernels' sources."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from backend.weights.store import DEFAULT_MODEL_DIR, default_model_source
from desktop.ui.markdown_render import COPY_SCHEME, MarkdownRenderer


def runtime_closure(distribution: str) -> dict[str, list[str]]:
    """Every distribution a plain install of ``distribution`` pulls in (markers evaluated here,
    no extras of its own; extras that a requirement asks for, like ``mlx[cpu]``, followed),
    each with the chain of requirements that reaches it."""
    reached: dict[str, list[str]] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    queue: list[tuple[str, frozenset[str], list[str]]] = [(distribution, frozenset(), [])]
    while queue:
        name, extras, chain = queue.pop()
        for line in metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker and not any(marker.evaluate({"extra": e}) for e in extras | {""}):
                continue
            dep, dep_extras = canonicalize_name(requirement.name), frozenset(requirement.extras)
            reached.setdefault(dep, chain + [dep])
            if (dep, dep_extras) not in visited:
                visited.add((dep, dep_extras))
                queue.append((dep, dep_extras, chain + [dep]))
    return reached


def test_markdown_and_highlighting_come_with_a_plain_install():
    closure = runtime_closure("arbor-chat")
    assert "markdown-it-py" in closure and "pygments" in closure, sorted(closure)
    assert "torch" not in closure  # the walk really left out the test extras


def test_the_default_model_comes_with_a_plain_install():
    gguf = default_model_source()
    assert gguf.parent == DEFAULT_MODEL_DIR  # inside Arbor's own package, from its build
    with open(gguf, "rb") as file:
        assert file.read(4) == b"GGUF"
    assert gguf.stat().st_size > 90_000_000  # the whole 135M-parameter model, not a stub


def test_a_plain_install_ships_the_native_kernels_sources():
    """The kernels are built where Arbor runs, from the sources build.py names: an install from
    a wheel (not editable) must carry every one of them, or it silently runs without them."""
    import fnmatch
    from pathlib import Path

    from setuptools.config.pyprojecttoml import read_configuration

    from backend.kernels import build

    root = Path(__file__).resolve().parents[1]
    config = read_configuration(root / "pyproject.toml")
    patterns = config["tool"]["setuptools"]["package-data"].get("backend.kernels", [])
    files = [name for name, _ in build._SOURCES] + list(build._HEADERS)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not missing, f"not shipped: {missing}"
    # and build.py names every source and header the folder holds
    here = sorted(p.name for p in (root / "backend" / "kernels").iterdir()
                  if p.suffix in (".cpp", ".h"))
    assert here == sorted(files), (here, sorted(files))


def test_a_fenced_code_block_renders_highlighted_with_a_copy_link():
    code = 'def greet(name):\n    return f"Hello, {name}!"'
    rendered = MarkdownRenderer().render(f"Here:\n\n```python\n{code}\n```\n")
    assert rendered.code_blocks == (code,)
    assert f'href="{COPY_SCHEME}:0"' in rendered.html and ">Copy</a>" in rendered.html
    body = rendered.html.split("<pre>", 1)[1]
    assert '<span style="color: #' in body  # Pygments' inline colours, not the plain fallback
    assert "<p>Here:</p>" in rendered.html  # markdown-it-py, not Qt's own Markdown reader

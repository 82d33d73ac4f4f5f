"""Build Arbor's double-clickable bundle with PyInstaller: ``python packaging/build_bundle.py``.

Run it from the build venv that ``bash packaging/dev.sh bundle`` sets up (Arbor's runtime
dependencies plus the ``bundle`` extra, nothing from the test extras). It

1. checks that the default model's GGUF is in ``backend/models/default_model/`` (an install
   of Arbor puts it there: ``packaging/arbor_build.py``);
2. on Linux builds the native CPU kernels against this venv's MLX (``backend.kernels.build``,
   a no-op when they are up to date) and stages the system OpenBLAS (``libopenblas0-pthread``)
   as ``libopenblas.so.0`` for the bundle;
3. runs PyInstaller on ``packaging/arbor.spec`` into ``dist/`` (``dist/Arbor/`` on Linux,
   ``dist/Arbor.app`` on macOS), keeping its work folder ``build/pyinstaller/`` between runs;
4. writes the digest of everything the bundle was built from into it and prints what takes
   the space.

A bundle whose digest matches its inputs is left as it is (``--force`` rebuilds), so running
this again after no change costs a second. Exit status 0, or 1 with one ``bundle: error:`` line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bundle_config as cfg  # noqa: E402

sys.path.insert(0, str(cfg.ROOT))


class BundleError(RuntimeError):
    """The bundle cannot be built here (the message says why and what to do)."""


def stamp_path() -> Path:
    if sys.platform == "darwin":  # beside the app: a file in a signed bundle would unseal it
        return cfg.DIST_DIR / f"{cfg.APP_NAME}.app.{cfg.STAMP_NAME}"
    return cfg.bundle_dir() / cfg.STAMP_NAME


def is_up_to_date() -> bool:
    stamp = stamp_path()
    return cfg.executable().is_file() and stamp.is_file() and \
        stamp.read_text().strip() == cfg.inputs_digest()


def _check_default_model() -> None:
    if not any((cfg.ROOT / "backend/models/default_model").glob("*.gguf")):
        raise BundleError("the default model is missing from backend/models/default_model/: "
                          "install Arbor into this venv first (pip install -e .)")


def _prepare_linux(env: dict[str, str]) -> None:
    from backend.blas import BUNDLED_NAME, system_openblas
    from backend.kernels import build as kernels_build

    ok, why = kernels_build.supported_platform()
    if ok:
        try:
            kernels_build.build(quiet=True)
        except kernels_build.BuildError as exc:
            raise BundleError(f"the native CPU kernels did not build: {exc}") from None
    else:
        print(f"bundle: note: no native kernels in this bundle ({why})", file=sys.stderr)
    openblas = system_openblas()
    if openblas is None:
        raise BundleError("no system OpenBLAS found: install libopenblas0-pthread "
                          "(bash packaging/dev.sh bundle does it on Debian/Ubuntu)")
    staged = cfg.WORK_DIR / "openblas" / BUNDLED_NAME
    staged.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(os.path.realpath(openblas), staged)
    env["ARBOR_BUNDLE_OPENBLAS"] = str(staged)


def _run_pyinstaller(env: dict[str, str], clean: bool) -> None:
    command = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
               "--distpath", str(cfg.DIST_DIR), "--workpath", str(cfg.WORK_DIR), str(cfg.SPEC)]
    if clean:
        command.insert(3, "--clean")
    result = subprocess.run(command, cwd=cfg.ROOT, env=env)
    if result.returncode != 0:
        raise BundleError(f"PyInstaller failed (exit status {result.returncode}; its log is above)")


def strip_python_debug_symbols(root: Path) -> None:
    """Strip debug symbols from the interpreter's own libraries (a source-built Python, e.g.
    pyenv's, keeps ~20 MB of them); libraries from wheels are left alone (auditwheel's
    patched files do not survive ``strip``)."""
    tool = shutil.which("strip")
    if tool is None:
        print("bundle: note: no `strip` found; the Python library keeps its debug symbols",
              file=sys.stderr)
        return
    internal = root / "_internal"
    files = [p for p in internal.glob("libpython3*.so*") if not p.is_symlink()]
    files += internal.glob("python3*/lib-dynload/*.so")
    for path in files:
        subprocess.run([tool, "--strip-debug", str(path)], check=True)


def _tree_size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(_tree_size(child) for child in path.iterdir())


def size_report(root: Path, top: int = 12) -> str:
    """The bundle's size and its largest entries (the folders under ``_internal`` split out)."""
    entries = []
    for child in root.iterdir():
        if child.name == "_internal" and child.is_dir():
            entries += [(f"_internal/{c.name}", _tree_size(c)) for c in child.iterdir()]
        else:
            entries.append((child.name, _tree_size(child)))
    entries.sort(key=lambda e: -e[1])
    total = sum(size for _, size in entries)
    lines = [f"{root}: {total / 1e6:.1f} MB"]
    lines += [f"  {size / 1e6:8.1f} MB  {name}" for name, size in entries[:top]]
    rest = entries[top:]
    if rest:
        lines.append(f"  {sum(s for _, s in rest) / 1e6:8.1f} MB  ({len(rest)} more)")
    return "\n".join(lines)


def build(force: bool = False, clean: bool = False) -> Path:
    """Builds the bundle if it is stale; returns the path of its ``arbor`` executable."""
    if not force and is_up_to_date():
        print(f"bundle: up to date: {cfg.executable()}")
        return cfg.executable()
    _check_default_model()
    env = dict(os.environ)
    if sys.platform != "darwin":
        _prepare_linux(env)
    started = time.monotonic()
    stamp_path().unlink(missing_ok=True)  # a build that fails half-way is never "up to date"
    _run_pyinstaller(env, clean)
    if sys.platform != "darwin":
        strip_python_debug_symbols(cfg.bundle_dir())
        for name in ("arbor.desktop", "install-desktop-entry.sh"):  # beside the program
            shutil.copy(cfg.LINUX_FILES / name, cfg.bundle_dir() / name)
    stamp_path().write_text(cfg.inputs_digest() + "\n")
    print(f"bundle: built {cfg.executable()} in {time.monotonic() - started:.0f} s")
    print(size_report(cfg.DIST_DIR / (f"{cfg.APP_NAME}.app" if sys.platform == "darwin" else cfg.APP_NAME)))
    return cfg.executable()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--clean", action="store_true", help="also drop PyInstaller's caches")
    args = parser.parse_args(argv)
    try:
        build(force=args.force or args.clean, clean=args.clean)
    except BundleError as exc:
        print(f"bundle: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the bundle build, its spec and its test agree on: names, places, version, inputs.

Plain Python with no third-party imports (the PyInstaller spec, ``build_bundle.py`` and
``tests/test_bundle.py`` all read it). The version comes from ``pyproject.toml`` alone.
"""

from __future__ import annotations

import hashlib
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"
SPEC = PACKAGING / "arbor.spec"
DIST_DIR = ROOT / "dist"
WORK_DIR = ROOT / "build" / "pyinstaller"
APP_NAME = "Arbor"  # the folder (Linux) or Arbor.app (macOS)
EXECUTABLE = "arbor"  # the program inside it, the same command as a pip install's
BUNDLE_ID = "org.arbor.Arbor"
MACOS_MINIMUM = "14.0"  # what MLX requires on macOS
ICONS = PACKAGING / "icons"
LINUX_FILES = PACKAGING / "linux"
#: Written into the bundle after a successful build: the digest of everything it was built from.
STAMP_NAME = "arbor-bundle-inputs.txt"

# What a bundle is built from: a change to any of these makes it stale.
_INPUT_GLOBS = (
    "backend/**/*.py",
    "desktop/**/*.py",
    "backend/kernels/_build/build_info.json",
    "packaging/arbor.spec",
    "packaging/arbor_main.py",
    "packaging/bundle_config.py",
    "packaging/build_bundle.py",
    "packaging/icons/*",
    "packaging/linux/*",
    "pyproject.toml",
)


def project_version() -> str:
    """``[project] version`` from pyproject.toml (read with a regex: tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    if match is None:
        raise RuntimeError("pyproject.toml has no [project] version")
    return match.group(1)


def bundle_dir() -> Path:
    """The built one-folder bundle (on macOS the .app's parent folder holds ``Arbor.app``)."""
    return DIST_DIR / APP_NAME


def executable() -> Path:
    if sys.platform == "darwin":
        return DIST_DIR / f"{APP_NAME}.app" / "Contents" / "MacOS" / EXECUTABLE
    return bundle_dir() / EXECUTABLE


def inputs_digest() -> str:
    """sha256 over the bundle's inputs (names and bytes), plus the Python and machine."""
    digest = hashlib.sha256(f"{sys.version}\0{platform.machine()}\0".encode())
    files = sorted({p for pattern in _INPUT_GLOBS for p in ROOT.glob(pattern) if p.is_file()})
    for path in files:
        if "__pycache__" in path.parts:
            continue
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
        digest.update(path.read_bytes())
    # The model by name, size and mtime (its bytes are pinned by sha256 in arbor_build.py).
    for path in sorted((ROOT / "backend/models/default_model").glob("*.gguf")):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def macos_info_plist() -> dict[str, object]:
    """Info.plist keys for Arbor.app beyond the ones PyInstaller's BUNDLE writes itself."""
    version = project_version()
    return {
        "CFBundleName": APP_NAME,
        "CFBundleDisplayName": APP_NAME,
        "CFBundleIdentifier": BUNDLE_ID,
        "CFBundleShortVersionString": version,
        "CFBundleVersion": version,
        "CFBundlePackageType": "APPL",
        "LSMinimumSystemVersion": MACOS_MINIMUM,
        "LSApplicationCategoryType": "public.app-category.productivity",
        "NSHighResolutionCapable": True,
        "NSRequiresAquaSystemAppearance": False,  # follows the system's dark mode
        "NSHumanReadableCopyright": "Arbor",
    }

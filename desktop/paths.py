"""Where the desktop app keeps its data.

The base data dir is decided in one place, ``backend.paths.data_dir`` (``$ARBOR_HOME`` when set,
else ``platformdirs.user_data_dir("arbor")``); the backend's model store lives in
``<base>/models``. The app adds ``<base>/conversations.sqlite3`` for conversations and
``<base>/downloads`` for partial Hub downloads.
"""

from __future__ import annotations

from pathlib import Path

from backend import paths as backend_paths
from backend.paths import ENV_HOME  # noqa: F401  (re-exported: the variable's name)

DATABASE_NAME = "conversations.sqlite3"


def data_dir() -> Path:
    """The base data dir (created on demand)."""
    base = backend_paths.data_dir()
    base.mkdir(parents=True, exist_ok=True)
    return base


def database_path() -> Path:
    """The SQLite file with every conversation."""
    return data_dir() / DATABASE_NAME


def downloads_dir() -> Path:
    """Staging area for Hub downloads; partial files here let a download resume."""
    return data_dir() / "downloads"

"""Where the desktop app keeps its data.

The base data dir is ``$ARBOR_HOME`` when set (tests and portable installs use it), else
``platformdirs.user_data_dir("arbor")``. The model store (``backend.models.store``) lives in
``<base>/models``; conversations live in ``<base>/conversations.sqlite3``; partial Hub downloads
in ``<base>/downloads``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "ARBOR_HOME"
DATABASE_NAME = "conversations.sqlite3"


def data_dir() -> Path:
    """The base data dir (created on demand)."""
    home = os.environ.get(ENV_HOME)
    if home:
        base = Path(home).expanduser()
    else:
        import platformdirs

        base = Path(platformdirs.user_data_dir("arbor"))
    base.mkdir(parents=True, exist_ok=True)
    return base


def database_path() -> Path:
    """The SQLite file with every conversation."""
    return data_dir() / DATABASE_NAME


def downloads_dir() -> Path:
    """Staging area for Hub downloads; partial files here let a download resume."""
    return data_dir() / "downloads"

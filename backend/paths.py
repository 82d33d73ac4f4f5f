"""Where Arbor keeps its data: the one place that decides it (``desktop.paths`` builds on it).

The base data dir is ``$ARBOR_HOME`` when set (tests and portable installs use it), else
``platformdirs.user_data_dir("arbor")``. Nothing here creates folders or imports MLX.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "ARBOR_HOME"


def data_dir() -> Path:
    """The base data dir, read from the environment at call time (it may not exist yet)."""
    home = os.environ.get(ENV_HOME)
    if home:
        return Path(home).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("arbor"))


def models_dir() -> Path:
    """The model store's root (``backend.weights.store.ModelStore``)."""
    return data_dir() / "models"


ENV_CACHE = "ARBOR_CACHE_DIR"


def cache_dir() -> Path:
    """Re-creatable data (the prefix cache's disk tier): ``$ARBOR_CACHE_DIR``, else
    ``$ARBOR_HOME/cache``, else ``platformdirs.user_cache_dir("arbor")``."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    home = os.environ.get(ENV_HOME)
    if home:
        return Path(home).expanduser() / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("arbor"))


ENV_PROFILES = "ARBOR_PROFILES_DIR"


def profiles_dir() -> Path:
    """Measured round costs per model, dtype and machine (``backend.speculation.profile``):
    ``$ARBOR_PROFILES_DIR``, else ``cache_dir() / "speculation"``."""
    if os.environ.get(ENV_PROFILES):
        return Path(os.environ[ENV_PROFILES]).expanduser()
    return cache_dir() / "speculation"

"""Widgets and item models of the desktop app (GUI thread only)."""

from desktop import qt_compat  # noqa: F401  (guards against a PySide6 refcount bug; see the module)

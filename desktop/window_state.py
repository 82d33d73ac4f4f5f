"""The main window's size, place and sidebar width, kept between runs (``QSettings``).

Kept in an INI file beside the chat database (``window.ini`` in the data dir), so a data dir
carries its own window state and ``ARBOR_HOME`` isolates it like everything else; a database in
memory keeps none.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings
from PySide6.QtWidgets import QMainWindow, QSplitter

FILE_NAME = "window.ini"


class WindowState:
    """Saves and restores one window's geometry and its splitter's sizes."""

    def __init__(self, database: str) -> None:
        self.path = None if database == ":memory:" else Path(database).with_name(FILE_NAME)

    def _settings(self) -> QSettings | None:
        return None if self.path is None else QSettings(str(self.path), QSettings.Format.IniFormat)

    def restore(self, window: QMainWindow, splitter: QSplitter) -> int | None:
        """Apply what was saved; returns the sidebar width the user chose (None: nothing was
        saved, the window keeps its defaults)."""
        settings = self._settings()
        if settings is None:
            return None
        geometry, sizes = settings.value("window/geometry"), settings.value("window/splitter")
        if isinstance(geometry, QByteArray):
            window.restoreGeometry(geometry)
        if isinstance(sizes, QByteArray):
            splitter.restoreState(sizes)
        width = settings.value("window/sidebar_width")
        try:
            return int(width) if width is not None else None
        except (TypeError, ValueError):  # a hand-edited file: the default width
            return None

    def save(self, window: QMainWindow, splitter: QSplitter, sidebar_width: int) -> None:
        settings = self._settings()
        if settings is None:
            return
        settings.setValue("window/geometry", window.saveGeometry())
        settings.setValue("window/splitter", splitter.saveState())
        settings.setValue("window/sidebar_width", int(sidebar_width))
        settings.sync()

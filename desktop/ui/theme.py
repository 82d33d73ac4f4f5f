"""Light and dark themes that follow the system's colour scheme unless the user picks one.

Arbor uses Qt's Fusion style with its own two palettes so that both themes look the same on every
platform; ``ThemeManager`` re-applies the palette when the system switches (``colorSchemeChanged``)
and tells widgets that draw their own colours (the chat's Markdown, the sidebar) through
``changed``.
"""

from __future__ import annotations

from typing import Literal

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from desktop.ui.markdown_render import DARK, LIGHT, Palette

ThemeChoice = Literal["system", "light", "dark"]
THEME_KEY = "theme"


def _palette(dark: bool) -> QPalette:
    p = QPalette()
    if dark:
        colors = {
            QPalette.ColorRole.Window: "#1e1f24",
            QPalette.ColorRole.WindowText: "#e6e6e6",
            QPalette.ColorRole.Base: "#25262c",
            QPalette.ColorRole.AlternateBase: "#2c2d34",
            QPalette.ColorRole.ToolTipBase: "#2c2d34",
            QPalette.ColorRole.ToolTipText: "#e6e6e6",
            QPalette.ColorRole.PlaceholderText: "#8b8f99",
            QPalette.ColorRole.Text: "#e6e6e6",
            QPalette.ColorRole.Button: "#2c2d34",
            QPalette.ColorRole.ButtonText: "#e6e6e6",
            QPalette.ColorRole.BrightText: "#ff6b6b",
            QPalette.ColorRole.Highlight: "#3d5a99",
            QPalette.ColorRole.HighlightedText: "#ffffff",
            QPalette.ColorRole.Link: "#7aa2f7",
            QPalette.ColorRole.Mid: "#3a3b42",
            QPalette.ColorRole.Midlight: "#34353c",
            QPalette.ColorRole.Dark: "#151619",
        }
    else:
        colors = {
            QPalette.ColorRole.Window: "#f6f6f7",
            QPalette.ColorRole.WindowText: "#1f2328",
            QPalette.ColorRole.Base: "#ffffff",
            QPalette.ColorRole.AlternateBase: "#f0f1f3",
            QPalette.ColorRole.ToolTipBase: "#ffffff",
            QPalette.ColorRole.ToolTipText: "#1f2328",
            QPalette.ColorRole.PlaceholderText: "#8b8f99",
            QPalette.ColorRole.Text: "#1f2328",
            QPalette.ColorRole.Button: "#eceef1",
            QPalette.ColorRole.ButtonText: "#1f2328",
            QPalette.ColorRole.BrightText: "#d1242f",
            QPalette.ColorRole.Highlight: "#cfe0ff",
            QPalette.ColorRole.HighlightedText: "#0b1f44",
            QPalette.ColorRole.Link: "#2563eb",
            QPalette.ColorRole.Mid: "#d0d3d8",
            QPalette.ColorRole.Midlight: "#e3e5e8",
            QPalette.ColorRole.Dark: "#a0a4ab",
        }
    for role, value in colors.items():
        p.setColor(role, QColor(value))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6b6f78" if dark else "#a0a4ab"))
    return p


def system_prefers_dark() -> bool:
    hints = QGuiApplication.styleHints()
    return hints.colorScheme() == Qt.ColorScheme.Dark


class ThemeManager(QObject):
    """Applies the chosen theme to the application; ``changed(dark)`` after every switch."""

    changed = Signal(bool)

    def __init__(self, app: QApplication, choice: ThemeChoice = "system") -> None:
        super().__init__(app)
        self._app = app
        self.choice: ThemeChoice = choice
        self.dark = False
        app.setStyle("Fusion")
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_system_changed)
        self.apply(choice)

    def apply(self, choice: ThemeChoice) -> None:
        self.choice = choice
        dark = system_prefers_dark() if choice == "system" else choice == "dark"
        self.dark = dark
        self._app.setPalette(_palette(dark))
        self.changed.emit(dark)

    @property
    def markdown_palette(self) -> Palette:
        return DARK if self.dark else LIGHT

    def _on_system_changed(self, _scheme) -> None:
        if self.choice == "system":
            self.apply("system")

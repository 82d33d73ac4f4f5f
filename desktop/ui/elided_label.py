"""A one-line label that fits any width: it draws its text cut with "…" when there is not room
for all of it, and shows the whole text in its tooltip then.

A plain ``QLabel`` asks its layout for the width of its whole text as its minimum, so one long
line (a model name, a failure reason) widens everything around it; this one asks for a few
characters and gives back the rest.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFontMetricsF, QPainter
from PySide6.QtWidgets import QLabel, QSizePolicy, QStyleOption, QWidget

MIN_CHARS = 4  # the narrowest it gets: a few characters and the ellipsis


class ElidedLabel(QLabel):
    """``text()`` is always the whole text; what is drawn is cut to the label's width."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self._tooltip = ""  # a tooltip set by the caller (shown whole or not)

    def setText(self, text: str) -> None:  # noqa: N802 - Qt override
        if text == self.text():
            return  # (no relayout of the window for nothing)
        super().setText(text)
        self._update_tooltip()
        self.updateGeometry()

    def setToolTip(self, text: str) -> None:  # noqa: N802 - Qt override
        self._tooltip = text
        self._update_tooltip()

    def text_width(self) -> int:
        """The whole text's width in pixels, rounded up (integer metrics round fractions away,
        and a label sized to them would cut its last letter)."""
        return math.ceil(QFontMetricsF(self.font()).horizontalAdvance(self.text()))

    @property
    def elided(self) -> bool:
        """Whether the text is cut at the current width."""
        return self.text_width() > self.contentsRect().width()

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        metrics = self.fontMetrics()
        width = min(self.text_width(), metrics.horizontalAdvance("M" * MIN_CHARS + "…"))
        margins = self.contentsMargins()
        return QSize(width + margins.left() + margins.right(), super().minimumSizeHint().height())

    def sizeHint(self) -> QSize:  # noqa: N802
        margins = self.contentsMargins()
        width = self.text_width() + margins.left() + margins.right()
        return QSize(width, super().sizeHint().height())

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._update_tooltip()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        option = QStyleOption()
        option.initFrom(self)
        rect = self.contentsRect()
        shown = self.text() if not self.elided else \
            self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, rect.width())
        self.style().drawItemText(painter, rect, int(self.alignment() | Qt.AlignmentFlag.AlignVCenter),
                                  option.palette, self.isEnabled(), shown, self.foregroundRole())

    def _update_tooltip(self) -> None:
        """The caller's tooltip, else the whole text while it is cut."""
        super().setToolTip(self._tooltip or (self.text() if self.elided else ""))


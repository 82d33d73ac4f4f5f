"""A widget that shows Markdown and stays cheap to update while a reply streams.

A finished message is one read-only ``QTextBrowser`` with the whole text. While a reply streams,
its text is split into top-level blocks (``split_blocks``) and each block gets its own browser:
an update re-renders only the blocks that changed - normally just the last one - so the cost of
an update does not grow with the length of the reply. When the reply ends the blocks are merged
back into one browser (so selection spans the whole message).
"""

from __future__ import annotations

import math
import re

from PySide6.QtCore import QSize, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QPalette
from PySide6.QtWidgets import QFrame, QSizePolicy, QTextBrowser, QVBoxLayout, QWidget

from desktop.ui.markdown_render import COPY_SCHEME, MarkdownRenderer, Rendered

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def split_blocks(text: str) -> list[str]:
    """Split Markdown at blank lines that are outside fenced code and not followed by an
    indented line (which would continue a list item or an indented block). Joining the blocks
    gives back ``text``."""
    blocks: list[str] = []
    lines = text.splitlines(keepends=True)
    current: list[str] = []
    fence: str | None = None
    for index, line in enumerate(lines):
        current.append(line)
        match = _FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence) and not line.strip()[len(marker):].strip():
                fence = None
            continue
        if fence is None and not line.strip():
            following = next((ln for ln in lines[index + 1:] if ln.strip()), None)
            if following is not None and not following.startswith((" ", "\t")):
                blocks.append("".join(current))
                current = []
    if current:
        blocks.append("".join(current))
    return blocks


class AutoHeightBrowser(QTextBrowser):
    """A read-only rich-text view as tall as its document (no inner scrollbar), which handles
    the ``arbor-copy:`` links of its code blocks."""

    copy_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.rendered = Rendered("", ())
        self.source_text = ""
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setOpenLinks(False)
        self.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextBrowserInteraction | Qt.TextInteractionFlag.TextSelectableByKeyboard
        )
        self.viewport().setAutoFillBackground(False)  # the message's own background shows through
        self.setAutoFillBackground(False)
        self.document().setDocumentMargin(2)
        self.anchorClicked.connect(self._on_anchor)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)

    def show_rendered(self, source: str, rendered: Rendered) -> None:
        self.source_text = source
        self.rendered = rendered
        self.setHtml(rendered.html)
        self._fit()

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self.document().setTextWidth(self.viewport().width())
        self._fit()

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(super().sizeHint().width(), self.height())

    def wheelEvent(self, event) -> None:  # noqa: N802 - let the chat's scroll area scroll
        event.ignore()

    def _fit(self, *_args) -> None:
        height = math.ceil(self.document().size().height()) + 2 * self.frameWidth()
        if height != self.height():
            self.setFixedHeight(max(height, 8))

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == COPY_SCHEME:
            try:
                code = self.rendered.code_blocks[int(url.path())]
            except (ValueError, IndexError):
                return
            QGuiApplication.clipboard().setText(code)
            self.copy_requested.emit(code)
        elif url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)


class MarkdownView(QWidget):
    """Shows one message's Markdown (see the module docstring)."""

    copy_requested = Signal(str)

    def __init__(self, renderer: MarkdownRenderer, parent: QWidget | None = None, *, muted: bool = False) -> None:
        super().__init__(parent)
        self._renderer = renderer
        self._muted = muted  # secondary text (reasoning): drawn in the palette's placeholder colour
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(0)
        self._browsers: list[AutoHeightBrowser] = []
        self._text = ""
        self._streaming = False
        self.renders = 0  # how many blocks were rendered (tests and the benchmark read it)

    @property
    def text(self) -> str:
        return self._text

    @property
    def code_blocks(self) -> tuple[str, ...]:
        return tuple(code for b in self._browsers for code in b.rendered.code_blocks)

    @property
    def block_count(self) -> int:
        return len(self._browsers)

    def set_renderer(self, renderer: MarkdownRenderer) -> None:
        """Switch theme colours: everything is rendered again."""
        self._renderer = renderer
        text, streaming = self._text, self._streaming
        self._text = None  # type: ignore[assignment]  # force a full re-render
        for browser in self._browsers:
            browser.source_text = "\0"
        self.set_markdown(text, streaming=streaming)

    def set_markdown(self, text: str, *, streaming: bool = False) -> None:
        """Show ``text``; with ``streaming`` only the changed blocks are rendered again."""
        if text == self._text and streaming == self._streaming:
            return
        self._text, self._streaming = text, streaming
        blocks = split_blocks(text) if streaming else [text]
        for index, block in enumerate(blocks):
            if index < len(self._browsers):
                browser = self._browsers[index]
                if browser.source_text == block:
                    continue
            else:
                browser = AutoHeightBrowser(self)
                browser.setAccessibleName("Reasoning text" if self._muted else "Message text")
                if self._muted:
                    palette = browser.palette()
                    palette.setColor(QPalette.ColorRole.Text, palette.color(QPalette.ColorRole.PlaceholderText))
                    browser.setPalette(palette)
                browser.copy_requested.connect(self.copy_requested)
                self._layout.addWidget(browser)
                self._browsers.append(browser)
            browser.show_rendered(block, self._renderer.render(block))
            self.renders += 1
        for browser in self._browsers[len(blocks):]:
            self._layout.removeWidget(browser)
            browser.deleteLater()
        del self._browsers[len(blocks):]

    def plain_text(self) -> str:
        return "\n".join(b.toPlainText() for b in self._browsers)

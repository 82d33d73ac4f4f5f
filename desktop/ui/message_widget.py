"""One message in the chat view: text, reasoning, actions, branch navigation, statistics.

Nothing in a message sets its width: names and status notes are one line cut with "…" (the
whole text in the tooltip), a failure's reason and the statistics wrap, so every action stays
reachable however narrow the chat column is."""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QPainter, QPalette, QPen, QShortcut
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from desktop.reasoning import split_reasoning
from desktop.store import PathItem
from desktop.ui.elided_label import ElidedLabel
from desktop.ui.markdown_render import MarkdownRenderer
from desktop.ui.markdown_view import MarkdownView
from desktop.ui.stats_line import format_stats, stats_tooltip  # noqa: F401 (format_stats re-exported)

STATUS_NOTES = {
    "cancelled": "stopped",
    "interrupted": "interrupted (Arbor closed while this reply was written)",
    "error": "failed",
}
#: Reply states Continue can write on from (a reply that ended early, with text to go on from).
CONTINUABLE = ("cancelled", "interrupted")


def can_continue(message) -> bool:
    """A reply that stopped early: at its token limit, stopped by the user or by a closed app."""
    if message.role != "assistant" or not message.content.strip():
        return False
    limited = message.status == "complete" and (message.stats or {}).get("finish_reason") == "length"
    return limited or message.status in CONTINUABLE


def _small_button(text: str, accessible: str, tooltip: str) -> QToolButton:
    button = QToolButton()
    button.setText(text)
    button.setAccessibleName(accessible)
    button.setToolTip(tooltip)
    button.setAutoRaise(True)
    button.setCursor(Qt.CursorShape.PointingHandCursor)
    return button


class MessageWidget(QFrame):
    """Shows one ``PathItem``; user actions leave as signals carrying message ids."""

    copy_clicked = Signal(int)
    edit_submitted = Signal(int, str)  # message id, new text (sent as a new branch)
    regenerate_clicked = Signal(int)
    continue_clicked = Signal(int)
    sibling_requested = Signal(int)  # id of the sibling to show
    code_copied = Signal(str)

    def __init__(self, item: PathItem, renderer: MarkdownRenderer, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.item = item
        self.streaming = False
        self._renderer = renderer
        self._shown: tuple[str, str, bool] | None = None
        is_user = item.message.role == "user"
        self.setObjectName("userMessage" if is_user else "assistantMessage")
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Maximum)

        outer = QVBoxLayout(self)
        outer.setContentsMargins(12, 8, 12, 8)
        outer.setSpacing(4)

        header = QHBoxLayout()
        header.setSpacing(4)
        self.speaker = ElidedLabel()
        self.speaker.setObjectName("speaker")
        font = self.speaker.font()
        font.setBold(True)
        self.speaker.setFont(font)
        self.note = ElidedLabel()
        self.note.setObjectName("statusNote")
        self.note.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        header.addWidget(self.speaker)
        header.addWidget(self.note)
        header.addStretch(1)  # the actions stay together at the right
        self.previous_button = _small_button("‹", "Previous version", "Show the previous version")
        self.branch_label = QLabel()
        self.branch_label.setAccessibleName("Version")
        self.next_button = _small_button("›", "Next version", "Show the next version")
        self.copy_button = _small_button("Copy", "Copy message", "Copy this message")
        self.edit_button = _small_button("Edit", "Edit message", "Edit and send as a new branch")
        self.regenerate_button = _small_button("Regenerate", "Regenerate reply", "Write another reply (Ctrl+R)")
        for widget in (self.previous_button, self.branch_label, self.next_button, self.copy_button,
                       self.edit_button, self.regenerate_button):
            header.addWidget(widget)
        outer.addLayout(header)

        self._outer = outer
        self.reasoning_toggle: QToolButton | None = None  # created for replies that reason
        self.reasoning_view: MarkdownView | None = None
        self.body = MarkdownView(renderer)
        self.body.copy_requested.connect(self.code_copied)
        outer.addWidget(self.body)
        self.editor: QPlainTextEdit | None = None  # created on the first edit
        self.editor_buttons: QWidget | None = None

        # Why a reply failed or what it waits for, in full (the note above is one cut line).
        self.detail = QLabel()
        self.detail.setObjectName("detail")
        self.detail.setWordWrap(True)
        self.detail.setAccessibleName("Reply details")
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.detail.hide()
        outer.addWidget(self.detail)

        # A reply that ended early: say so, and offer to write on.
        footer = QHBoxLayout()
        footer.setSpacing(6)
        self.limit_label = QLabel("Reached the reply's token limit")
        self.limit_label.setObjectName("limitNote")
        self.limit_label.setWordWrap(True)
        self.limit_label.setAccessibleName("Why the reply ended")
        self.continue_button = _small_button("Continue", "Continue reply", "Write on from where this reply stopped")
        footer.addWidget(self.limit_label, 1)
        footer.addWidget(self.continue_button)
        outer.addLayout(footer)

        self.stats_label = QLabel()
        self.stats_label.setObjectName("stats")
        self.stats_label.setWordWrap(True)
        self.stats_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.stats_label.setAccessibleName("Reply statistics")
        self.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        outer.addWidget(self.stats_label)
        self.last = False  # the last message shown (only it may be continued)
        self.waiting = ""  # what a queued reply waits for ("" when it is not queued)

        self.previous_button.clicked.connect(lambda: self._step_sibling(-1))
        self.next_button.clicked.connect(lambda: self._step_sibling(+1))
        self.copy_button.clicked.connect(self._copy)
        self.edit_button.clicked.connect(self.begin_edit)
        self.regenerate_button.clicked.connect(lambda: self.regenerate_clicked.emit(self.item.message.id))
        self.continue_button.clicked.connect(lambda: self.continue_clicked.emit(self.item.message.id))
        self.update_item(item, streaming=False, force=True)

    # -- state -----------------------------------------------------------------------------------

    @property
    def message_id(self) -> int:
        return self.item.message.id

    def update_item(self, item: PathItem, *, streaming: bool, force: bool = False) -> None:
        """Show ``item`` (the same message with new text or siblings, or another message)."""
        self.item = item
        self.streaming = streaming
        message = item.message
        is_user = message.role == "user"
        self.speaker.setText("You" if is_user else (message.model or "Assistant"))
        detail = ""
        if streaming and self.waiting:
            note, detail = "queued", self.waiting
        elif streaming:
            note = "writing…"
        else:
            note = STATUS_NOTES.get(message.status, "")
        if message.status == "error" and message.error and not streaming:
            note, detail = f"failed: {message.error}", message.error
        if message.problems:  # parts of the stored message that could not be read, one line
            note = "; ".join(filter(None, (note, *message.problems)))
        self.note.setText(note)
        self.note.setVisible(bool(note))
        self.detail.setText(detail)
        self.detail.setVisible(bool(detail))
        count, index = item.sibling_count, item.sibling_index
        for widget in (self.previous_button, self.branch_label, self.next_button):
            widget.setVisible(count > 1)
        self.branch_label.setText(f"{index + 1}/{count}")
        self.previous_button.setEnabled(index > 0)
        self.next_button.setEnabled(index < count - 1)
        self.edit_button.setVisible(is_user)
        self.regenerate_button.setVisible(not is_user)
        # A reply whose question is missing (a repaired link, see desktop.store.tree) has nothing to answer.
        self.regenerate_button.setEnabled(not streaming and message.parent_id is not None)
        self.edit_button.setEnabled(not streaming)
        shown = (message.content, message.role, streaming)
        if force or shown != self._shown:
            self._shown = shown
            self._show_text(message.content, is_user, streaming)
        self._show_ending()
        self.stats_label.setText(format_stats(message.stats) if not is_user else "")
        self.stats_label.setToolTip(stats_tooltip(message.stats) if not is_user else "")
        self.stats_label.setVisible(not is_user and bool(message.stats))

    def set_last(self, last: bool) -> None:
        """Whether this is the last message shown (a reply there may be continued)."""
        if last != self.last:
            self.last = last
            self._show_ending()

    def set_waiting(self, waiting: str) -> None:
        """What this queued reply waits for ("" once it runs or ends)."""
        if waiting != self.waiting:
            self.waiting = waiting
            self.update_item(self.item, streaming=self.streaming)

    def detail_text(self) -> str:
        return self.detail.text()

    def _show_ending(self) -> None:
        """The "token limit" note and Continue, for a reply that ended early."""
        message = self.item.message
        limited = (message.stats or {}).get("finish_reason") == "length" and message.status == "complete"
        self.limit_label.setVisible(limited and not self.streaming)
        self.continue_button.setVisible(self.last and not self.streaming and can_continue(message))

    def _show_text(self, content: str, is_user: bool, streaming: bool) -> None:
        reasoning, answer = ("", content) if is_user else split_reasoning(content)
        has_reasoning = bool(reasoning) or (not is_user and content.lstrip().startswith(("<think>", "<thinking>", "<reasoning>")))
        if has_reasoning:
            self._ensure_reasoning()
        if self.reasoning_toggle is not None:
            self.reasoning_toggle.setVisible(has_reasoning)
            if has_reasoning:
                self.reasoning_toggle.setText("Thinking…" if streaming and not answer else "Reasoning")
                self.reasoning_view.set_markdown(reasoning, streaming=streaming)
        self.body.set_markdown(answer, streaming=streaming)
        self.body.setVisible(bool(answer) or not has_reasoning)

    def _ensure_reasoning(self) -> None:
        if self.reasoning_toggle is not None:
            return
        self.reasoning_toggle = QToolButton()
        self.reasoning_toggle.setCheckable(True)
        self.reasoning_toggle.setAutoRaise(True)
        self.reasoning_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.reasoning_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.reasoning_toggle.setAccessibleName("Show reasoning")
        self.reasoning_view = MarkdownView(self._renderer, muted=True)
        self.reasoning_view.setObjectName("reasoning")
        self.reasoning_view.setContentsMargins(14, 0, 0, 0)
        self.reasoning_view.hide()
        self.reasoning_toggle.toggled.connect(self._toggle_reasoning)
        index = self._outer.indexOf(self.body)
        self._outer.insertWidget(index, self.reasoning_view)
        self._outer.insertWidget(index, self.reasoning_toggle)

    def set_renderer(self, renderer: MarkdownRenderer) -> None:
        self._renderer = renderer
        self.body.set_renderer(renderer)
        if self.reasoning_view is not None:
            self.reasoning_view.set_renderer(renderer)

    # -- actions ---------------------------------------------------------------------------------

    def _toggle_reasoning(self, shown: bool) -> None:
        self.reasoning_view.setVisible(shown)
        self.reasoning_toggle.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        self.reasoning_toggle.setAccessibleName("Hide reasoning" if shown else "Show reasoning")

    def _step_sibling(self, step: int) -> None:
        index = self.item.sibling_index + step
        if 0 <= index < len(self.item.sibling_ids):
            self.sibling_requested.emit(self.item.sibling_ids[index])

    def _copy(self) -> None:
        content = self.item.message.content
        if self.item.message.role == "assistant":
            content = split_reasoning(content)[1]
        QGuiApplication.clipboard().setText(content)
        self.copy_clicked.emit(self.item.message.id)

    def begin_edit(self) -> None:
        self._ensure_editor()
        self.editor.setPlainText(self.item.message.content)
        self.body.hide()
        self.editor.show()
        self.editor_buttons.show()
        self.editor.setFocus()

    def cancel_edit(self) -> None:
        if self.editor is None:
            return
        self.editor.hide()
        self.editor_buttons.hide()
        self.body.show()

    @property
    def editing(self) -> bool:
        return self.editor is not None and not self.editor.isHidden()

    def _ensure_editor(self) -> None:
        if self.editor is not None:
            return
        self.editor = QPlainTextEdit()
        self.editor.setAccessibleName("Edit message text")
        self.editor.setFixedHeight(110)
        self.editor_buttons = QWidget()
        row = QHBoxLayout(self.editor_buttons)
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(1)
        self.cancel_edit_button = QPushButton("Cancel")
        self.cancel_edit_button.setAccessibleName("Cancel edit")
        self.send_edit_button = QPushButton("Send as new branch")
        self.send_edit_button.setAccessibleName("Send edited message")
        self.send_edit_button.setDefault(True)
        row.addWidget(self.cancel_edit_button)
        row.addWidget(self.send_edit_button)
        index = self._outer.indexOf(self.body) + 1
        self._outer.insertWidget(index, self.editor_buttons)
        self._outer.insertWidget(index, self.editor)
        QShortcut(QKeySequence("Ctrl+Return"), self.editor, activated=self._submit_edit)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self.editor, activated=self.cancel_edit)
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        self.send_edit_button.clicked.connect(self._submit_edit)

    # -- painting --------------------------------------------------------------------------------

    def set_highlighted(self, highlighted: bool) -> None:
        """Flash a border (a search hit that was jumped to)."""
        self.setProperty("highlighted", highlighted)
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override: bubbles without stylesheets
        highlighted = bool(self.property("highlighted"))
        if self.item.message.role != "user" and not highlighted:
            return
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(self.rect()).adjusted(1, 1, -1, -1)
        palette = self.palette()
        painter.setPen(QPen(palette.color(QPalette.ColorRole.Link), 2) if highlighted else Qt.PenStyle.NoPen)
        painter.setBrush(palette.color(QPalette.ColorRole.AlternateBase) if self.item.message.role == "user"
                         else Qt.BrushStyle.NoBrush)
        painter.drawRoundedRect(rect, 12, 12)

    def _submit_edit(self) -> None:
        text = self.editor.toPlainText()
        if not text.strip():
            return
        self.cancel_edit()
        self.edit_submitted.emit(self.item.message.id, text)

"""The chat area: a scrolling column of ``MessageWidget``s bound to a ``MessagePathModel``, and
the composer underneath.

``ChatView`` is a view in the Qt sense: it never reads the store, it follows the model's row
signals (reset, insert, remove, data changed) and creates, updates or drops message widgets.
Long paths show their last ``WINDOW`` messages; scrolling near the top (or "Show earlier
messages") reveals ``REVEAL_STEP`` more above, and the messages on screen stay where they were.
Opening a chat builds its last ``FIRST_PAINT`` messages at once and the others one per turn of
the event loop, newest first, so the window never stalls for a whole chat's Markdown; asking for
the widgets (``message_widgets``, ``widget_for``) finishes the build first.
The column is exactly as wide as the view: no message sets its width (see ``MessageWidget``).
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent, QPalette
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from desktop.ui.markdown_render import MarkdownRenderer
from desktop.ui.message_path_model import MessagePathModel
from desktop.ui.message_widget import MessageWidget

WINDOW = 60
REVEAL_STEP = 40
REVEAL_MARGIN_PX = 48  # scrolled this close to the top, earlier messages are revealed
FIRST_PAINT = 2  # messages built at once when a chat opens; the rest follow one per event


class ChatView(QScrollArea):
    """See the module docstring. The streaming message (if shown) renders incrementally."""

    edit_submitted = Signal(int, str)
    regenerate_clicked = Signal(int)
    continue_clicked = Signal(int)
    sibling_requested = Signal(int)
    code_copied = Signal(str)
    message_copied = Signal(int)

    def __init__(self, model: MessagePathModel, renderer: MarkdownRenderer, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self._renderer = renderer
        self._widgets: list[MessageWidget | None] = []  # parallel to model rows; None = not shown
        self._pending: list[int] = []  # rows still to build, the next first (see the docstring)
        self._streaming_ids: set[int] = set()
        self._waiting: dict[int, str] = {}  # queued reply's message id -> what it waits for
        self._stick_to_bottom = True
        self._anchor: int | None = None  # distance from the bottom kept while earlier messages appear
        self._restoring = False
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setAccessibleName("Conversation")
        self._content = QWidget()
        self._content.setObjectName("chatContent")
        self._content.setAutoFillBackground(True)
        self._content.setBackgroundRole(QPalette.ColorRole.Base)
        self._column = QVBoxLayout(self._content)
        self._column.setContentsMargins(16, 12, 16, 12)
        self._column.setSpacing(8)
        self._earlier = QPushButton("Show earlier messages")
        self._earlier.setAccessibleName("Show earlier messages")
        self._earlier.setFlat(True)
        self._earlier.clicked.connect(self.reveal_earlier)
        self._earlier.hide()
        self._column.addWidget(self._earlier)
        self._empty = QLabel("Ask anything. Replies are generated on this computer.")
        self._empty.setObjectName("emptyState")
        self._empty.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self._empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._empty.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self._column.addWidget(self._empty)
        self._column.addStretch(1)
        self.setWidget(self._content)
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._remember_position)
        bar.rangeChanged.connect(self._follow_bottom)
        model.modelReset.connect(self._rebuild)
        model.rowsInserted.connect(self._on_rows_inserted)
        model.rowsRemoved.connect(self._on_rows_removed)
        model.dataChanged.connect(self._on_data_changed)
        self._rebuild()

    # -- queries ---------------------------------------------------------------------------------

    def widget_for(self, message_id: int) -> MessageWidget | None:
        self._flush()
        return next((w for w in self._widgets if w is not None and w.message_id == message_id), None)

    def message_widgets(self) -> list[MessageWidget]:
        self._flush()
        return self._built()

    def _built(self) -> list[MessageWidget]:
        return [w for w in self._widgets if w is not None]

    def _hidden(self) -> list[int]:
        """Rows not shown and not about to be: revealed by scrolling up."""
        return [row for row, w in enumerate(self._widgets) if w is None and row not in self._pending]

    # -- control ---------------------------------------------------------------------------------

    def set_streaming(self, message_ids: set[int]) -> None:
        """Which messages are being written (they render incrementally and show "writing…")."""
        changed = message_ids ^ self._streaming_ids
        self._streaming_ids = set(message_ids)
        for row, widget in enumerate(self._widgets):
            if widget is not None and widget.message_id in changed:
                widget.update_item(self.model.item(row), streaming=widget.message_id in self._streaming_ids)

    def set_waiting(self, waiting: dict[int, str]) -> None:
        """Queued replies (message id -> what each waits for); they show "queued" and why."""
        self._waiting = dict(waiting)
        for widget in self._built():
            widget.set_waiting(self._waiting.get(widget.message_id, ""))

    def set_renderer(self, renderer: MarkdownRenderer) -> None:
        self._renderer = renderer
        for widget in self._built():
            widget.set_renderer(renderer)

    def scroll_to_message(self, message_id: int) -> None:
        """Bring a message into view (revealing earlier messages if needed) and flash it."""
        row = self.model.row_of(message_id)
        if row is None:
            return
        self._flush()
        while self._widgets[row] is None:
            self.reveal_earlier()
        widget = self._widgets[row]
        self._stick_to_bottom = False
        self._content.adjustSize()
        QTimer.singleShot(0, lambda: self.ensureWidgetVisible(widget, 0, 40))
        widget.set_highlighted(True)
        QTimer.singleShot(1500, lambda: self._unhighlight(widget))

    def scroll_to_bottom(self) -> None:
        self._stick_to_bottom = True
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def reveal_earlier(self) -> None:
        """Show up to ``REVEAL_STEP`` more messages above; what is on screen stays in place."""
        self._flush()
        hidden = self._hidden()
        if not hidden:
            return
        bar = self.verticalScrollBar()
        self._anchor = bar.maximum() - bar.value()
        self._stick_to_bottom = False
        for row in reversed(hidden[-REVEAL_STEP:]):
            self._materialize(row)
        self._earlier.setVisible(any(w is None for w in self._widgets))

    # -- model signals ---------------------------------------------------------------------------

    def _rebuild(self) -> None:
        for widget in self._built():
            self._column.removeWidget(widget)
            widget.deleteLater()
        self._widgets = [None] * self.model.rowCount()
        first = max(0, len(self._widgets) - WINDOW)
        rows = list(range(len(self._widgets) - 1, first - 1, -1))  # newest first
        self._pending = rows[FIRST_PAINT:]
        for row in rows[:FIRST_PAINT]:
            self._materialize(row)
        if self._pending:
            QTimer.singleShot(0, self, self._build_next)
        self._earlier.setVisible(first > 0)
        self._empty.setVisible(not self._widgets)
        self._stick_to_bottom = True
        self._anchor = None
        self._mark_last()

    def _on_rows_inserted(self, parent: QModelIndex, first: int, last: int) -> None:
        self._flush()
        for row in range(first, last + 1):
            self._widgets.insert(row, None)
            self._materialize(row)
        self._empty.setVisible(False)
        self._stick_to_bottom = True
        self._anchor = None
        self._mark_last()

    def _on_rows_removed(self, parent: QModelIndex, first: int, last: int) -> None:
        self._flush()
        for widget in self._widgets[first:last + 1]:
            if widget is not None:
                self._column.removeWidget(widget)
                widget.deleteLater()
        del self._widgets[first:last + 1]
        self._empty.setVisible(not self._widgets)
        self._mark_last()

    def _on_data_changed(self, top_left: QModelIndex, bottom_right: QModelIndex, roles=()) -> None:
        for row in range(top_left.row(), bottom_right.row() + 1):
            widget = self._widgets[row] if row < len(self._widgets) else None
            if widget is not None:
                item = self.model.item(row)
                widget.update_item(item, streaming=item.message.id in self._streaming_ids)

    # -- helpers ---------------------------------------------------------------------------------

    def _materialize(self, row: int) -> None:
        item = self.model.item(row)
        widget = MessageWidget(item, self._renderer)
        widget.waiting = self._waiting.get(item.message.id, "")
        if item.message.id in self._streaming_ids:
            widget.update_item(item, streaming=True)
        widget.edit_submitted.connect(self.edit_submitted)
        widget.regenerate_clicked.connect(self.regenerate_clicked)
        widget.continue_clicked.connect(self.continue_clicked)
        widget.sibling_requested.connect(self.sibling_requested)
        widget.code_copied.connect(self.code_copied)
        widget.copy_clicked.connect(self.message_copied)
        # Layout position: after the "earlier" button, before the empty label and the stretch.
        shown_before = sum(1 for w in self._widgets[:row] if w is not None)
        self._column.insertWidget(1 + shown_before, widget)
        self._widgets[row] = widget

    def _build_next(self) -> None:
        """One more message of the chat being opened (the newest not built yet)."""
        if self._pending:
            self._materialize(self._pending.pop(0))
        if self._pending:
            QTimer.singleShot(0, self, self._build_next)

    def _flush(self) -> None:
        """Build what the chat being opened still lacks, now."""
        while self._pending:
            self._materialize(self._pending.pop(0))

    def _mark_last(self) -> None:
        shown = self._built()
        for widget in shown:
            widget.set_last(widget is shown[-1])

    def _remember_position(self, value: int) -> None:
        if self._restoring:
            return
        bar = self.verticalScrollBar()
        self._anchor = None  # the user scrolled: nothing is held in place any more
        self._stick_to_bottom = value >= bar.maximum() - 24
        if value <= REVEAL_MARGIN_PX and bar.maximum() > 0 and not self._pending and self._hidden():
            QTimer.singleShot(0, self.reveal_earlier)

    def _follow_bottom(self, _minimum: int, maximum: int) -> None:
        bar = self.verticalScrollBar()
        if self._anchor is not None:  # earlier messages appeared above: keep the view still
            target = maximum - self._anchor
        elif self._stick_to_bottom:
            target = maximum
        else:
            return
        self._restoring = True
        try:
            bar.setValue(target)
        finally:
            self._restoring = False

    @staticmethod
    def _unhighlight(widget: MessageWidget) -> None:
        try:
            widget.set_highlighted(False)
        except RuntimeError:  # the widget was deleted meanwhile
            pass


class MessageInput(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt override
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & (Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.AltModifier)
        ):
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class Composer(QFrame):
    """The message box with Send / Stop."""

    send_requested = Signal(str)
    stop_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        self.setAutoFillBackground(True)
        self.setBackgroundRole(QPalette.ColorRole.Base)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 12)
        self.input = MessageInput()
        self.input.setPlaceholderText("Message Arbor…  (Enter to send, Shift+Enter for a new line)")
        self.input.setAccessibleName("Message input")
        self.input.setFixedHeight(84)
        self.send_button = QPushButton("Send")
        self.send_button.setAccessibleName("Send message")
        self.send_button.setToolTip("Send (Enter)")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop generating")
        self.stop_button.setToolTip("Stop generating (Esc or Ctrl+.)")
        self.stop_button.hide()
        layout.addWidget(self.input, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        layout.addLayout(buttons)
        self.input.submitted.connect(self._send)
        self.send_button.clicked.connect(self._send)
        self.stop_button.clicked.connect(self.stop_requested)

    def set_generating(self, generating: bool) -> None:
        """Swap Send for Stop while the shown conversation has a reply in progress."""
        self.send_button.setVisible(not generating)
        self.stop_button.setVisible(generating)

    @property
    def generating(self) -> bool:
        return not self.stop_button.isHidden()

    def _send(self) -> None:
        if self.generating:
            return
        text = self.input.toPlainText()
        if not text.strip():
            return
        self.input.clear()
        self.send_requested.emit(text)

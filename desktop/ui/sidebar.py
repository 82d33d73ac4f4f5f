"""The sidebar: new chat, search, the conversation list (grouped by date), undo after delete.

Typing in the search box shows full-text results (titles and messages) instead of the list;
activating a result asks the window to open that conversation at that message. The list view is
fed by ``ConversationListModel`` (lazy pages through ``canFetchMore``/``fetchMore``).
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QModelIndex, QRect, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QColor, QFont, QFontMetrics, QPainter, QPalette, QPen
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListView,
    QMenu,
    QPushButton,
    QStackedWidget,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

from desktop.store import HIT_END, HIT_START, SearchHit
from desktop.ui.conversation_list_model import (
    ACTIVITY_WORDS,
    ActivityRole,
    ConversationIdRole,
    ConversationListModel,
    IsHeaderRole,
    PinnedRole,
    WarmRole,
)
from desktop.ui.simple_models import HitRole, SearchResultsModel

SEARCH_DEBOUNCE_MS = 120
UNDO_SECONDS = 10


class ConversationDelegate(QStyledItemDelegate):
    """Draws group headers (small, muted) and conversations (title, pin mark, warm badge, and
    what the model does for it: writing, queued, warming up)."""

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:  # noqa: N802
        height = option.fontMetrics.height()
        return QSize(1, height + (14 if index.data(IsHeaderRole) else 12))

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        painter.save()
        rect: QRect = option.rect
        palette: QPalette = option.palette
        if index.data(IsHeaderRole):
            font = QFont(option.font)
            font.setPointSizeF(max(font.pointSizeF() * 0.85, 7.0))
            font.setBold(True)
            painter.setFont(font)
            painter.setPen(palette.color(QPalette.ColorRole.PlaceholderText))
            painter.drawText(rect.adjusted(10, 6, -8, 0), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                             str(index.data()))
            painter.restore()
            return
        if option.state & QStyle.StateFlag.State_Selected:
            painter.setBrush(palette.color(QPalette.ColorRole.Highlight))
            painter.setPen(Qt.PenStyle.NoPen)
            painter.drawRoundedRect(rect.adjusted(4, 1, -4, -1), 6, 6)
            text_color = palette.color(QPalette.ColorRole.HighlightedText)
        elif option.state & QStyle.StateFlag.State_MouseOver:
            painter.setBrush(palette.color(QPalette.ColorRole.AlternateBase))
            painter.setPen(Qt.PenStyle.NoPen)
            painter.drawRoundedRect(rect.adjusted(4, 1, -4, -1), 6, 6)
            text_color = palette.color(QPalette.ColorRole.Text)
        else:
            text_color = palette.color(QPalette.ColorRole.Text)
        right = rect.right() - 10
        if index.data(WarmRole):
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(QColor("#f59e0b"))
            diameter = 7
            painter.drawEllipse(right - diameter, rect.center().y() - diameter // 2, diameter, diameter)
            right -= diameter + 6
        if index.data(PinnedRole):
            right = _paint_pin(painter, right, rect.center().y(), palette.color(QPalette.ColorRole.PlaceholderText)) - 6
        activity = index.data(ActivityRole)
        if activity:
            small = QFont(option.font)
            small.setPointSizeF(max(small.pointSizeF() * 0.85, 7.0))
            small.setItalic(True)
            words = ACTIVITY_WORDS[activity]
            width = QFontMetrics(small).horizontalAdvance(words)
            painter.setFont(small)
            painter.setPen(text_color if activity == "generating" else palette.color(QPalette.ColorRole.PlaceholderText))
            painter.drawText(QRect(right - width, rect.top(), width, rect.height()),
                             Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight, words)
            right -= width + 6
        painter.setPen(text_color)
        painter.setFont(option.font)
        text_rect = QRect(rect.left() + 12, rect.top(), right - rect.left() - 14, rect.height())
        title = option.fontMetrics.elidedText(str(index.data()), Qt.TextElideMode.ElideRight, text_rect.width())
        painter.drawText(text_rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, title)
        painter.restore()


class SearchHitDelegate(QStyledItemDelegate):
    """Two lines per hit: the conversation title, then the matching snippet."""

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:  # noqa: N802
        hit: SearchHit = index.data(HitRole)
        lines = 1 if hit.message_id is None else 2
        return QSize(1, option.fontMetrics.height() * lines + 12)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        hit: SearchHit = index.data(HitRole)
        painter.save()
        rect = option.rect.adjusted(4, 1, -4, -1)
        palette = option.palette
        if option.state & QStyle.StateFlag.State_Selected:
            painter.setBrush(palette.color(QPalette.ColorRole.Highlight))
            painter.setPen(Qt.PenStyle.NoPen)
            painter.drawRoundedRect(rect, 6, 6)
        line = option.fontMetrics.height()
        inner = rect.adjusted(8, 5, -8, -5)
        bold = QFont(option.font)
        bold.setBold(True)
        painter.setFont(bold)
        painter.setPen(palette.color(QPalette.ColorRole.Text))
        painter.drawText(QRect(inner.left(), inner.top(), inner.width(), line), Qt.AlignmentFlag.AlignLeft,
                         option.fontMetrics.elidedText(hit.title, Qt.TextElideMode.ElideRight, inner.width()))
        if hit.message_id is not None:
            _paint_snippet(painter, option.font, hit.snippet, QRect(inner.left(), inner.top() + line, inner.width(), line),
                           palette.color(QPalette.ColorRole.PlaceholderText), palette.color(QPalette.ColorRole.Text))
        painter.restore()


def _paint_pin(painter: QPainter, right: int, center_y: int, color: QColor) -> int:
    """A small push-pin (head and needle) ending at ``right``; returns its left edge."""
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(color)
    painter.drawEllipse(right - 8, center_y - 6, 7, 7)
    painter.setPen(QPen(color, 1.5))
    painter.drawLine(right - 5, center_y + 1, right - 7, center_y + 6)
    return right - 9


def _paint_snippet(painter: QPainter, font: QFont, snippet: str, rect: QRect, muted: QColor, strong: QColor) -> None:
    """The snippet on one line, matched words bold (between ``HIT_START``/``HIT_END``), elided."""
    bold = QFont(font)
    bold.setBold(True)
    x = rect.left()
    parts = snippet.replace("\n", " ").replace(HIT_END, HIT_START).split(HIT_START)
    for number, part in enumerate(parts):
        matched = number % 2 == 1
        painter.setFont(bold if matched else font)
        painter.setPen(strong if matched else muted)
        metrics = QFontMetrics(bold if matched else font)
        room = rect.right() - x
        if room <= 0:
            break
        text = metrics.elidedText(part, Qt.TextElideMode.ElideRight, room)
        painter.drawText(QRect(x, rect.top(), room, rect.height()), Qt.AlignmentFlag.AlignLeft, text)
        if text != part:
            break
        x += metrics.horizontalAdvance(part)


class Sidebar(QFrame):
    """See the module docstring. Emits intents; the window does the work."""

    conversation_activated = Signal(int)
    hit_activated = Signal(object)  # SearchHit
    search_changed = Signal(str)
    new_chat_requested = Signal()
    rename_requested = Signal(int)
    delete_requested = Signal(int)
    pin_toggled = Signal(int)
    export_requested = Signal(int)
    undo_requested = Signal()

    def __init__(self, model: ConversationListModel, results: SearchResultsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("sidebar")
        self.setAutoFillBackground(True)
        self.setBackgroundRole(QPalette.ColorRole.Window)
        self.model = model
        self.results = results
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 4, 8)
        layout.setSpacing(6)

        self.new_chat_button = QPushButton("New chat")
        self.new_chat_button.setAccessibleName("New chat")
        self.new_chat_button.setToolTip("New chat (Ctrl+N)")
        self.new_chat_button.clicked.connect(self.new_chat_requested)
        layout.addWidget(self.new_chat_button)

        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats  (Ctrl+K)")
        self.search.setAccessibleName("Search conversations")
        self.search.setClearButtonEnabled(True)
        layout.addWidget(self.search)
        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(SEARCH_DEBOUNCE_MS)
        self._debounce.timeout.connect(lambda: self.search_changed.emit(self.search.text()))
        self.search.textChanged.connect(self._on_search_text)
        self.search.installEventFilter(self)

        self.stack = QStackedWidget()
        self.list_view = QListView()
        self.list_view.setAccessibleName("Conversations")
        self.list_view.setModel(model)
        self.list_view.setItemDelegate(ConversationDelegate(self.list_view))
        self.list_view.setUniformItemSizes(False)
        self.list_view.setFrameShape(QFrame.Shape.NoFrame)
        self.list_view.setMouseTracking(True)
        self.list_view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.list_view.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list_view.customContextMenuRequested.connect(self._context_menu)
        self.list_view.selectionModel().currentChanged.connect(self._on_current_changed)
        self.list_view.installEventFilter(self)
        self.list_view.viewport().setBackgroundRole(QPalette.ColorRole.Window)
        # Titles are cut to the sidebar's width (see the delegates): never a sideways scroll.
        self.list_view.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.results_view = QListView()
        self.results_view.setAccessibleName("Search results")
        self.results_view.setModel(results)
        self.results_view.setItemDelegate(SearchHitDelegate(self.results_view))
        self.results_view.setFrameShape(QFrame.Shape.NoFrame)
        self.results_view.viewport().setBackgroundRole(QPalette.ColorRole.Window)
        self.results_view.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.results_view.activated.connect(self._on_hit_activated)
        self.results_view.clicked.connect(self._on_hit_activated)
        self.no_results = QLabel("No matches")
        self.no_results.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.stack.addWidget(self.list_view)
        self.stack.addWidget(self.results_view)
        self.stack.addWidget(self.no_results)
        layout.addWidget(self.stack, 1)

        self.undo_banner = QFrame()
        self.undo_banner.setObjectName("undoBanner")
        self.undo_banner.setAutoFillBackground(True)
        self.undo_banner.setBackgroundRole(QPalette.ColorRole.ToolTipBase)
        banner = QHBoxLayout(self.undo_banner)
        banner.setContentsMargins(8, 4, 4, 4)
        self.undo_label = QLabel()
        self.undo_label.setWordWrap(True)
        self.undo_button = QPushButton("Undo")
        self.undo_button.setAccessibleName("Undo delete")
        self.undo_button.clicked.connect(self.undo_requested)
        banner.addWidget(self.undo_label, 1)
        banner.addWidget(self.undo_button)
        self.undo_banner.hide()
        self._undo_timer = QTimer(self)
        self._undo_timer.setSingleShot(True)
        self._undo_timer.timeout.connect(self.undo_banner.hide)
        layout.addWidget(self.undo_banner)

    # -- selection -------------------------------------------------------------------------------

    def select_conversation(self, conversation_id: int | None) -> None:
        """Highlight ``conversation_id`` in the list without emitting ``conversation_activated``."""
        self._suppress_activation = True
        try:
            if conversation_id is None:
                self.list_view.clearSelection()
                return
            row = self.model.ensure_loaded(conversation_id)
            if row is None:
                return
            index = self.model.index(row)
            self.list_view.setCurrentIndex(index)
            self.list_view.scrollTo(index)
        finally:
            self._suppress_activation = False

    def current_conversation_id(self) -> int | None:
        index = self.list_view.currentIndex()
        return index.data(ConversationIdRole) if index.isValid() else None

    def neighbour(self, conversation_id: int | None, step: int) -> int | None:
        """The conversation ``step`` rows away in the list (skipping headers)."""
        row = self.model.row_of(conversation_id) if conversation_id is not None else None
        ids = self.model.conversation_ids()
        if not ids:
            return None
        if row is None:
            return ids[0]
        position = ids.index(conversation_id) + step
        if position >= len(ids) and self.model.canFetchMore():
            self.model.fetchMore()
            ids = self.model.conversation_ids()
        return ids[max(0, min(position, len(ids) - 1))]

    # -- search ----------------------------------------------------------------------------------

    def focus_search(self) -> None:
        self.search.setFocus()
        self.search.selectAll()

    def show_results(self, query: str) -> None:
        """Show the results page (or the list when the query is empty)."""
        if not query.strip():
            self.stack.setCurrentWidget(self.list_view)
        elif self.results.rowCount() == 0:
            self.stack.setCurrentWidget(self.no_results)
        else:
            self.stack.setCurrentWidget(self.results_view)

    def _on_search_text(self, text: str) -> None:
        if not text.strip():
            self._debounce.stop()
            self.search_changed.emit("")
        else:
            self._debounce.start()

    def _on_hit_activated(self, index: QModelIndex) -> None:
        if index.isValid():
            self.hit_activated.emit(index.data(HitRole))

    # -- undo ------------------------------------------------------------------------------------

    def show_undo(self, title: str) -> None:
        self.undo_label.setText(f"Deleted “{title}”")
        self.undo_banner.show()
        self._undo_timer.start(UNDO_SECONDS * 1000)

    def hide_undo(self) -> None:
        self._undo_timer.stop()
        self.undo_banner.hide()

    # -- events ----------------------------------------------------------------------------------

    _suppress_activation = False

    def _on_current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if self._suppress_activation or not current.isValid():
            return
        conversation_id = current.data(ConversationIdRole)
        if conversation_id is not None:
            self.conversation_activated.emit(conversation_id)

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.KeyPress:
            if watched is self.search and event.key() == Qt.Key.Key_Escape:
                self.search.clear()
                return True
            if watched is self.search and event.key() in (Qt.Key.Key_Down, Qt.Key.Key_Return, Qt.Key.Key_Enter):
                view = self.results_view if self.stack.currentWidget() is self.results_view else None
                if view is not None and self.results.rowCount():
                    if event.key() == Qt.Key.Key_Down:
                        view.setFocus()
                        view.setCurrentIndex(self.results.index(0))
                    else:
                        self._on_hit_activated(view.currentIndex() if view.currentIndex().isValid() else self.results.index(0))
                    return True
            if watched is self.list_view:
                conversation_id = self.current_conversation_id()
                if conversation_id is not None and event.key() == Qt.Key.Key_Delete:
                    self.delete_requested.emit(conversation_id)
                    return True
                if conversation_id is not None and event.key() == Qt.Key.Key_F2:
                    self.rename_requested.emit(conversation_id)
                    return True
        return super().eventFilter(watched, event)

    def _context_menu(self, position) -> None:
        index = self.list_view.indexAt(position)
        conversation_id = index.data(ConversationIdRole) if index.isValid() else None
        if conversation_id is None:
            return
        menu = QMenu(self)
        pinned = bool(index.data(PinnedRole))
        actions = [
            ("Rename…", self.rename_requested),
            ("Unpin" if pinned else "Pin", self.pin_toggled),
            ("Export…", self.export_requested),
            ("Delete", self.delete_requested),
        ]
        for text, signal in actions:
            action = QAction(text, menu)
            action.triggered.connect(lambda _checked=False, s=signal: s.emit(conversation_id))
            menu.addAction(action)
        menu.popup(self.list_view.viewport().mapToGlobal(position))

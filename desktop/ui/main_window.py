"""Arbor's main window: sidebar | chat, menus and shortcuts, wired to the chat controller.

The window owns the item models and is the only writer of them (GUI thread). It never talks to
the engine: user intents go to ``ChatController`` (replies) or ``ModelTaskRunner`` (model
manager), and their signals come back here to update the models.

The conversation on screen is ``current_id``; ``None`` is a new, unsaved chat that becomes a
stored conversation when its first message is sent (so "New chat" never leaves empty chats).
Each chat keeps its own half-typed message (``drafts``), kept across restarts.

The chat header shows the context meter (the tokens the model will see of this chat / the
model's context) and, under it, a warning when the chat nears the context or already outgrows
it. The sidebar shows which chats are queued, generating or prefetching.
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QKeySequence, QPalette
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from backend.api import ModelInfo
from desktop import transfer
from desktop.chat_controller import AUTO_TITLE_KEY, ChatController, ContextUse
from desktop.chat_settings import CONTEXT_CHOICES, ChatSettings
from desktop.model_tasks import ModelTaskRunner
from desktop.store import PLACEHOLDER_TITLE, ChatStore, SearchHit, StoreError
from desktop.ui.chat_view import ChatView, Composer
from desktop.ui.conversation_list_model import ConversationListModel
from desktop.ui.elided_label import ElidedLabel
from desktop.ui.markdown_render import MarkdownRenderer
from desktop.ui.message_path_model import MessagePathModel
from desktop.ui.model_manager import ModelManagerDialog
from desktop.ui.settings_dialog import ChatSettingsDialog
from desktop.ui.sidebar import Sidebar
from desktop.ui.simple_models import SearchResultsModel
from desktop.ui.theme import THEME_KEY, ThemeManager
from desktop.ui.cache_dialog import CacheDialog
from desktop.window_state import WindowState
from desktop.worker import InferenceClient

log = logging.getLogger(__name__)

LAST_CONVERSATION_KEY = "last_conversation"
LAST_MODEL_KEY = "last_model"
DRAFTS_KEY = "composer_drafts"  # conversation id -> the message half typed there
SIDEBAR_MIN_WIDTH = 180
SIDEBAR_WIDTH = 280  # until the user drags the splitter
CHAT_COMFORT_WIDTH = 500  # a narrow window takes from the sidebar (down to its minimum) first
HEADER_MODEL_WIDTH = 720  # the chat column shows the model's name from this width
#: The context meter warns once a chat and its reply's room fill this share of the context.
CONTEXT_WARNING = 0.8


class MainWindow(QMainWindow):
    """See the module docstring."""

    def __init__(
        self,
        store: ChatStore,
        client: InferenceClient,
        tasks: ModelTaskRunner,
        theme: ThemeManager,
        *,
        model_ref: str | None = None,
        load_model: bool = True,
    ) -> None:
        super().__init__()
        self.setWindowTitle("Arbor")
        self.resize(1180, 780)
        self.store = store
        self.client = client
        self.tasks = tasks
        self.theme = theme
        self.controller = ChatController(store, client, self)
        self.current_id: int | None = None
        self._deleted: list[tuple[int, str]] = []
        self._model_manager: ModelManagerDialog | None = None
        self._cache_dialog: CacheDialog | None = None
        self._settings_dialog: ChatSettingsDialog | None = None
        drafts = store.app_setting(DRAFTS_KEY, {})
        self.drafts: dict[int | None, str] = {
            int(k): v for k, v in (drafts.items() if isinstance(drafts, dict) else ())
            if str(k).isdigit() and isinstance(v, str)}
        self.context_use: dict[int, ContextUse] = {}

        store.purge_deleted()  # an undo window never outlives the session that opened it
        self.conversations = ConversationListModel(store.list_conversations, store.count_conversations, parent=self)
        self.search_results = SearchResultsModel(self)
        self.path_model = MessagePathModel(self)
        self.renderer = MarkdownRenderer(theme.markdown_palette)

        self.sidebar = Sidebar(self.conversations, self.search_results)
        self.chat_view = ChatView(self.path_model, self.renderer)
        self.composer = Composer()
        self._build_layout()
        self._build_actions()
        self._connect()
        self._apply_theme(theme.dark)
        self.window_state = WindowState(store.location)
        self.sidebar_width = self.window_state.restore(self, self.splitter) or SIDEBAR_WIDTH

        QTimer.singleShot(300, self.renderer.warm_up)  # while the user reads, not while they wait
        if store.app_setting_problems:
            self.statusBar().showMessage("; ".join(store.app_setting_problems.values()))
        last = store.app_setting(LAST_CONVERSATION_KEY)
        self.open_conversation(last if isinstance(last, int) and self._exists(last) else None)
        if load_model:
            remembered = store.app_setting(LAST_MODEL_KEY)
            self.load_model(model_ref if model_ref is not None else remembered)

    # -- layout ----------------------------------------------------------------------------------

    def _build_layout(self) -> None:
        header = QWidget()
        header.setObjectName("chatHeader")
        row = QHBoxLayout(header)
        row.setContentsMargins(16, 8, 12, 4)
        row.setSpacing(12)
        self.title_label = ElidedLabel(PLACEHOLDER_TITLE)
        self.title_label.setObjectName("chatTitle")
        font = self.title_label.font()
        font.setBold(True)
        self.title_label.setFont(font)
        self.title_label.setAccessibleName("Conversation title")
        self.model_label = ElidedLabel("No model")
        self.model_label.setObjectName("modelLabel")
        self.model_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.model_label.setAccessibleName("Loaded model")
        self.context_label = ElidedLabel()
        self.context_label.setObjectName("contextMeter")
        self.context_label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.context_label.setAccessibleName("Context used")
        self.models_button = QPushButton("Models…")
        self.models_button.setAccessibleName("Open the model manager")
        self.settings_button = QPushButton("Chat settings…")
        self.settings_button.setAccessibleName("Open chat settings")
        row.addWidget(self.title_label, 1)
        row.addWidget(self.context_label)
        row.addWidget(self.model_label)
        row.addWidget(self.models_button)
        row.addWidget(self.settings_button)

        # One line naming the parts of the open chat that could not be read (see ChatStore).
        self.notice_label = QLabel()
        self.notice_label.setObjectName("chatNotice")
        self.notice_label.setContentsMargins(16, 0, 12, 4)
        self.notice_label.setAccessibleName("Problems reading this chat")
        self.notice_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.notice_label.setMinimumWidth(1)  # a long line is cut (full text in the tooltip), never widens the window
        self.notice_label.hide()
        # The chat nears or outgrows the model's context: what happens next, in one line.
        self.context_warning = ElidedLabel()
        self.context_warning.setObjectName("contextWarning")
        self.context_warning.setContentsMargins(16, 0, 12, 4)
        self.context_warning.setAccessibleName("Context warning")
        self.context_warning.hide()

        right = QWidget()
        column = QVBoxLayout(right)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(header)
        column.addWidget(self.notice_label)
        column.addWidget(self.context_warning)
        column.addWidget(self.chat_view, 1)
        column.addWidget(self.composer)

        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.sidebar)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([280, 900])
        splitter.setChildrenCollapsible(False)
        self.sidebar.setMinimumWidth(SIDEBAR_MIN_WIDTH)  # a small window narrows the chat first
        right.setMinimumWidth(360)
        self.splitter = splitter
        self.sidebar_width = SIDEBAR_WIDTH  # what the user chose; narrow windows show less
        splitter.splitterMoved.connect(lambda _pos, _index: self._remember_sidebar_width())
        self.setCentralWidget(splitter)
        self.status_label = QLabel()
        self.status_label.setAccessibleName("Status")
        self.statusBar().addPermanentWidget(self.status_label)

    def _action(self, menu, text: str, slot, shortcuts=(), accessible: str | None = None) -> QAction:
        action = QAction(text, self)
        if shortcuts:
            action.setShortcuts([QKeySequence(s) for s in shortcuts])
            action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        action.triggered.connect(lambda _checked=False: slot())
        if accessible:
            action.setToolTip(accessible)
        menu.addAction(action)
        self.addAction(action)
        return action

    def _build_actions(self) -> None:
        bar = self.menuBar()
        file = bar.addMenu("&File")
        self.new_chat_action = self._action(file, "New chat", self.new_chat, ["Ctrl+N"])
        file.addSeparator()
        self._action(file, "Import conversations…", self._import_dialog, ["Ctrl+O"])
        self._action(file, "Export chat as JSON…", lambda: self._export_dialog("json"), ["Ctrl+E"])
        self._action(file, "Export chat as Markdown…", lambda: self._export_dialog("md"), ["Ctrl+Shift+E"])
        self._action(file, "Export all chats…", self._export_all_dialog)
        file.addSeparator()
        self._action(file, "Quit", self.close, ["Ctrl+Q"])

        edit = bar.addMenu("&Edit")
        self.undo_delete_action = self._action(edit, "Undo delete", self.undo_delete, ["Ctrl+Z"])
        self.search_action = self._action(edit, "Search chats", self.sidebar.focus_search, ["Ctrl+K", "Ctrl+F"])

        chat = bar.addMenu("&Chat")
        self.stop_action = self._action(chat, "Stop", self.stop, ["Ctrl+."])  # and Esc in the message box
        self.regenerate_action = self._action(chat, "Regenerate reply", self.regenerate_last, ["Ctrl+R"])
        self._action(chat, "Focus message box", self.focus_input, ["Ctrl+L"])
        chat.addSeparator()
        self._action(chat, "Next chat", lambda: self.step_conversation(+1), ["Ctrl+PgDown", "Ctrl+Tab"])
        self._action(chat, "Previous chat", lambda: self.step_conversation(-1), ["Ctrl+PgUp", "Ctrl+Shift+Tab"])
        chat.addSeparator()
        self._action(chat, "Rename…", lambda: self.prompt_rename(self.current_id), ["F2"])
        self._action(chat, "Pin / unpin", lambda: self.toggle_pin(self.current_id), ["Ctrl+Shift+P"])
        self._action(chat, "Delete", lambda: self.delete_conversation(self.current_id), ["Ctrl+Shift+Backspace"])
        self._action(chat, "Chat settings…", self.open_chat_settings, ["Ctrl+,"])
        chat.addSeparator()
        self.model_titles_action = QAction("Let the model title new chats", self, checkable=True)
        self.model_titles_action.setToolTip("Off: a chat is titled by your first message. On: the "
                                            "model writes a title after the first reply (never "
                                            "replacing one you typed)")
        self.model_titles_action.setChecked(self.store.app_setting(AUTO_TITLE_KEY, False) is True)
        self.model_titles_action.toggled.connect(self.set_model_titles)
        chat.addAction(self.model_titles_action)

        models = bar.addMenu("&Models")
        self._action(models, "Model manager…", self.open_model_manager, ["Ctrl+Shift+M"])
        self._action(models, "Memory and cache…", self.open_cache_dialog)

        view = bar.addMenu("&View")
        theme_menu = view.addMenu("Theme")
        group = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for choice, label in (("system", "Follow system"), ("light", "Light"), ("dark", "Dark")):
            action = QAction(label, self, checkable=True)
            action.setChecked(self.theme.choice == choice)
            action.triggered.connect(lambda _checked=False, c=choice: self.set_theme(c))
            group.addAction(action)
            theme_menu.addAction(action)
            self.theme_actions[choice] = action

    def _connect(self) -> None:
        s, c = self.sidebar, self.controller
        s.conversation_activated.connect(self.open_conversation)
        s.hit_activated.connect(self.open_hit)
        s.search_changed.connect(self.run_search)
        s.new_chat_requested.connect(self.new_chat)
        s.rename_requested.connect(self.prompt_rename)
        s.delete_requested.connect(self.delete_conversation)
        s.pin_toggled.connect(self.toggle_pin)
        s.export_requested.connect(lambda cid: self._export_dialog("json", cid))
        s.undo_requested.connect(self.undo_delete)
        self.composer.send_requested.connect(self.send)
        self.composer.stop_requested.connect(self.stop)
        self.composer.input.installEventFilter(self)
        self.chat_view.edit_submitted.connect(self.edit_and_resend)
        self.chat_view.regenerate_clicked.connect(self.regenerate)
        self.chat_view.continue_clicked.connect(self.continue_reply)
        self.chat_view.sibling_requested.connect(c.select_branch)
        self.chat_view.code_copied.connect(lambda _code: self.statusBar().showMessage("Code copied", 2000))
        self.chat_view.message_copied.connect(lambda _mid: self.statusBar().showMessage("Message copied", 2000))
        self.models_button.clicked.connect(self.open_model_manager)
        self.settings_button.clicked.connect(self.open_chat_settings)
        c.tree_changed.connect(self._on_tree_changed)
        c.reply_queued.connect(self._on_reply_state)
        c.reply_started.connect(self._on_reply_state)
        c.reply_updated.connect(self._on_reply_updated)
        c.reply_ended.connect(self._on_reply_ended)
        c.conversation_changed.connect(self._on_conversation_changed)
        c.activity_changed.connect(self._on_activity_changed)
        c.context_measured.connect(self._on_context_measured)
        c.model_loading.connect(lambda label: self._set_model_status(f"Loading {label}…"))
        c.model_loaded.connect(self._on_model_loaded)
        c.model_failed.connect(self._on_model_failed)
        self.theme.changed.connect(self._apply_theme)

    # -- conversations ---------------------------------------------------------------------------

    def open_conversation(self, conversation_id: int | None) -> None:
        """Show a conversation (None: a new, unsaved chat), with its own half-typed message."""
        self._keep_draft()
        self.current_id = conversation_id
        self.composer.input.setPlainText(self.drafts.get(conversation_id, ""))
        self.composer.input.moveCursor(self.composer.input.textCursor().MoveOperation.End)
        self._show_context()
        if conversation_id is None:
            self.path_model.set_path(None, [])
            self.title_label.setText(PLACEHOLDER_TITLE)
            self.sidebar.select_conversation(None)
        else:
            self._show_path()
            self.title_label.setText(self.store.conversation(conversation_id).title)
            self.sidebar.select_conversation(conversation_id)
            self.store.set_app_setting(LAST_CONVERSATION_KEY, conversation_id)
            self.controller.measure_context(conversation_id)  # before the prefetch: it may set the cut
            self.controller.prefetch(conversation_id)
        self._show_notice()
        self.chat_view.scroll_to_bottom()
        self._update_composer()

    def new_chat(self) -> None:
        self.open_conversation(None)
        self.focus_input()

    def step_conversation(self, step: int) -> None:
        target = self.sidebar.neighbour(self.current_id, step)
        if target is not None and target != self.current_id:
            self.open_conversation(target)

    def prompt_rename(self, conversation_id: int | None) -> None:
        if conversation_id is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=self.store.conversation(conversation_id).title)
        if ok:
            self.rename_conversation(conversation_id, title)

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title)
        self._on_conversation_changed(conversation_id)

    def toggle_pin(self, conversation_id: int | None) -> None:
        if conversation_id is None:
            return
        self.store.set_pinned(conversation_id, not self.store.conversation(conversation_id).pinned)
        self._on_conversation_changed(conversation_id)

    def delete_conversation(self, conversation_id: int | None) -> None:
        """Delete (undoable until the app closes); a reply streaming there is stopped first."""
        if conversation_id is None:
            return
        self.controller.stop(conversation_id)
        title = self.store.conversation(conversation_id).title
        neighbour = self.sidebar.neighbour(conversation_id, +1)
        if neighbour == conversation_id:
            neighbour = self.sidebar.neighbour(conversation_id, -1)
        self.store.delete(conversation_id)
        self._deleted.append((conversation_id, title))
        self.conversations.refresh()
        self.sidebar.show_undo(title)
        if conversation_id == self.current_id:
            self.open_conversation(neighbour if neighbour != conversation_id else None)
        self._refresh_search()

    def undo_delete(self) -> None:
        if not self._deleted:
            return
        conversation_id, _title = self._deleted.pop()
        self.store.restore(conversation_id)
        self.conversations.refresh()
        self.sidebar.hide_undo()
        self.open_conversation(conversation_id)
        self._refresh_search()

    # -- search ----------------------------------------------------------------------------------

    def run_search(self, text: str) -> None:
        self.search_results.set_hits(text, self.store.search(text) if text.strip() else [])
        self.sidebar.show_results(text)

    def open_hit(self, hit: SearchHit) -> None:
        """Open the conversation of a search hit; for a message hit, show the branch through it
        and scroll to it."""
        if hit.message_id is not None:
            self.store.select_message(hit.message_id)
        self.open_conversation(hit.conversation_id)
        if hit.message_id is not None:
            self.chat_view.scroll_to_message(hit.message_id)

    def _refresh_search(self) -> None:
        if self.search_results.query.strip():
            self.run_search(self.search_results.query)

    # -- chatting --------------------------------------------------------------------------------

    def send(self, text: str) -> None:
        if self.current_id is None:
            self.current_id = self.store.create_conversation().id
            self.store.set_app_setting(LAST_CONVERSATION_KEY, self.current_id)
            self.path_model.set_path(self.current_id, [])
            self.drafts.pop(None, None)
        self.controller.send(self.current_id, text)
        self.sidebar.select_conversation(self.current_id)
        if self.drafts.pop(self.current_id, None) is not None:
            self._save_drafts()

    def continue_reply(self, message_id: int) -> None:
        self.controller.continue_reply(message_id)

    def stop(self) -> None:
        if self.current_id is not None:
            self.controller.stop(self.current_id)

    def regenerate(self, message_id: int) -> None:
        self.controller.regenerate(message_id)

    def regenerate_last(self) -> None:
        last = self.path_model.last_message()
        if last is not None:
            self.controller.regenerate(last.id)

    def edit_and_resend(self, message_id: int, text: str) -> None:
        self.controller.edit_and_resend(message_id, text)

    def focus_input(self) -> None:
        self.composer.input.setFocus()

    def _show_path(self) -> None:
        items = self.store.path(self.current_id) if self.current_id is not None else []
        self.chat_view.set_streaming(self._streaming_ids())
        self.chat_view.set_waiting(self._waiting())
        self.path_model.set_path(self.current_id, items)

    def _streaming_ids(self) -> set[int]:
        reply = self.controller.active_reply(self.current_id) if self.current_id is not None else None
        return {reply.message_id} if reply is not None else set()

    def _keep_draft(self) -> None:
        """Remember what is typed in the message box for the chat on screen."""
        text = self.composer.input.toPlainText()
        if text == self.drafts.get(self.current_id, ""):
            return
        if text:
            self.drafts[self.current_id] = text
        else:
            self.drafts.pop(self.current_id, None)
        self._save_drafts()

    def _save_drafts(self) -> None:
        self.store.set_app_setting(DRAFTS_KEY, {str(k): v for k, v in self.drafts.items() if k is not None})

    def _on_activity_changed(self, _conversation_id: int) -> None:
        activity = {cid: self.controller.activity(cid) for cid in self.controller.active_conversations()}
        self.conversations.set_activity(activity)
        self.chat_view.set_waiting(self._waiting())

    def _waiting(self) -> dict[int, str]:
        reply = self.controller.active_reply(self.current_id) if self.current_id is not None else None
        waiting = self.controller.waiting_for(self.current_id) if reply is not None else ""
        return {reply.message_id: waiting} if waiting else {}

    def _on_context_measured(self, conversation_id: int, use: ContextUse) -> None:
        self.context_use[conversation_id] = use
        if conversation_id == self.current_id:
            self._show_context()

    def _show_context(self) -> None:
        """The context meter and, when the chat nears or outgrows the context, what happens."""
        use = self.context_use.get(self.current_id) if self.current_id is not None else None
        if use is None:
            self.context_label.setText("")
            self.context_label.setToolTip("")
            self.context_warning.hide()
            return
        self.context_label.setText(f"{use.prompt:,} / {use.context:,} tokens")
        policy = CONTEXT_CHOICES.get(use.policy, use.policy)
        self.context_label.setToolTip(
            f"The model sees {use.prompt:,} tokens of this chat (all of it: {use.total:,}); its "
            f"context holds {use.context:,}, of which {use.reply_room:,} stay free for the reply. "
            f"When the chat is too long: {policy}.")
        warning = ""
        if use.over:
            warning = (f"This chat ({use.total:,} tokens) no longer fits the model's context "
                       f"({use.context:,}): the next reply will fail under “{policy}”. Choose "
                       "another policy in Chat settings, or start a new chat.")
        elif use.dropped:
            warning = (f"The model sees the last {use.prompt:,} tokens of this chat: {use.dropped} "
                       f"older message{'s are' if use.dropped != 1 else ' is'} left out ({policy}).")
        elif use.total + use.reply_room > CONTEXT_WARNING * use.context:
            left = max(0, use.context - use.reply_room - use.total)
            then = ("the reply after that fails" if use.policy == "stop"
                    else "older turns are left out from then on")
            warning = (f"This chat nears the model's context: about {left:,} tokens left, then "
                       f"{then} ({policy}).")
        self.context_warning.setText(warning)
        self.context_warning.setVisible(bool(warning))

    def _show_notice(self) -> None:
        """The open chat's unreadable parts in one line (hidden when it was read as written)."""
        problems = self.store.conversation(self.current_id).problems if self.current_id is not None else ()
        text = "Part of this chat could not be read: " + "; ".join(problems) if problems else ""
        self.notice_label.setText(text)
        self.notice_label.setToolTip(text)
        self.notice_label.setVisible(bool(problems))

    def _update_composer(self) -> None:
        generating = self.current_id is not None and self.controller.active_reply(self.current_id) is not None
        self.composer.set_generating(generating)
        self.regenerate_action.setEnabled(not generating)

    def _on_tree_changed(self, conversation_id: int) -> None:
        if conversation_id == self.current_id:
            self._show_path()
            self._update_composer()
            self._show_notice()

    def _on_reply_state(self, conversation_id: int, _message_id: int) -> None:
        if conversation_id == self.current_id:
            self.chat_view.set_streaming(self._streaming_ids())
            self._update_composer()

    def _on_reply_updated(self, conversation_id: int, message_id: int, text: str) -> None:
        if conversation_id == self.current_id:  # a reply for another chat never lands here
            self.path_model.set_text(message_id, text)

    def _on_reply_ended(self, conversation_id: int, _message_id: int) -> None:
        if conversation_id == self.current_id:
            self.chat_view.set_streaming(self._streaming_ids())
            self._show_path()
            self._update_composer()
        self.conversations.refresh()

    def _on_conversation_changed(self, conversation_id: int) -> None:
        self.conversations.refresh()
        if conversation_id == self.current_id:
            self.title_label.setText(self.store.conversation(conversation_id).title)
            self.sidebar.select_conversation(conversation_id)
            self._show_notice()
        self._refresh_search()

    # -- settings --------------------------------------------------------------------------------

    def open_chat_settings(self) -> ChatSettingsDialog:
        """Open the (non-modal) settings dialog for the chat on screen; it offers the drafting
        the loaded model can do."""
        current = self.store.settings(self.current_id) if self.current_id is not None else self.store.default_settings()
        info = self.controller.model_info
        dialog = ChatSettingsDialog(current, self.store.default_settings(), title="Chat settings",
                                    drafting=self.controller.available_drafting() if info else None,
                                    model_name=info.name if info else "The loaded model", parent=self)
        dialog.applied.connect(self.apply_chat_settings)
        dialog.defaults_saved.connect(self.store.set_default_settings)
        dialog.finished.connect(dialog.deleteLater)
        self._settings_dialog = dialog
        dialog.open()
        return dialog

    def apply_chat_settings(self, settings: ChatSettings) -> None:
        if self.current_id is None:
            self.current_id = self.store.create_conversation().id
            self.path_model.set_path(self.current_id, [])
            self.conversations.refresh()
            self.sidebar.select_conversation(self.current_id)
        self.store.set_settings(self.current_id, settings)
        self._show_notice()  # saved settings replace unreadable ones
        self.controller.measure_context(self.current_id)  # the policy or reply room may differ
        self.statusBar().showMessage("Chat settings saved", 2000)

    def set_model_titles(self, on: bool) -> None:
        """Model-written titles for new chats (off: the first message is the title)."""
        self.store.set_app_setting(AUTO_TITLE_KEY, bool(on))

    def set_theme(self, choice: str) -> None:
        self.store.set_app_setting(THEME_KEY, choice)
        self.theme.apply(choice)  # type: ignore[arg-type]
        self.theme_actions[choice].setChecked(True)

    def _apply_theme(self, dark: bool) -> None:
        self.renderer = MarkdownRenderer(self.theme.markdown_palette)
        self.chat_view.set_renderer(self.renderer)

    # -- models ----------------------------------------------------------------------------------

    def load_model(self, ref: str | None) -> None:
        self.controller.load_model(ref)

    def open_cache_dialog(self) -> CacheDialog:
        """The prefix cache's budgets, live use per tier and "clear" (non-modal)."""
        dialog = CacheDialog(self.store, self.client, parent=self)
        dialog.finished.connect(dialog.deleteLater)
        dialog.finished.connect(lambda: self._forget_cache_dialog(dialog))
        self._cache_dialog = dialog
        dialog.open()
        return dialog

    def _forget_cache_dialog(self, dialog: CacheDialog) -> None:
        if self._cache_dialog is dialog:
            self._cache_dialog = None

    def open_model_manager(self) -> ModelManagerDialog:
        if self._model_manager is None:
            loaded = self.controller.model_info.name if self.controller.model_info else None
            self._model_manager = ModelManagerDialog(self.tasks, loaded, self)
            self._model_manager.use_requested.connect(self.load_model)
        else:
            self._model_manager.refresh()
        self._model_manager.show()
        self._model_manager.raise_()
        return self._model_manager

    def _on_model_loaded(self, info: ModelInfo) -> None:
        quant = f" · {info.quantization}" if info.quantization else ""
        self.model_label.setText(f"{info.name}{quant}")
        self.model_label.setToolTip(f"{info.architecture}, {info.dtype}, context {info.context_length} tokens")
        self._set_model_status(f"{info.name} ready")
        self.store.set_app_setting(LAST_MODEL_KEY, self.controller.model_ref)
        if self._model_manager is not None:
            self._model_manager.set_loaded(info.name)
        if self.current_id is not None:  # the chat on screen: warm its cached state now
            self.controller.measure_context(self.current_id)
            self.controller.prefetch(self.current_id)

    def _on_model_failed(self, message: str) -> None:
        loaded = self.controller.model_info  # the worker keeps the model it had
        if loaded is None:
            self.model_label.setText("No model")
        self._set_model_status(f"Model not loaded: {message}" + (f" (still using {loaded.name})" if loaded else ""))

    def _set_model_status(self, text: str) -> None:
        self.status_label.setText(text)

    # -- export / import -------------------------------------------------------------------------

    def export_json(self, conversation_ids: list[int], path: Path) -> None:
        transfer.write_json(self.store, conversation_ids, Path(path))

    def export_markdown(self, conversation_id: int, path: Path) -> None:
        Path(path).write_text(transfer.export_markdown(self.store, conversation_id), encoding="utf-8")

    def import_file(self, path: Path) -> list[int]:
        ids = transfer.read_json(self.store, Path(path))
        self.conversations.refresh()
        if ids:
            self.open_conversation(ids[-1])
        return ids

    def _export_dialog(self, kind: str, conversation_id: int | None = None) -> None:
        conversation_id = conversation_id if conversation_id is not None else self.current_id
        if conversation_id is None:
            return
        title = self.store.conversation(conversation_id).title
        suffix, filter_ = (".json", "Arbor export (*.json)") if kind == "json" else (".md", "Markdown (*.md)")
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", _safe_filename(title) + suffix, filter_)
        if not path:
            return
        if kind == "json":
            self.export_json([conversation_id], Path(path))
        else:
            self.export_markdown(conversation_id, Path(path))
        self.statusBar().showMessage(f"Exported to {path}", 4000)

    def _export_all_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export all chats", "arbor-chats.json", "Arbor export (*.json)")
        if path:
            ids = [s.id for s in self.store.list_conversations(0, 10**9)]
            self.export_json(ids, Path(path))
            self.statusBar().showMessage(f"Exported {len(ids)} chats to {path}", 4000)

    def _import_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import conversations", "", "Arbor export (*.json)")
        if not path:
            return
        try:
            ids = self.import_file(Path(path))
        except StoreError as exc:
            QMessageBox.warning(self, "Import failed", str(exc))
            return
        self.statusBar().showMessage(f"Imported {len(ids)} chat(s)", 4000)

    # -- events ----------------------------------------------------------------------------------

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt override
        if watched is self.composer.input and event.type() == QEvent.Type.KeyPress and event.key() == Qt.Key.Key_Escape:
            self.stop()
            return True
        return super().eventFilter(watched, event)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._fit_sidebar()
        # A narrow chat column keeps the title and the meter; the model's name is in the status
        # bar as well.
        self.model_label.setVisible(self.width() - self.splitter.sizes()[0] >= HEADER_MODEL_WIDTH)

    def _remember_sidebar_width(self) -> None:
        self.sidebar_width = self.splitter.sizes()[0]

    def _fit_sidebar(self) -> None:
        """The sidebar at the user's width, narrower (down to its minimum) while the chat column
        would otherwise be cramped."""
        handle = self.splitter.handleWidth()
        total = self.splitter.width()
        want = max(SIDEBAR_MIN_WIDTH, min(self.sidebar_width, total - handle - CHAT_COMFORT_WIDTH))
        if total > 0 and self.splitter.sizes()[0] != want:
            self.splitter.setSizes([want, max(0, total - handle - want)])

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802
        self._keep_draft()
        self.window_state.save(self, self.splitter, self.sidebar_width)
        self.controller.stop_all()
        if self._model_manager is not None:
            self._model_manager.close()
        if self._cache_dialog is not None:
            # Its fields apply on focus-out: left open, one would write to a closed store.
            self._cache_dialog.close()
        event.accept()

    def _exists(self, conversation_id: int) -> bool:
        try:
            self.store.conversation(conversation_id)
        except KeyError:
            return False
        return True


def _safe_filename(title: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch in " -_." else "_" for ch in title).strip()
    return cleaned[:60] or "chat"


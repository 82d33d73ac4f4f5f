"""Conversation logic between the widgets, the store and the inference worker (GUI thread).

Scope: turn user actions (send, stop, regenerate, edit and resend, load a model) into store
writes and worker requests, and worker signals back into store writes and ``reply_*`` signals.
Non-scope: widgets (``desktop.ui``) and inference (``desktop.worker``).

Routing: every generation's request id maps to the one message it fills (``ActiveReply``).
Tokens of a request update that message and nothing else, so a reply keeps streaming into its own
conversation and branch while the user looks at another one; the UI decides from the
``(conversation id, message id)`` of each signal whether the message is on screen.

Durability: the user's message is written before the request is queued; the reply is created as
``'streaming'`` and checkpointed on every coalesced update, before the UI shows that text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from desktop import qt_compat  # noqa: F401,I001  (before any signal is emitted; see the module)
from PySide6.QtCore import QObject, Signal, Slot

from backend.api import DoneEvent, GenerateRequest, Message as PromptMessage, ModelInfo
from desktop import titles
from desktop.chat_settings import ChatSettings
from desktop.reasoning import split_reasoning
from desktop.store import ChatStore, Message
from desktop.worker import InferenceClient, stats_from_done

log = logging.getLogger(__name__)

AUTO_TITLE_KEY = "auto_title_with_model"


@dataclass
class ActiveReply:
    """A reply being generated (or queued): where its tokens go."""

    request_id: int
    conversation_id: int
    message_id: int
    text: str = ""
    started: bool = False


def prompt_messages(settings: ChatSettings, lineage: list[Message]) -> list[PromptMessage]:
    """The chat the model sees: the system prompt, then the path; earlier replies lose their
    reasoning blocks, and replies that produced no text are left out."""
    messages: list[PromptMessage] = []
    if settings.system_prompt.strip():
        messages.append({"role": "system", "content": settings.system_prompt})
    for message in lineage:
        content = message.content
        if message.role == "assistant":
            content = split_reasoning(content)[1]
            if not content.strip():
                continue
        messages.append({"role": message.role, "content": content})
    return messages


class ChatController(QObject):
    """See the module docstring. One per window."""

    reply_queued = Signal(int, int)  # conversation id, message id
    reply_started = Signal(int, int)
    reply_updated = Signal(int, int, str)  # conversation id, message id, whole text so far
    reply_ended = Signal(int, int)  # final text, status and stats are in the store
    tree_changed = Signal(int)  # conversation id: messages added or another branch selected
    conversation_changed = Signal(int)  # title, pin or model of a conversation changed
    busy_changed = Signal(bool)
    model_loading = Signal(str)
    model_loaded = Signal(object)  # ModelInfo
    model_failed = Signal(str)

    def __init__(self, store: ChatStore, client: InferenceClient, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.client = client
        self.model_info: ModelInfo | None = None
        self.model_ref: str | None = None
        self._replies: dict[int, ActiveReply] = {}  # request id -> reply
        self._titles: dict[int, int] = {}  # title request id -> conversation id
        self._loads: dict[int, str | None] = {}
        self._connections = [
            (client.model_loading, self._on_model_loading),
            (client.model_loaded, self._on_model_loaded),
            (client.model_failed, self._on_model_failed),
            (client.started, self._on_started),
            (client.token, self._on_token),
            (client.finished, self._on_finished),
            (client.cancelled, self._on_cancelled),
            (client.errored, self._on_errored),
        ]
        for signal, slot in self._connections:
            signal.connect(slot)

    def close(self) -> None:
        """Stop listening to the worker (before the store closes: signals still queued from the
        worker thread must not write to a closed store). Idempotent."""
        for signal, slot in self._connections:
            try:
                signal.disconnect(slot)
            except (RuntimeError, TypeError):
                pass
        self._connections = []

    # -- queries ---------------------------------------------------------------------------------

    def active_reply(self, conversation_id: int) -> ActiveReply | None:
        """The reply queued or streaming in ``conversation_id``, if any."""
        return next((r for r in self._replies.values() if r.conversation_id == conversation_id), None)

    def live_text(self, message_id: int) -> str | None:
        """The streamed text of a reply still in progress (None when it is not)."""
        reply = next((r for r in self._replies.values() if r.message_id == message_id), None)
        return None if reply is None else reply.text

    @property
    def busy(self) -> bool:
        return bool(self._replies)

    # -- model -----------------------------------------------------------------------------------

    def load_model(self, ref: str | None) -> int:
        """Load ``ref`` (None: the default model) on the worker, after what is queued."""
        request_id = self.client.load_model(ref)
        self._loads[request_id] = ref
        return request_id

    @Slot(int, str)
    def _on_model_loading(self, request_id: int, label: str) -> None:
        self.model_loading.emit(label)

    @Slot(int, object)
    def _on_model_loaded(self, request_id: int, info: ModelInfo) -> None:
        self.model_ref = self._loads.pop(request_id, None)
        self.model_info = info
        self.model_loaded.emit(info)

    @Slot(int, str)
    def _on_model_failed(self, request_id: int, message: str) -> None:
        self._loads.pop(request_id, None)
        self.model_failed.emit(message)

    # -- user actions ----------------------------------------------------------------------------

    def send(self, conversation_id: int, text: str) -> int | None:
        """Add the user's message under the current leaf and ask for a reply; returns the reply's
        message id (None if the text is empty or a reply is already running in this chat)."""
        if not text.strip() or self.active_reply(conversation_id) is not None:
            return None
        conversation = self.store.conversation(conversation_id)
        user = self.store.add_message(conversation_id, conversation.current_leaf_id, "user", text)
        if conversation.title_source == "placeholder" and conversation.current_leaf_id is None:
            title = titles.heuristic_title(text)
            if title:
                self.store.rename(conversation_id, title, source="auto")
        return self._start_reply(user)

    def regenerate(self, message_id: int) -> int | None:
        """A new reply as a sibling of ``message_id`` (a reply) or as a new child of it (a user
        message without a reply yet)."""
        message = self.store.message(message_id)
        if self.active_reply(message.conversation_id) is not None:
            return None
        if message.role == "assistant" and message.parent_id is None:
            return None  # a reply whose question is missing from the store: nothing to answer
        parent = self.store.message(message.parent_id) if message.role == "assistant" else message
        if parent.role != "user":
            return None
        return self._start_reply(parent)

    def edit_and_resend(self, message_id: int, text: str) -> int | None:
        """Add ``text`` as a sibling of the user message ``message_id`` and answer it."""
        message = self.store.message(message_id)
        if message.role != "user" or not text.strip() or self.active_reply(message.conversation_id) is not None:
            return None
        edited = self.store.add_message(message.conversation_id, message.parent_id, "user", text)
        return self._start_reply(edited)

    def select_branch(self, message_id: int) -> None:
        """Show the branch through ``message_id`` (a sibling picked with ‹ ›)."""
        conversation_id = self.store.message(message_id).conversation_id
        self.store.select_message(message_id)
        self.tree_changed.emit(conversation_id)

    def stop(self, conversation_id: int) -> None:
        """Stop the reply of ``conversation_id`` now (queued or streaming)."""
        reply = self.active_reply(conversation_id)
        if reply is not None:
            self.client.cancel(reply.request_id)

    def stop_all(self) -> None:
        for request_id in list(self._replies) + list(self._titles):
            self.client.cancel(request_id)

    def prefetch(self, conversation_id: int) -> int | None:
        """Warm the prefix cache for a conversation the user just opened (its stored state moves
        towards the device while they type); the next reply cancels it. Returns the request
        id, or None when there is nothing to prefetch."""
        conversation = self.store.conversation(conversation_id)
        if self.model_info is None or conversation.current_leaf_id is None:
            return None
        settings = self.store.settings(conversation_id)
        messages = prompt_messages(settings, self.store.lineage(conversation.current_leaf_id))
        return self.client.prefetch(messages) if messages else None

    # -- replies ---------------------------------------------------------------------------------

    def _start_reply(self, user: Message) -> int:
        conversation_id = user.conversation_id
        self._cancel_titles()  # a title must never delay a reply the user is waiting for
        settings = self.store.settings(conversation_id)
        request = GenerateRequest(
            messages=prompt_messages(settings, self.store.lineage(user.id)),
            sampling=settings.sampling(),
            max_tokens=settings.max_tokens,
            draft=settings.speculation,  # drafting changes the speed, never the reply
        )
        model_name = self.model_info.name if self.model_info else None
        reply = self.store.add_message(conversation_id, user.id, "assistant", "", status="streaming", model=model_name)
        if model_name:
            self.store.set_model(conversation_id, self.model_ref or model_name)
        was_busy = self.busy
        request_id = self.client.generate(request)
        self._replies[request_id] = ActiveReply(request_id, conversation_id, reply.id)
        self.tree_changed.emit(conversation_id)
        self.conversation_changed.emit(conversation_id)
        self.reply_queued.emit(conversation_id, reply.id)
        if not was_busy:
            self.busy_changed.emit(True)
        return reply.id

    @Slot(int)
    def _on_started(self, request_id: int) -> None:
        reply = self._replies.get(request_id)
        if reply is not None:
            reply.started = True
            self.reply_started.emit(reply.conversation_id, reply.message_id)

    @Slot(int, str)
    def _on_token(self, request_id: int, text: str) -> None:
        reply = self._replies.get(request_id)
        if reply is None:
            return  # a title request, or a request this controller no longer tracks
        reply.text += text
        self.store.checkpoint(reply.message_id, reply.text)  # saved before it is shown
        self.reply_updated.emit(reply.conversation_id, reply.message_id, reply.text)

    @Slot(int, object)
    def _on_finished(self, request_id: int, done: DoneEvent) -> None:
        if request_id in self._titles:
            self._finish_title(self._titles.pop(request_id), done.text)
            return
        reply = self._replies.pop(request_id, None)
        if reply is None:
            return
        self.store.finish_message(reply.message_id, done.text, "complete", stats=stats_from_done(done))
        self._ended(reply)
        self._maybe_queue_title(reply.conversation_id)

    @Slot(int, object)
    def _on_cancelled(self, request_id: int, done: DoneEvent | None) -> None:
        self._titles.pop(request_id, None)
        reply = self._replies.pop(request_id, None)
        if reply is None:
            return
        text = done.text if done is not None else reply.text
        stats = stats_from_done(done) if done is not None else None
        self.store.finish_message(reply.message_id, text, "cancelled", stats=stats)
        self._ended(reply)

    @Slot(int, str)
    def _on_errored(self, request_id: int, message: str) -> None:
        self._titles.pop(request_id, None)
        reply = self._replies.pop(request_id, None)
        if reply is None:
            return
        self.store.finish_message(reply.message_id, reply.text, "error", error=message)
        self._ended(reply)

    def _ended(self, reply: ActiveReply) -> None:
        self.reply_ended.emit(reply.conversation_id, reply.message_id)
        if not self.busy:
            self.busy_changed.emit(False)

    # -- titles ----------------------------------------------------------------------------------

    def _maybe_queue_title(self, conversation_id: int) -> None:
        if not self.store.app_setting(AUTO_TITLE_KEY, True):
            return
        try:
            conversation = self.store.conversation(conversation_id)
        except KeyError:
            return
        if conversation.title_source == "user":
            return
        path = self.store.path(conversation_id)
        if len(path) != 2 or any(p.sibling_count > 1 for p in path):
            return  # only the very first exchange is titled
        user, reply = path[0].message, path[1].message
        if reply.status != "complete" or not reply.content.strip():
            return
        request_id = self.client.generate(titles.title_request(user.content, reply.content))
        self._titles[request_id] = conversation_id

    def _finish_title(self, conversation_id: int, text: str) -> None:
        title = titles.clean_title(text)
        if title is None:
            return
        try:
            self.store.rename(conversation_id, title, source="auto")
        except KeyError:
            return
        self.conversation_changed.emit(conversation_id)

    def _cancel_titles(self) -> None:
        for request_id in self._titles:
            self.client.cancel(request_id)

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

Activity: the worker runs up to its engine's batch of replies at once (several chats stream
together) and queues the rest in order. Each chat's state (``activity``: queued (waiting for a
place in the batch), generating, prefetching) changes with ``activity_changed``; a queued reply can say what
it waits for (``waiting_for``); a reply's stored time to first token counts from the user's
send, and the wait before the model began is stored apart (``queue_s``).

Context: each chat's overflow policy (``ChatSettings.context_overflow``) goes with its requests.
Under the default ("drop old turns") the controller remembers per chat where the model's view
last began (``context_start``) and sends the chat from there, so the engine's cut moves only
when the room runs out; a chat with no known start (just imported) is measured fresh when it is
opened (``measure_context``), which also feeds the window's context meter.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

from desktop import qt_compat  # noqa: F401,I001  (before any signal is emitted; see the module)
from PySide6.QtCore import QObject, QTimer, Signal, Slot

from backend.api import DoneEvent, GenerateRequest, Message as PromptMessage, ModelInfo
from backend.context_policy import reply_room
from backend.errors import ContextLengthError
from desktop import titles
from desktop.chat_settings import ChatSettings
from desktop.reasoning import split_reasoning
from desktop.store import ChatStore, Message
from desktop.worker import InferenceClient, stats_from_done

log = logging.getLogger(__name__)

AUTO_TITLE_KEY = "auto_title_with_model"  # model-written titles: off unless the user opts in
CONTEXT_STARTS_KEY = "context_starts"  # conversation id -> the first message the model last saw
CONTROLLER_STATS = ("queue_s",)  # stored with a reply's statistics beside the worker's
PREFETCH_SHOWN_AFTER_S = 0.15  # a prefetch shows in the sidebar once it has run this long


@dataclass
class ActiveReply:
    """A reply being generated (or queued): where its tokens go, and when it was asked for."""

    request_id: int
    conversation_id: int
    message_id: int
    text: str = ""
    started: bool = False
    sent_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    prefix: str = ""  # the text a continued reply writes on from
    policy: str = "stop"
    sent_ids: tuple[int, ...] = ()  # store ids of the non-system messages sent, in order
    earlier_tokens: int = 0  # tokens a continued reply had before
    left_out: int = 0  # messages before the chat's context start, not sent at all


@dataclass(frozen=True)
class ContextUse:
    """What the context meter shows for a chat's next prompt: the tokens the model will see
    (``prompt``), the whole chat's (``total``), the model's context and the room kept for the
    reply, the messages left out, whether the next reply would be refused (``over``: the chat's
    policy is "stop at the limit"), the policy, and where the engine's cut fell (``cut``:
    messages of what was sent that it left out)."""

    prompt: int
    total: int
    context: int
    reply_room: int
    dropped: int
    over: bool
    policy: str
    cut: int = 0


NEXT_TURN: PromptMessage = {"role": "user", "content": "…"}  # stands for the user's next words


def prompt_messages(settings: ChatSettings, lineage: list[Message]) -> list[PromptMessage]:
    """The chat the model sees: the system prompt, then the path; earlier replies lose their
    reasoning blocks, and replies that produced no text are left out."""
    return prompt_with_ids(settings, lineage)[0]


def prompt_with_ids(settings: ChatSettings, lineage: list[Message]
                    ) -> tuple[list[PromptMessage], list[int]]:
    """``prompt_messages`` and the store ids of its non-system messages, in order."""
    messages: list[PromptMessage] = []
    ids: list[int] = []
    if settings.system_prompt.strip():
        messages.append({"role": "system", "content": settings.system_prompt})
    for message in lineage:
        content = message.content
        if message.role == "assistant":
            content = split_reasoning(content)[1]
            if not content.strip():
                continue
        messages.append({"role": message.role, "content": content})
        ids.append(message.id)
    return messages, ids


class ChatController(QObject):
    """See the module docstring. One per window."""

    reply_queued = Signal(int, int)  # conversation id, message id
    reply_started = Signal(int, int)
    reply_updated = Signal(int, int, str)  # conversation id, message id, whole text so far
    reply_ended = Signal(int, int)  # final text, status and stats are in the store
    tree_changed = Signal(int)  # conversation id: messages added or another branch selected
    conversation_changed = Signal(int)  # title, pin or model of a conversation changed
    busy_changed = Signal(bool)
    activity_changed = Signal(int)  # conversation id: queued / generating / prefetching changed
    context_measured = Signal(int, object)  # conversation id, ContextUse
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
        self._prefetches: dict[int, tuple[int, float]] = {}  # request id -> (conversation, since)
        self._measures: dict[int, tuple[int, tuple[int, ...], bool]] = {}  # id -> chat, ids sent, fresh
        starts = store.app_setting(CONTEXT_STARTS_KEY, {})
        self._context_starts: dict[int, int] = {
            int(k): v for k, v in (starts.items() if isinstance(starts, dict) else ())
            if str(k).isdigit() and isinstance(v, int) and not isinstance(v, bool)}
        self._connections = [
            (client.model_loading, self._on_model_loading),
            (client.model_loaded, self._on_model_loaded),
            (client.model_failed, self._on_model_failed),
            (client.started, self._on_started),
            (client.token, self._on_token),
            (client.finished, self._on_finished),
            (client.cancelled, self._on_cancelled),
            (client.errored, self._on_errored),
            (client.task_done, self._on_task_done),
            (client.task_failed, self._on_task_failed),
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

    def active_conversations(self) -> set[int]:
        """Conversations with a reply queued or running, or a prefetch pending."""
        return {r.conversation_id for r in self._replies.values()} | {c for c, _ in self._prefetches.values()}

    def activity(self, conversation_id: int) -> str:
        """"generating", "queued" (a reply waits for the model), "prefetching" or ""."""
        reply = self.active_reply(conversation_id)
        if reply is not None:
            return "queued" if self._ahead(reply) else "generating"
        now = time.monotonic()
        if any(cid == conversation_id and now - since >= PREFETCH_SHOWN_AFTER_S
               for cid, since in self._prefetches.values()):
            return "prefetching"
        return ""

    def _ahead(self, reply: ActiveReply) -> list[int]:
        """The requests the worker runs before ``reply`` (none once it started)."""
        if reply.started:
            return []
        return sorted(rid for rid in [*self._replies, *self._titles, *self._loads]
                      if rid < reply.request_id and self.client.is_pending(rid))

    def waiting_for(self, conversation_id: int) -> str:
        """What a queued reply of ``conversation_id`` waits for, in words ("" if none)."""
        reply = self.active_reply(conversation_id)
        ahead = self._ahead(reply) if reply is not None else []
        if not ahead:
            return ""
        first = ahead[0]
        if first in self._loads:
            return "Waiting for the model to load…"
        if first in self._titles:
            return "Waiting for a chat title to be written…"
        other = self._replies[first].conversation_id
        try:
            title = self.store.conversation(other).title
        except KeyError:
            title = "another chat"
        more = f" (and {len(ahead) - 1} more)" if len(ahead) > 1 else ""
        return f"Waiting for the reply in “{title}” to finish{more}…"

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
        request, _ids = self._request(conversation_id, self.store.lineage(conversation.current_leaf_id))
        if not request.messages:
            return None
        request_id = self.client.prefetch(request.messages, request)
        self._prefetches[request_id] = (conversation_id, time.monotonic())
        # Shown only once it takes a while: most prefetches end before a repaint is worth it.
        self._still_prefetching(request_id)
        return request_id

    def _still_prefetching(self, request_id: int) -> None:
        """Show a pending prefetch once it has run ``PREFETCH_SHOWN_AFTER_S``. (A timer may wake
        a little early, coarse timers by up to 5%: then it waits again for the rest.)"""
        if request_id not in self._prefetches:
            return
        conversation_id, since = self._prefetches[request_id]
        left_ms = math.ceil((since + PREFETCH_SHOWN_AFTER_S - time.monotonic()) * 1000)
        if left_ms > 0:
            QTimer.singleShot(left_ms + 1, self, lambda: self._still_prefetching(request_id))
        else:
            self.activity_changed.emit(conversation_id)

    def measure_context(self, conversation_id: int) -> int | None:
        """Ask the engine how much of the model's context the chat's next prompt uses (answered
        by ``context_measured``). A chat over the room with no known start gets a fresh cut
        (half the room free), kept for its next requests."""
        conversation = self.store.conversation(conversation_id)
        if self.model_info is None or conversation.current_leaf_id is None:
            return None
        lineage = self.store.lineage(conversation.current_leaf_id)
        request, ids = self._request(conversation_id, lineage)
        whole = prompt_messages(self.store.settings(conversation_id), lineage)
        if request.messages[-1]["role"] != "user":  # the next request adds the user's words
            request = replace(request, messages=request.messages + [NEXT_TURN])
            whole = whole + [NEXT_TURN]
        fresh = request.context_overflow == "drop_old_turns" and conversation_id not in self._context_starts
        left_out = len(whole) - len(request.messages)  # before the start the controller keeps

        def measure(engine, cancel) -> ContextUse:
            try:
                fit, over = engine.fit(request, fresh=fresh), False
            except ContextLengthError:  # stop at the limit: what it would take, and that it fails
                fit, over = engine.fit(replace(request, context_overflow="rolling_window")), True
            total = fit.total_tokens
            if left_out:
                total = engine.fit(replace(request, messages=whole, context_overflow="rolling_window")).total_tokens
            return ContextUse(fit.prompt_tokens, total, fit.context_length,
                              reply_room(fit.context_length, request.max_tokens),
                              left_out + fit.dropped, over, request.context_overflow, fit.dropped)

        request_id = self.client.run_task(measure)
        self._measures[request_id] = (conversation_id, tuple(ids), fresh)
        return request_id

    # -- replies ---------------------------------------------------------------------------------

    def _request(self, conversation_id: int, lineage: list[Message], **kw) -> tuple[GenerateRequest, list[int]]:
        """The request for a reply after ``lineage``, from the chat's settings: drafting only
        as the loaded model can, and the chat sent from where the model's view last began."""
        settings = self.store.settings(conversation_id)
        messages, ids = prompt_with_ids(settings, lineage)
        policy = settings.context_overflow
        start = self._context_starts.get(conversation_id)
        if policy == "drop_old_turns" and start in ids:
            head = len(messages) - len(ids)  # the system prompt
            cut = ids.index(start)
            messages, ids = messages[:head] + messages[head + cut:], ids[cut:]
        draft = settings.speculation
        if draft not in self.available_drafting():
            draft = "auto"  # a stored choice the loaded model cannot do: the reply is the same
        request = GenerateRequest(messages=messages, sampling=settings.sampling(),
                                  max_tokens=settings.max_tokens, draft=draft,
                                  context_overflow=policy, **kw)
        return request, ids

    def available_drafting(self) -> tuple[str, ...]:
        """The speculation choices the loaded model can do (``ChatSettings.speculation``)."""
        kinds = set(self.model_info.drafters if self.model_info is not None else ())
        if kinds & {"assistant", "dflash"}:  # a paired assistant or DFlash drafter is "model"
            kinds.add("model")
        return ("auto", "lookup", "none") + tuple(k for k in ("model", "mtp") if k in kinds)

    # -- replies ---------------------------------------------------------------------------------

    def _start_reply(self, user: Message) -> int:
        conversation_id = user.conversation_id
        self._cancel_titles()  # a title must never delay a reply the user is waiting for
        lineage = self.store.lineage(user.id)
        request, ids = self._request(conversation_id, lineage)
        left_out = len(prompt_with_ids(self.store.settings(conversation_id), lineage)[1]) - len(ids)
        model_name = self.model_info.name if self.model_info else None
        reply = self.store.add_message(conversation_id, user.id, "assistant", "", status="streaming", model=model_name)
        if model_name:
            self.store.set_model(conversation_id, self.model_ref or model_name)
        return self._queue(request, ActiveReply(0, conversation_id, reply.id, policy=request.context_overflow,
                                                sent_ids=tuple(ids), left_out=left_out))

    def continue_reply(self, message_id: int) -> int | None:
        """Write on from the end of a reply that stopped early (token limit, Stop, a closed app);
        the text goes on in the same message. Only the last reply of its branch can go on."""
        message = self.store.message(message_id)
        if (message.role != "assistant" or self.active_reply(message.conversation_id) is not None
                or not message.content.strip() or self.store.children(message.conversation_id).get(message_id)):
            return None
        settings = self.store.settings(message.conversation_id)
        messages, _ids = prompt_with_ids(settings, self.store.lineage(message_id)[:-1])
        request, _ = self._request(message.conversation_id, [], continue_reply=True)
        request = replace(request, messages=messages + [{"role": "assistant", "content": message.content}],
                          context_overflow="stop")
        self.store.finish_message(message_id, message.content, "streaming", stats=message.stats)
        earlier = int((message.stats or {}).get("generated_tokens") or 0)
        return self._queue(request, ActiveReply(0, message.conversation_id, message_id, text=message.content,
                                                prefix=message.content, earlier_tokens=earlier))

    def _queue(self, request: GenerateRequest, reply: ActiveReply) -> int:
        was_busy = self.busy
        reply.request_id = self.client.generate(request)
        reply.sent_at = time.monotonic()
        self._replies[reply.request_id] = reply
        for prefetch in [rid for rid in self._prefetches if not self.client.is_pending(rid)]:
            self._end_prefetch(prefetch)  # ``generate`` cancelled it
        self.tree_changed.emit(reply.conversation_id)
        self.conversation_changed.emit(reply.conversation_id)
        self.reply_queued.emit(reply.conversation_id, reply.message_id)
        self.activity_changed.emit(reply.conversation_id)
        if not was_busy:
            self.busy_changed.emit(True)
        return reply.message_id

    @Slot(int)
    def _on_started(self, request_id: int) -> None:
        reply = self._replies.get(request_id)
        if reply is not None:
            reply.started = True
            reply.started_at = time.monotonic()
            self.reply_started.emit(reply.conversation_id, reply.message_id)
            self.activity_changed.emit(reply.conversation_id)
            for other in {r.conversation_id for r in self._replies.values() if not r.started}:
                self.activity_changed.emit(other)  # what they wait for changed

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
        self._remember_cut(reply, done)
        self.store.finish_message(reply.message_id, reply.prefix + done.text, "complete",
                                  stats=self._stats(reply, done))
        self._ended(reply)
        self._maybe_queue_title(reply.conversation_id)

    @Slot(int, object)
    def _on_cancelled(self, request_id: int, done: DoneEvent | None) -> None:
        self._titles.pop(request_id, None)
        reply = self._replies.pop(request_id, None)
        if reply is None:
            return
        text = reply.prefix + done.text if done is not None else reply.text
        if done is not None:
            self._remember_cut(reply, done)
        stats = self._stats(reply, done) if done is not None else None
        self.store.finish_message(reply.message_id, text, "cancelled", stats=stats)
        self._ended(reply)

    @Slot(int, str)
    def _on_errored(self, request_id: int, message: str) -> None:
        self._titles.pop(request_id, None)
        reply = self._replies.pop(request_id, None)
        if reply is None:
            return
        if reply.policy == "stop" and "the model's context is" in message:
            message += (". This chat's context policy is “Stop at the limit”: choose another in "
                        "Chat settings, or start a new chat")
        self.store.finish_message(reply.message_id, reply.text, "error", error=message)
        self._ended(reply)

    def _ended(self, reply: ActiveReply) -> None:
        self.reply_ended.emit(reply.conversation_id, reply.message_id)
        self.activity_changed.emit(reply.conversation_id)
        if not self.busy:
            self.busy_changed.emit(False)
        self.measure_context(reply.conversation_id)  # the meter follows the chat

    def _stats(self, reply: ActiveReply, done: DoneEvent) -> dict:
        """The stored statistics: the engine's, with time to first token from the user's send
        and the wait before the model began apart (``queue_s``)."""
        stats = stats_from_done(done)
        started = reply.started_at if reply.started_at is not None else reply.sent_at
        stats["queue_s"] = round(max(0.0, started - reply.sent_at), 4)
        stats["ttft_s"] = round(stats["queue_s"] + done.ttft_s, 4)
        if reply.earlier_tokens:
            stats["generated_tokens"] += reply.earlier_tokens
        stats["dropped_messages"] += reply.left_out  # the model saw none of them either
        return stats

    def _remember_cut(self, reply: ActiveReply, done: DoneEvent) -> None:
        """Where the model's view of the chat began, for its next requests (drop old turns)."""
        if reply.policy == "drop_old_turns" and done.dropped_messages and \
                done.dropped_messages < len(reply.sent_ids):
            self._set_context_start(reply.conversation_id, reply.sent_ids[done.dropped_messages])

    def _set_context_start(self, conversation_id: int, message_id: int) -> None:
        if self._context_starts.get(conversation_id) != message_id:
            self._context_starts[conversation_id] = message_id
            self.store.set_app_setting(CONTEXT_STARTS_KEY, {str(k): v for k, v in self._context_starts.items()})

    # -- engine tasks ----------------------------------------------------------------------------

    @Slot(int, object)
    def _on_task_done(self, request_id: int, result: object) -> None:
        if request_id in self._prefetches:
            self._end_prefetch(request_id)
        measured = self._measures.pop(request_id, None)
        if measured is None or not isinstance(result, ContextUse):
            return
        conversation_id, ids, fresh = measured
        if fresh and 0 < result.cut < len(ids) and conversation_id not in self._context_starts:
            # (the first answer wins: a request may already have been sent from it)
            self._set_context_start(conversation_id, ids[result.cut])
        self.context_measured.emit(conversation_id, result)

    @Slot(int, str)
    def _on_task_failed(self, request_id: int, message: str) -> None:
        if request_id in self._prefetches:
            self._end_prefetch(request_id)
        self._measures.pop(request_id, None)

    def _end_prefetch(self, request_id: int) -> None:
        conversation_id, since = self._prefetches.pop(request_id, (None, 0.0))
        if conversation_id is not None and time.monotonic() - since >= PREFETCH_SHOWN_AFTER_S:
            self.activity_changed.emit(conversation_id)  # it was shown: take it away

    # -- titles ----------------------------------------------------------------------------------

    def _maybe_queue_title(self, conversation_id: int) -> None:
        if self.store.app_setting(AUTO_TITLE_KEY, False) is not True:
            return  # the user's first message is the title unless they opted in
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

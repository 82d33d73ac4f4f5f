"""The inference worker: one long-lived QThread that owns the engine.

Scope: load a model and run generations off the GUI thread, several at once (the engine's
continuous batching), and the short engine tasks (prefetch, cache statistics, budgets) between
its steps. Non-scope: what a conversation is (``desktop.chat_controller`` builds requests and
stores replies).

Threading contract
    * ``InferenceWorker`` lives on its own ``QThread`` and is the only code that touches the
      engine (and so MLX). The GUI talks to it only through ``InferenceClient``.
    * Commands go in as queued signals tagged with a request id (``load_model``, ``generate``,
      tasks). A generation is submitted to the engine at once; the worker then steps the engine
      one batched step per event-loop turn (``_pump``), so commands that arrive meanwhile run
      between steps: a reply in one chat streams while another chat sends (both advance in the
      same steps, up to ``DESKTOP_MAX_BATCH`` at once; more wait their turn in the engine's
      queue) and a prefetch runs while replies stream. A model load, and a task that needs the
      engine idle (clearing the cache), waits until the running replies end, and what is asked
      after it waits behind it, so requests keep the order they were asked in.
    * Each generation has its own ``threading.Event``: ``cancel`` sets it from the GUI thread at
      once; the engine checks it between prefill chunks and after every token. A request
      cancelled before it starts ends with ``cancelled(id, None)`` without running.
    * Lifecycle signals, all tagged with the request id, in this order per generation:
      ``started`` (when the engine takes it into the batch) -> ``token``* -> exactly one of
      ``finished`` / ``cancelled`` / ``errored``. Loading: ``model_loading`` ->
      ``model_loaded`` | ``model_failed``.
    * Tokens are coalesced per request: at most ``updates_per_second`` ``token`` signals per
      second, each carrying all text since the previous one, so a fast model never floods the
      GUI's event queue. The first token is sent at once (time to first token is visible).
    * ``InferenceClient.shutdown(deadline_s)`` cancels everything and waits at most that long.
      The thread, request ids, cancel events and shutdown are ``desktop.worker_handle``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from desktop import qt_compat  # noqa: F401,I001  (before any signal is emitted; see the module)
from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot

from backend.api import CacheStats, DoneEvent, GenerateRequest, ModelInfo
from backend.context_policy import ContextFit
from backend.memory.budgets import CacheBudgets
from desktop.worker_handle import Worker, WorkerHandle, describe_error  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

DEFAULT_UPDATES_PER_SECOND = 50
#: Replies generating at once (the engine batches their steps); more wait in its queue.
DESKTOP_MAX_BATCH = 4
#: Most engine steps a shutdown waits for cancelled replies to end (each ends at its next step).
WIND_DOWN_STEPS = 64


class ChatEngine(Protocol):
    """What the worker needs from an engine (``backend.engine.Engine`` is one)."""

    @property
    def info(self) -> ModelInfo: ...

    def submit(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Any:
        """Queue a request; its events arrive in the returned stream (``events``, ``done``,
        ``error``, ``waiting``) as ``step`` runs."""

    def step(self) -> bool: ...

    def stop(self, stream: Any) -> None: ...

    def prepare(self) -> None: ...

    def prefetch(self, messages: list | None = None, prompt_ids: list[int] | None = None,
                 cancel: threading.Event | None = None) -> int: ...

    def fit(self, request: GenerateRequest, fresh: bool = False) -> ContextFit: ...

    def cache_stats(self) -> CacheStats: ...

    def set_cache_budgets(self, budgets: CacheBudgets) -> None: ...

    def clear_cache(self) -> None: ...

    def close(self) -> None: ...


EngineLoader = Callable[[Any], ChatEngine]
EngineTask = Callable[[ChatEngine, threading.Event], Any]


def load_engine(ref: str | None, budgets: CacheBudgets | None = None) -> ChatEngine:
    """The real loader: a store name, HF folder, ``.gguf`` file or ``None`` (default model),
    with the prefix cache's tier budgets (None: the machine's defaults).

    Imported lazily so that the window can appear before MLX is loaded.
    """
    from backend.engine import Engine
    from backend.memory.budgets import CacheConfig

    config = CacheConfig.default()
    if budgets is not None:
        config = CacheConfig(budgets, config.directory)
    return Engine.load(ref, cache=config, max_batch=DESKTOP_MAX_BATCH)


def stats_from_done(done: DoneEvent) -> dict[str, Any]:
    """The statistics stored with a reply (plain JSON)."""
    return {
        "finish_reason": done.finish_reason,
        "prompt_tokens": done.prompt_tokens,
        "cached_tokens": done.cached_tokens,
        "generated_tokens": done.generated_tokens,
        "ttft_s": round(done.ttft_s, 4),
        "prefill_tps": round(done.prefill_tps, 2),
        "decode_tps": round(done.decode_tps, 2),
        "drafter": done.drafter,  # "model", "lookup" or "" (plain decoding)
        "drafted_tokens": done.drafted_tokens,
        "accepted_tokens": done.accepted_tokens,
        "acceptance_by_position": [round(a, 3) for a in done.acceptance_by_position],
        "mean_accepted": round(done.mean_accepted, 3),
        "cached_by_tier": dict(done.cached_by_tier),  # live / device / host / disk
        "restore_s": round(done.restore_s, 4),
        "dropped_messages": done.dropped_messages,  # left out to fit the context
    }


@dataclass
class _Reply:
    """A generation the engine holds: its stream, and the text not yet sent to the GUI."""

    request_id: int
    stream: Any
    cancel: threading.Event
    started: bool = False
    pending: list[str] = field(default_factory=list)
    last_emit: float = float("-inf")
    done: DoneEvent | None = None


class InferenceWorker(Worker):
    """Runs on the worker thread; see the module docstring for the signal contract."""

    model_loading = Signal(int, str)
    model_loaded = Signal(int, object)  # request id, ModelInfo
    model_failed = Signal(int, str)
    started = Signal(int)
    token = Signal(int, str)  # request id, text since the previous token signal
    finished = Signal(int, object)  # request id, DoneEvent
    cancelled = Signal(int, object)  # request id, DoneEvent or None (cancelled before it ran)
    errored = Signal(int, str)  # request id, one-line message
    task_done = Signal(int, object)  # request id, what an engine task returned
    task_failed = Signal(int, str)  # request id, one-line message

    def __init__(self, loader: EngineLoader, updates_per_second: float) -> None:
        super().__init__()
        self._loader = loader
        self._interval = 1.0 / updates_per_second
        self._engine: ChatEngine | None = None
        self._replies: dict[int, _Reply] = {}
        # Commands waiting for the running replies to end (a load, an idle-only task) and
        # whatever was asked after them: (run, needs an idle engine).
        self._deferred: deque[tuple[Callable[[], None], bool]] = deque()
        self._pump_timer: QTimer | None = None  # made on the worker thread, at first use

    # -- commands ------------------------------------------------------------------------------
    def _run_in_order(self, command: Callable[[], None], needs_idle: bool = False) -> None:
        if self._deferred or (needs_idle and self._replies):
            self._deferred.append((command, needs_idle))
        else:
            command()

    def _run_deferred(self) -> None:
        while self._deferred:
            command, needs_idle = self._deferred[0]
            if needs_idle and self._replies:
                return
            self._deferred.popleft()
            command()

    @Slot(int, object)
    def load_model(self, request_id: int, ref: object) -> None:
        self._run_in_order(lambda: self._load(request_id, ref), needs_idle=True)

    def _load(self, request_id: int, ref: object) -> None:
        self.model_loading.emit(request_id, "default model" if ref is None else str(ref))
        self.close_engine()  # the new engine may be the same model: it takes over the disk tier
        try:
            engine = self._loader(ref)
            info = engine.info
        except Exception as exc:  # noqa: BLE001 - every failure must reach the user
            self.fail(request_id, self.model_failed, exc, f"loading {ref!r}")
            return
        self._engine = engine  # the previous engine is released here, on this thread
        self.end(request_id, self.model_loaded, info)
        # Now, not at the first send: what the first drafting reply would stop to measure (a
        # send that comes meanwhile waits as it would have there).
        try:
            engine.prepare()
        except Exception:  # noqa: BLE001 - an optimization: the reply measures it instead
            log.warning("preparing the drafter's round costs failed", exc_info=True)

    @Slot()
    def close_engine(self) -> None:
        """Write the engine's pending cache states and release its disk tier (the writer lock),
        on this thread. The engine still answers, from memory only."""
        if self._engine is not None:
            try:
                self._engine.close()
            except Exception:  # noqa: BLE001 - closing must never stop a load or a shutdown
                log.exception("closing the engine failed")

    @Slot(int, object, object)
    def generate(self, request_id: int, request: GenerateRequest, cancel: threading.Event) -> None:
        self._run_in_order(lambda: self._submit(request_id, request, cancel))

    def _submit(self, request_id: int, request: GenerateRequest, cancel: threading.Event) -> None:
        if cancel.is_set():
            self.end(request_id, self.cancelled, None)
            return
        if self._engine is None:
            self.started.emit(request_id)
            self.end(request_id, self.errored, "no model is loaded")
            return
        try:
            stream = self._engine.submit(request, cancel)
        except Exception as exc:  # noqa: BLE001 - a bad request is its own error
            self.started.emit(request_id)
            self.fail(request_id, self.errored, exc, "generation")
            return
        self._replies[request_id] = _Reply(request_id, stream, cancel)
        self._schedule_pump()

    @Slot(int, object, object, bool)
    def run_task(self, request_id: int, task: EngineTask, cancel: threading.Event,
                 needs_idle: bool = False) -> None:
        """A short job on the loaded engine (prefetch, cache stats, budgets): between steps,
        or once no reply runs when it ``needs_idle``."""
        self._run_in_order(lambda: self._run_task(request_id, task, cancel), needs_idle)

    def _run_task(self, request_id: int, task: EngineTask, cancel: threading.Event) -> None:
        if self._engine is None or cancel.is_set():
            self.end(request_id, self.task_done, None)
            return
        try:
            result = task(self._engine, cancel)
        except Exception as exc:  # noqa: BLE001
            self.fail(request_id, self.task_failed, exc, "engine task")
            return
        self.end(request_id, self.task_done, result)

    # -- the generation loop -----------------------------------------------------------------
    def _schedule_pump(self) -> None:
        if self._pump_timer is None:
            self._pump_timer = QTimer(self)
            self._pump_timer.setSingleShot(True)
            self._pump_timer.timeout.connect(self._pump)
        if not self._pump_timer.isActive():
            self._pump_timer.start(0)  # after the commands already queued to this thread

    @Slot()
    def _pump(self) -> None:
        self._advance()
        if self._replies:
            self._schedule_pump()
        else:
            self._run_deferred()

    @Slot()
    def wind_down(self) -> None:
        """The thread is ending (``shutdown`` cancelled every request): the replies still in
        the engine end now, each with its last signals, then the engine closes."""
        for _ in range(WIND_DOWN_STEPS):
            if not self._replies or self._engine is None:
                break
            self._advance()
        self.close_engine()

    def _advance(self) -> None:
        """One engine step, then every reply's new events out as signals."""
        for reply in list(self._replies.values()):
            if reply.cancel.is_set() and not reply.started:  # still queued: it never runs
                self._engine.stop(reply.stream)
        try:
            self._engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails what was running
            for reply in list(self._replies.values()):
                self._close(reply, error=exc)
            return
        for reply in list(self._replies.values()):
            self._deliver(reply)

    def _deliver(self, reply: _Reply) -> None:
        stream = reply.stream
        if not reply.started and not stream.waiting and not (stream.done and not stream.events
                                                             and reply.cancel.is_set()):
            reply.started = True
            self.started.emit(reply.request_id)
        while stream.events:
            event = stream.events.popleft()
            if isinstance(event, DoneEvent):
                reply.done = event
            elif event.text:
                reply.pending.append(event.text)
        now = time.monotonic()
        if reply.pending and now - reply.last_emit >= self._interval:
            self._flush(reply)
            reply.last_emit = now
        if stream.error is not None or stream.done:
            self._close(reply, error=stream.error)

    def _flush(self, reply: _Reply) -> None:
        if reply.pending:
            self.token.emit(reply.request_id, "".join(reply.pending))
            reply.pending.clear()

    def _close(self, reply: _Reply, error: BaseException | None) -> None:
        """The reply's last signals: its text not yet sent, then how it ended."""
        del self._replies[reply.request_id]
        self._flush(reply)
        rid, done = reply.request_id, reply.done
        if error is not None:
            self.fail(rid, self.errored, error, "generation")
        elif done is None and reply.cancel.is_set():
            self.end(rid, self.cancelled, None)  # left the queue before it ran
        elif done is None:
            self.end(rid, self.errored, "internal error: the engine ended without statistics")
        elif done.finish_reason == "cancelled":
            self.end(rid, self.cancelled, done)
        else:
            self.end(rid, self.finished, done)


class InferenceClient(WorkerHandle):
    """The GUI thread's handle on the worker: submit, cancel (``cancel``, ``cancel_all``),
    ``busy``, ``is_pending``, ``shutdown`` (see ``desktop.worker_handle.WorkerHandle``).

    Re-emits the worker's signals on the GUI thread after its own bookkeeping, so receivers may
    write Qt models directly. Request ids are unique for the client's lifetime.
    """

    model_loading = Signal(int, str)
    model_loaded = Signal(int, object)
    model_failed = Signal(int, str)
    started = Signal(int)
    token = Signal(int, str)
    finished = Signal(int, object)
    cancelled = Signal(int, object)
    errored = Signal(int, str)
    task_done = Signal(int, object)  # request id, the task's result (None if no model)
    task_failed = Signal(int, str)

    _load_requested = Signal(int, object)
    _generate_requested = Signal(int, object, object)
    _task_requested = Signal(int, object, object, bool)

    def __init__(
        self,
        loader: EngineLoader = load_engine,
        *,
        updates_per_second: float = DEFAULT_UPDATES_PER_SECOND,
        parent: QObject | None = None,
    ) -> None:
        worker = InferenceWorker(loader, updates_per_second)
        super().__init__(worker, "arbor-inference", parent)
        self.model_info: ModelInfo | None = None
        self._load_requested.connect(worker.load_model)
        self._generate_requested.connect(worker.generate)
        self._task_requested.connect(worker.run_task)
        # Emitted on the worker thread as it ends: replies end and the engine closes there,
        # where it lives.
        self._thread.finished.connect(worker.wind_down, Qt.ConnectionType.DirectConnection)
        self._prefetches: set[int] = set()
        worker.model_loading.connect(self.model_loading)
        worker.model_loaded.connect(self._on_model_loaded)
        # Signal to signal: Qt queues each re-emission to this object's (the GUI) thread.
        for name in ("model_failed", "started", "token", "finished", "cancelled", "errored",
                     "task_done", "task_failed"):
            getattr(worker, name).connect(getattr(self, name))

    def load_model(self, ref: str | None) -> int:
        """Queue loading ``ref`` (None: the default model); returns the request id."""
        request_id, cancel = self._open_request()
        self._load_requested.emit(request_id, ref)
        return request_id

    def generate(self, request: GenerateRequest) -> int:
        """Queue a generation; returns its request id. Pending prefetches are cancelled: a
        real request never waits for one."""
        for prefetch in self._prefetches:
            self.cancel(prefetch)
        self._prefetches.clear()
        request_id, cancel = self._open_request()
        self._generate_requested.emit(request_id, request, cancel)
        return request_id

    def run_task(self, task: EngineTask, needs_idle: bool = False) -> int:
        """Queue ``task(engine, cancel)`` on the worker thread (between the engine's steps, or
        once no reply runs when it ``needs_idle``); its result arrives as
        ``task_done(id, result)`` (``None`` when no model is loaded)."""
        request_id, cancel = self._open_request()
        self._task_requested.emit(request_id, task, cancel, needs_idle)
        return request_id

    def prefetch(self, messages: list, request: GenerateRequest | None = None) -> int:
        """Bring a conversation's stored state towards the device while the user types;
        cancelled by the next ``generate``. With ``request``, what its context-overflow policy
        keeps of ``messages`` (what sending it would read)."""
        def task(engine, cancel):
            kept = engine.fit(request).messages if request is not None else messages
            return engine.prefetch(messages=kept, cancel=cancel)

        request_id = self.run_task(task)
        self._prefetches.add(request_id)
        return request_id

    def cache_stats(self) -> int:
        return self.run_task(lambda engine, cancel: engine.cache_stats())

    def set_cache_budgets(self, budgets: CacheBudgets) -> int:
        return self.run_task(lambda engine, cancel: engine.set_cache_budgets(budgets))

    def clear_cache(self) -> int:
        return self.run_task(lambda engine, cancel: engine.clear_cache(), needs_idle=True)

    @Slot(int, object)
    def _on_model_loaded(self, request_id: int, info: ModelInfo) -> None:
        self.model_info = info
        self.model_loaded.emit(request_id, info)

"""The inference worker: one long-lived QThread that owns the engine.

Scope: load a model and run generations off the GUI thread, one at a time, in the order asked.
Non-scope: what a conversation is (``desktop.chat_controller`` builds requests and stores replies).

Threading contract
    * ``InferenceWorker`` lives on its own ``QThread`` and is the only code that touches the
      engine (and so MLX). The GUI talks to it only through ``InferenceClient``.
    * Commands go in as queued signals tagged with a request id (``load_model``, ``generate``);
      the worker runs them in order. Each generation has its own ``threading.Event``: ``cancel``
      sets it from the GUI thread at once, without waiting for the queue, and the engine checks it
      between prefill chunks and after every token. A request cancelled before it starts ends with
      ``cancelled(id, None)`` without running.
    * Lifecycle signals, all tagged with the request id, in this order per generation:
      ``started`` -> ``token``* -> exactly one of ``finished`` / ``cancelled`` / ``errored``.
      Loading: ``model_loading`` -> ``model_loaded`` | ``model_failed``.
    * Tokens are coalesced: at most ``updates_per_second`` ``token`` signals per second, each
      carrying all text since the previous one, so a fast model never floods the GUI's event
      queue. The first token is sent at once (time to first token is visible).
    * ``InferenceClient.shutdown(deadline_s)`` cancels everything and waits at most that long.
      The thread, request ids, cancel events and shutdown are ``desktop.worker_handle``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Protocol

from desktop import qt_compat  # noqa: F401,I001  (before any signal is emitted; see the module)
from PySide6.QtCore import QObject, Qt, Signal, Slot

from backend.api import CacheStats, DoneEvent, GenerateRequest, ModelInfo, TokenEvent
from backend.context_policy import ContextFit
from backend.memory.budgets import CacheBudgets
from desktop.worker_handle import Worker, WorkerHandle, describe_error  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

DEFAULT_UPDATES_PER_SECOND = 50


class ChatEngine(Protocol):
    """What the worker needs from an engine (``backend.engine.Engine`` is one)."""

    @property
    def info(self) -> ModelInfo: ...

    def generate(
        self, request: GenerateRequest, cancel: threading.Event | None = None
    ) -> Iterator[TokenEvent | DoneEvent]: ...

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
    return Engine.load(ref, cache=config)


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

    @Slot(int, object)
    def load_model(self, request_id: int, ref: object) -> None:
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
        if cancel.is_set():
            self.end(request_id, self.cancelled, None)
            return
        self.started.emit(request_id)
        if self._engine is None:
            self.end(request_id, self.errored, "no model is loaded")
            return
        pending: list[str] = []
        last_emit = float("-inf")
        done: DoneEvent | None = None
        try:
            for event in self._engine.generate(request, cancel):
                if isinstance(event, DoneEvent):
                    done = event
                    continue
                if event.text:
                    pending.append(event.text)
                now = time.monotonic()
                if pending and now - last_emit >= self._interval:
                    self.token.emit(request_id, "".join(pending))
                    pending.clear()
                    last_emit = now
        except Exception as exc:  # noqa: BLE001
            if pending:
                self.token.emit(request_id, "".join(pending))
            self.fail(request_id, self.errored, exc, "generation")
            return
        if pending:
            self.token.emit(request_id, "".join(pending))
        if done is None:
            self.end(request_id, self.errored, "internal error: the engine ended without statistics")
        elif done.finish_reason == "cancelled":
            self.end(request_id, self.cancelled, done)
        else:
            self.end(request_id, self.finished, done)


    @Slot(int, object, object)
    def run_task(self, request_id: int, task: EngineTask, cancel: threading.Event) -> None:
        """A short job on the loaded engine (prefetch, cache stats, budgets), in queue order."""
        if self._engine is None or cancel.is_set():
            self.end(request_id, self.task_done, None)
            return
        try:
            result = task(self._engine, cancel)
        except Exception as exc:  # noqa: BLE001
            self.fail(request_id, self.task_failed, exc, "engine task")
            return
        self.end(request_id, self.task_done, result)


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
    _task_requested = Signal(int, object, object)

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
        # Emitted on the worker thread as it ends: the engine is closed there, where it lives.
        self._thread.finished.connect(worker.close_engine, Qt.ConnectionType.DirectConnection)
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

    def run_task(self, task: EngineTask) -> int:
        """Queue ``task(engine, cancel)`` on the worker thread; its result arrives as
        ``task_done(id, result)`` (``None`` when no model is loaded)."""
        request_id, cancel = self._open_request()
        self._task_requested.emit(request_id, task, cancel)
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
        return self.run_task(lambda engine, cancel: engine.clear_cache())

    @Slot(int, object)
    def _on_model_loaded(self, request_id: int, info: ModelInfo) -> None:
        self.model_info = info
        self.model_loaded.emit(request_id, info)

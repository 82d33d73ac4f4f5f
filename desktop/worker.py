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
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from desktop import qt_compat  # noqa: F401,I001  (before any signal is emitted; see the module)
from PySide6.QtCore import QDeadlineTimer, QObject, QThread, Signal, Slot

from backend.api import DoneEvent, GenerateRequest, ModelInfo, TokenEvent
from backend.errors import ArborError

log = logging.getLogger(__name__)

DEFAULT_UPDATES_PER_SECOND = 50


class ChatEngine(Protocol):
    """What the worker needs from an engine (``backend.engine.Engine`` is one)."""

    @property
    def info(self) -> ModelInfo: ...

    def generate(
        self, request: GenerateRequest, cancel: threading.Event | None = None
    ) -> Iterator[TokenEvent | DoneEvent]: ...


EngineLoader = Callable[[Any], ChatEngine]


def load_engine(ref: str | None) -> ChatEngine:
    """The real loader: a store name, HF folder, ``.gguf`` file or ``None`` (default model).

    Imported lazily so that the window can appear before MLX is loaded.
    """
    from backend.engine import Engine

    return Engine.load(ref)


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
        "drafted_tokens": done.drafted_tokens,
        "accepted_tokens": done.accepted_tokens,
    }


def describe_error(exc: BaseException) -> str:
    """One line for the user: an ``ArborError``'s own message, else the type and message (a bug
    in Arbor; the traceback goes to the log)."""
    if isinstance(exc, ArborError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


class InferenceWorker(QObject):
    """Runs on the worker thread; see the module docstring for the signal contract."""

    model_loading = Signal(int, str)
    model_loaded = Signal(int, object)  # request id, ModelInfo
    model_failed = Signal(int, str)
    started = Signal(int)
    token = Signal(int, str)  # request id, text since the previous token signal
    finished = Signal(int, object)  # request id, DoneEvent
    cancelled = Signal(int, object)  # request id, DoneEvent or None (cancelled before it ran)
    errored = Signal(int, str)  # request id, one-line message

    def __init__(self, loader: EngineLoader, updates_per_second: float) -> None:
        super().__init__()
        self._loader = loader
        self._interval = 1.0 / updates_per_second
        self._engine: ChatEngine | None = None

    @Slot(int, object)
    def load_model(self, request_id: int, ref: object) -> None:
        self.model_loading.emit(request_id, "default model" if ref is None else str(ref))
        try:
            engine = self._loader(ref)
            info = engine.info
        except Exception as exc:  # noqa: BLE001 - every failure must reach the user
            if not isinstance(exc, ArborError):
                log.exception("loading %r failed", ref)
            self.model_failed.emit(request_id, describe_error(exc))
            return
        self._engine = engine  # the previous engine is released here, on this thread
        self.model_loaded.emit(request_id, info)

    @Slot(int, object, object)
    def generate(self, request_id: int, request: GenerateRequest, cancel: threading.Event) -> None:
        if cancel.is_set():
            self.cancelled.emit(request_id, None)
            return
        self.started.emit(request_id)
        if self._engine is None:
            self.errored.emit(request_id, "no model is loaded")
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
            if not isinstance(exc, ArborError):
                log.exception("generation %d failed", request_id)
            self.errored.emit(request_id, describe_error(exc))
            return
        if pending:
            self.token.emit(request_id, "".join(pending))
        if done is None:
            self.errored.emit(request_id, "internal error: the engine ended without statistics")
        elif done.finish_reason == "cancelled":
            self.cancelled.emit(request_id, done)
        else:
            self.finished.emit(request_id, done)


@dataclass
class _Pending:
    cancel: threading.Event
    kind: str  # "load" | "generate"


class InferenceClient(QObject):
    """The GUI thread's handle on the worker: submit, cancel, shut down.

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

    _load_requested = Signal(int, object)
    _generate_requested = Signal(int, object, object)

    def __init__(
        self,
        loader: EngineLoader = load_engine,
        *,
        updates_per_second: float = DEFAULT_UPDATES_PER_SECOND,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.model_info: ModelInfo | None = None
        self._thread = QThread()
        self._thread.setObjectName("arbor-inference")
        self._worker = InferenceWorker(loader, updates_per_second)
        self._worker.moveToThread(self._thread)
        self._thread.finished.connect(self._worker.deleteLater)
        self._load_requested.connect(self._worker.load_model)
        self._generate_requested.connect(self._worker.generate)
        w = self._worker
        w.model_loading.connect(self.model_loading)
        w.model_loaded.connect(self._on_model_loaded)
        w.model_failed.connect(self._on_model_failed)
        w.started.connect(self.started)
        w.token.connect(self.token)
        w.finished.connect(self._on_finished)
        w.cancelled.connect(self._on_cancelled)
        w.errored.connect(self._on_errored)
        self._thread.start()

    # -- commands --------------------------------------------------------------------------------

    def load_model(self, ref: str | None) -> int:
        """Queue loading ``ref`` (None: the default model); returns the request id."""
        request_id = next(self._ids)
        self._pending[request_id] = _Pending(threading.Event(), "load")
        self._load_requested.emit(request_id, ref)
        return request_id

    def generate(self, request: GenerateRequest) -> int:
        """Queue a generation; returns its request id."""
        request_id = next(self._ids)
        cancel = threading.Event()
        self._pending[request_id] = _Pending(cancel, "generate")
        self._generate_requested.emit(request_id, request, cancel)
        return request_id

    def cancel(self, request_id: int) -> None:
        """Stop a generation now (running or queued). Unknown or finished ids are ignored."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.cancel.set()

    def cancel_all(self) -> None:
        for pending in self._pending.values():
            pending.cancel.set()

    def is_pending(self, request_id: int) -> bool:
        return request_id in self._pending

    @property
    def busy(self) -> bool:
        """True while any load or generation is queued or running."""
        return bool(self._pending)

    def shutdown(self, deadline_s: float = 5.0) -> bool:
        """Cancel everything and stop the thread; False if it did not stop within the deadline
        (a model load or one prefill chunk cannot be interrupted)."""
        if not self._thread.isRunning():
            return True
        self.cancel_all()
        self._thread.quit()
        stopped = self._thread.wait(QDeadlineTimer(int(deadline_s * 1000)))
        if stopped:
            self._pending.clear()
        return stopped

    # -- bookkeeping -----------------------------------------------------------------------------

    @Slot(int, object)
    def _on_model_loaded(self, request_id: int, info: ModelInfo) -> None:
        self._pending.pop(request_id, None)
        self.model_info = info
        self.model_loaded.emit(request_id, info)

    @Slot(int, str)
    def _on_model_failed(self, request_id: int, message: str) -> None:
        self._pending.pop(request_id, None)
        self.model_failed.emit(request_id, message)

    @Slot(int, object)
    def _on_finished(self, request_id: int, done: DoneEvent) -> None:
        self._pending.pop(request_id, None)
        self.finished.emit(request_id, done)

    @Slot(int, object)
    def _on_cancelled(self, request_id: int, done: DoneEvent | None) -> None:
        self._pending.pop(request_id, None)
        self.cancelled.emit(request_id, done)

    @Slot(int, str)
    def _on_errored(self, request_id: int, message: str) -> None:
        self._pending.pop(request_id, None)
        self.errored.emit(request_id, message)

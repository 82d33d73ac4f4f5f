"""The one thread that owns the engine: the model loads there and every job runs there, in
the order the jobs arrived (MLX is used from one thread; the engine runs one generation at a
time).

The HTTP side (``backend/server/app.py``) submits a job and gets its results through a
``deliver`` callback that the engine thread calls: every ``TokenEvent``, then one
``DoneEvent``, or one exception instead (an ``ArborError`` for a bad request, ``Cancelled``
when the job was cancelled before it began, ``InternalError`` for a bug). Each generation has a
``threading.Event`` for cancellation, set by the HTTP side when its client goes away (or by
``cancel_all`` at shutdown). A generation is always read to its end, past the ``DoneEvent``:
that is when the engine writes new prefix-cache states to disk.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from backend.api import CacheStats, DoneEvent, GenerateRequest, ModelInfo
from backend.errors import ArborError

log = logging.getLogger("arbor.server")

Deliver = Callable[[Any], None]  # called on the engine thread with each result


class ServedEngine(Protocol):
    """What the server uses of ``backend.engine.Engine``."""

    info: ModelInfo
    tokenizer: Any  # ``encode(text, add_special_tokens)``, ``decode(ids)``

    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None): ...

    def cache_stats(self) -> CacheStats: ...

    def close(self) -> None: ...


class Cancelled(Exception):
    """The job was cancelled before the engine started it (the HTTP side also uses it for a
    generation the engine stopped: only a shutdown cancels one that a client still waits for)."""


class InternalError(Exception):
    """A bug escaped the engine; its traceback is in the server's log, the client gets this
    one line."""


@dataclass(frozen=True)
class QueueCounts:
    """What ``/health`` shows: jobs waiting to run (a cancelled one no longer counts), whether
    one runs, and how generations ended (``rejected``: the request's fault, ``failed``: a bug,
    ``cancelled``: stopped early or never started)."""

    waiting: int
    running: bool
    completed: int
    cancelled: int
    rejected: int
    failed: int


@dataclass(eq=False)
class Job:
    """One unit of work for the engine thread. ``cancel`` stops a generation between prefill
    chunks and decode steps (and skips the job when it is set before the job starts)."""

    run: Callable[[ServedEngine, "Job"], str | None]  # returns the outcome to count, if any
    deliver: Deliver
    cancel: threading.Event = field(default_factory=threading.Event)


class EngineThread:
    """Loads the engine with ``load()`` on its own thread, then runs jobs in order."""

    def __init__(self, load: Callable[[], ServedEngine]) -> None:
        self._load = load
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()  # guards the bookkeeping below
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._counts = dict(completed=0, cancelled=0, rejected=0, failed=0)
        self._closing = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._engine: ServedEngine | None = None
        self.info: ModelInfo | None = None
        self._thread = threading.Thread(target=self._main, name="arbor-engine", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> ModelInfo:
        """Start the thread and wait for the model; raises what loading it raised."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        assert self.info is not None
        return self.info

    def cancel_all(self) -> None:
        """Cancel the running job and every waiting one; new jobs are cancelled at once."""
        with self._lock:
            self._closing = True
            for job in (self._running, *self._waiting):
                if job is not None:
                    job.cancel.set()

    def close(self, timeout_s: float | None = 30.0) -> bool:
        """Cancel everything, let the thread finish (the engine closes there, writing pending
        cache states to disk); False if it was still busy after ``timeout_s``."""
        self.cancel_all()
        if not self._thread.is_alive():
            return True
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def counts(self) -> QueueCounts:
        with self._lock:
            waiting = sum(not job.cancel.is_set() for job in self._waiting)
            return QueueCounts(waiting=waiting, running=self._running is not None,
                               **self._counts)

    # The tokenizer holds no MLX state and Hugging Face tokenizers may be used from any
    # thread, so the HTTP side calls these directly.
    def token_text(self, token_id: int) -> str:
        """One token's text (logprobs)."""
        assert self._engine is not None
        return self._engine.tokenizer.decode([token_id])

    def encode(self, text: str) -> list[int]:
        """A raw completion prompt's ids, with the special tokens the tokenizer adds (bos)."""
        assert self._engine is not None
        return self._engine.tokenizer.encode(text, add_special_tokens=True)

    # -- jobs -----------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._closing:
                job.cancel.set()
            self._waiting.append(job)
        self._jobs.put(job)
        return job

    def generate(self, request: GenerateRequest, deliver: Deliver) -> Job:
        """Queue a generation; ``deliver`` gets its events (see the module docstring)."""
        return self.submit(Job(lambda engine, job: _generate(engine, request, job), deliver))

    def call(self, function: Callable[[ServedEngine], Any], deliver: Deliver) -> Job:
        """Queue ``function(engine)`` between generations; ``deliver`` gets its result (or the
        exception it raised)."""
        def run(engine: ServedEngine, job: Job) -> None:
            try:
                job.deliver(function(engine))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                job.deliver(exc)
        return self.submit(Job(run, deliver))

    # -- the thread -----------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = self._load()
            self.info = engine.info
            self._engine = engine
        except BaseException as exc:  # noqa: BLE001 - re-raised by start() on the caller's thread
            self._load_error = exc
            return
        finally:
            self._ready.set()
        try:
            while (job := self._jobs.get()) is not None:
                with self._lock:
                    self._waiting.remove(job)
                    self._running = job
                outcome = None
                try:
                    outcome = job.run(engine, job)
                finally:
                    with self._lock:
                        self._running = None
                        if outcome is not None:
                            self._counts[outcome] += 1
        finally:
            for job in list(self._waiting):  # only after close(): nobody waits for these
                job.deliver(Cancelled("the server is shutting down"))
            engine.close()


def _generate(engine: ServedEngine, request: GenerateRequest, job: Job) -> str:
    """Run one generation to its very end; returns its outcome for the counters."""
    if job.cancel.is_set():  # its client left (or the server is stopping) while it waited
        job.deliver(Cancelled("cancelled before it started"))
        return "cancelled"
    outcome = None  # known once the DoneEvent is out
    try:
        for event in engine.generate(request, job.cancel):
            if isinstance(event, DoneEvent):
                outcome = "cancelled" if event.finish_reason == "cancelled" else "completed"
            job.deliver(event)
        if outcome is None:
            raise RuntimeError("the generation ended without a DoneEvent")
    except Exception as exc:  # noqa: BLE001 - every failure goes to the client as one line
        if outcome is not None:  # while writing states to disk: the client has its answer
            log.exception("after a generation")
            return outcome
        if isinstance(exc, ArborError):
            job.deliver(exc)
            return "rejected"
        log.exception("generation failed")  # a bug: the traceback goes to the server's log
        job.deliver(InternalError(" ".join(f"{type(exc).__name__}: {exc}".split())))
        return "failed"
    return outcome

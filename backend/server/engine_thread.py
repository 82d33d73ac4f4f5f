"""The one thread that owns the engine: the model loads there and every job runs there (MLX is
used from one thread). Generations run together: each is submitted to the engine's scheduler
as it arrives (up to the engine's ``max_batch`` at once, the rest queued there in arrival
order) and the thread steps the engine while any runs, handing each request its events as
they come; other jobs (``call``) run between steps.

The HTTP side (``backend/server/app.py``) submits a job and gets its results through a
``deliver`` callback that the engine thread calls: every ``TokenEvent``, then one
``DoneEvent``, or one exception instead (an ``ArborError`` for a bad request, ``Cancelled``
when the job was cancelled before it began, ``InternalError`` for a bug). Each generation has a
``threading.Event`` for cancellation, set by the HTTP side when its client goes away (or by
``cancel_all`` at shutdown). A generation is always read to its end, past the ``DoneEvent``:
the engine writes new prefix-cache states to disk once nothing runs.
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

    def submit(self, request: GenerateRequest, cancel: threading.Event | None = None): ...

    def step(self) -> bool: ...

    def stop(self, stream) -> None: ...

    def activity(self) -> tuple[int, int, int]: ...

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
    """What ``/health`` shows: generations waiting for a place in the batch (a cancelled one no
    longer counts), whether any runs, how many generate and of them still prefill, and how
    generations ended (``rejected``: the request's fault, ``failed``: a bug, ``cancelled``:
    stopped early or never started)."""

    waiting: int
    running: bool
    completed: int
    cancelled: int
    rejected: int
    failed: int
    active: int = 0
    prefilling: int = 0


@dataclass(eq=False)
class Job:
    """One unit of work for the engine thread: a generation (``request``) or a ``call``.
    ``cancel`` stops a generation between prefill chunks and decode steps (and skips it when it
    is set before it starts)."""

    deliver: Deliver
    request: GenerateRequest | None = None
    function: Callable[[ServedEngine], Any] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    stream: Any = None  # the engine's Stream, once submitted
    outcome: str | None = None  # known once its DoneEvent is out


class EngineThread:
    """Loads the engine with ``load()`` on its own thread, then runs jobs (module docstring)."""

    def __init__(self, load: Callable[[], ServedEngine]) -> None:
        self._load = load
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()  # guards the bookkeeping below
        self._queued: deque[Job] = deque()  # handed over, not yet taken by the thread
        self._active: list[Job] = []  # generations submitted to the engine
        self._activity = (0, 0, 0)  # the engine's (running, prefilling, waiting) after a step
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
        """Cancel every generation, running or waiting; new jobs are cancelled at once."""
        with self._lock:
            self._closing = True
            for job in (*self._active, *self._queued):
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
            queued = sum(job.request is not None and not job.cancel.is_set()
                         for job in self._queued)
            waiting_in_engine = sum(job.stream is not None and job.stream.waiting
                                    and not job.cancel.is_set() for job in self._active)
            running, prefilling, _ = self._activity
            return QueueCounts(waiting=queued + waiting_in_engine, running=running > 0,
                               active=running, prefilling=prefilling, **self._counts)

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
            self._queued.append(job)
        self._jobs.put(job)
        return job

    def generate(self, request: GenerateRequest, deliver: Deliver) -> Job:
        """Queue a generation; ``deliver`` gets its events (see the module docstring)."""
        return self.submit(Job(deliver, request=request))

    def call(self, function: Callable[[ServedEngine], Any], deliver: Deliver) -> Job:
        """Queue ``function(engine)`` between steps; ``deliver`` gets its result (or the
        exception it raised)."""
        return self.submit(Job(deliver, function=function))

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
            while self._take_jobs(engine):
                if self._active:
                    try:
                        engine.step()
                    finally:
                        self._after_step(engine)
        finally:
            with self._lock:
                left = list(self._queued) + [j for j in self._active if j.outcome is None]
            for job in left:  # only after close(): nobody waits for these
                if job.request is not None and job.outcome is None:
                    job.deliver(Cancelled("the server is shutting down"))
            engine.close()

    def _take_jobs(self, engine: ServedEngine) -> bool:
        """Start the jobs that arrived (waiting for one while nothing runs); False on close."""
        block = not self._active
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return True
            block = False
            if job is None:
                return False
            with self._lock:
                self._queued.remove(job)
            if job.function is not None:
                try:
                    job.deliver(job.function(engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    job.deliver(exc)
            else:
                self._start(engine, job)

    def _start(self, engine: ServedEngine, job: Job) -> None:
        if job.cancel.is_set():  # its client left (or the server is stopping) while it waited
            job.deliver(Cancelled("cancelled before it started"))
            self._count("cancelled")
            return
        try:
            job.stream = engine.submit(job.request, job.cancel)
        except Exception as exc:  # noqa: BLE001 - the request's error goes to its client
            self._fail(job, exc)
            return
        with self._lock:
            self._active.append(job)

    def _after_step(self, engine: ServedEngine) -> None:
        """Hand each request its new events; retire the finished ones."""
        for job in list(self._active):
            stream = job.stream
            if stream.waiting and job.cancel.is_set():  # left while queued in the engine
                engine.stop(stream)
                with self._lock:
                    self._active.remove(job)
                job.deliver(Cancelled("cancelled before it started"))
                self._count("cancelled")
                continue
            while stream.events:
                event = stream.events.popleft()
                if isinstance(event, DoneEvent):
                    job.outcome = ("cancelled" if event.finish_reason == "cancelled"
                                   else "completed")
                job.deliver(event)
            if stream.error is not None or stream.done:
                self._retire(job, stream.error)
        with self._lock:
            self._activity = engine.activity()

    def _retire(self, job: Job, error: BaseException | None) -> None:
        with self._lock:
            self._active.remove(job)
        if error is None and job.outcome is None:
            error = RuntimeError("the generation ended without a DoneEvent")
        if error is not None and job.outcome is not None:  # the client has its answer
            log.error("after a generation", exc_info=error)
            error = None
        if error is None:
            self._count(job.outcome)
        else:
            self._fail(job, error)

    def _fail(self, job: Job, error: BaseException) -> None:
        if isinstance(error, ArborError):
            job.deliver(error)
            self._count("rejected")
        else:  # a bug: the traceback goes to the server's log, the client gets one line
            log.error("generation failed", exc_info=error)
            job.deliver(InternalError(" ".join(f"{type(error).__name__}: {error}".split())))
            self._count("failed")

    def _count(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

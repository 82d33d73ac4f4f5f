"""Desktop test helpers: engines over the tiny random model whose tokens wait at a gate the test
controls, so a test can act while a reply is still streaming whatever this machine's speed."""

from __future__ import annotations

import threading
from typing import Callable

import pytest

from backend.api import GenerateRequest, ModelInfo, TokenEvent
from backend.scheduler import Stream

# How often a held token looks at its request's cancel event (an Event cannot wake a Condition).
_CANCEL_POLL_S = 0.01


class GatedEngine:
    """A real engine (model, tokenizer, sampling, cancellation, batching) whose token events
    pass a gate on their way out of ``step``.

    ``allowance`` is how many tokens may pass before the gate holds the next one: ``None`` (the
    default) never holds. ``release(n)`` lets ``n`` more through, ``open()`` all of them,
    ``hold()`` holds the next. A held token keeps its request paused (the engine waits until
    its events are taken) while other requests go on; it passes as soon as its request is
    cancelled, so that stopping a reply (or shutting down) never waits for the test.
    ``waiting`` is True while a token is held; ``passed`` counts the tokens let through and
    ``texts`` holds their text.
    """

    def __init__(self, engine, allowance: int | None = None) -> None:
        self._engine = engine
        self._changed = threading.Condition()
        self._allowance = allowance
        self._streams: list[tuple] = []  # (inner stream, outer stream, cancel)
        self._held = 0  # streams whose next event is a held token
        self.waiting = False
        self.passed = 0
        self.texts: list[str] = []
        self.requests: list[GenerateRequest] = []
        self.prefetched_while: list[int] = []  # per prefetch, how many replies were generating
        self.prefetch_gate = threading.Event()
        self.prefetch_gate.set()

    @property
    def info(self) -> ModelInfo:
        return self._engine.info

    def __getattr__(self, name: str):  # prefetch, cache_stats, budgets, close: the real engine's
        return getattr(self.__dict__["_engine"], name)

    def release(self, n: int = 1) -> None:
        with self._changed:
            if self._allowance is not None:
                self._allowance += n
            self._changed.notify_all()

    def open(self) -> None:
        with self._changed:
            self._allowance = None
            self._changed.notify_all()

    def hold(self) -> None:
        with self._changed:
            self._allowance = 0

    def held(self) -> bool:
        """A token waits at the gate and nothing has been released for it yet."""
        with self._changed:
            return self.waiting and self._allowance == 0

    def prefetch(self, *args, **kwargs) -> int:
        """The real prefetch, once ``prefetch_gate`` is set (a test clears it to make a prefetch
        as slow as a cold disk) or the prefetch is cancelled."""
        self.prefetched_while.append(self._engine.activity()[0])
        cancel = kwargs.get("cancel")
        while not self.prefetch_gate.wait(_CANCEL_POLL_S):
            if cancel is not None and cancel.is_set():
                break
        return self._engine.prefetch(*args, **kwargs)

    def submit(self, request: GenerateRequest, cancel: threading.Event | None = None):
        self.requests.append(request)
        inner = self._engine.submit(request, cancel)
        outer = Stream()
        self._streams.append((inner, outer, cancel))
        return outer

    def step(self) -> bool:
        with self._changed:
            if self._streams and self._held == len(self._streams) and self._allowance == 0:
                self._changed.wait(_CANCEL_POLL_S)  # nothing can move: do not spin
        busy = self._engine.step()
        self._relay()
        return busy or bool(self._streams)

    def stop(self, outer) -> None:
        for entry in list(self._streams):
            if entry[1] is outer:
                self._engine.stop(entry[0])
                self._streams.remove(entry)
        outer.done = True

    def _relay(self) -> None:
        with self._changed:
            held = 0
            for entry in list(self._streams):
                inner, outer, cancel = entry
                outer.waiting = inner.waiting
                while inner.events:
                    if isinstance(inner.events[0], TokenEvent):
                        if self._allowance == 0 and not (cancel is not None and cancel.is_set()):
                            held += 1
                            break
                        if self._allowance:
                            self._allowance -= 1
                        self.passed += 1
                        self.texts.append(inner.events[0].text)
                        self._streams.remove(entry)  # the others' tokens pass first next time
                        self._streams.append(entry)
                    outer.events.append(inner.events.popleft())
                outer.error = inner.error
                if inner.error is not None or (inner.done and not inner.events):
                    outer.done = True
                    if entry in self._streams:
                        self._streams.remove(entry)
            self._held = held
            self.waiting = held > 0


def stream_until(qtbot, engine: GatedEngine, condition: Callable[[], bool], timeout: int = 20000) -> None:
    """Let a closed gate's tokens through one at a time until ``condition()`` holds; the gate
    stays closed afterwards, so the reply is still streaming when this returns."""

    def step() -> bool:
        if condition():
            return True
        if engine.held():
            engine.release(1)
        return False

    qtbot.waitUntil(step, timeout=timeout)


@pytest.fixture
def tiny_folder(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture
def make_loader(tiny_folder):
    """``make_loader(allowance=None, max_batch=1)``: a worker loader giving a fresh real engine
    over the tiny model behind a gate (``GatedEngine``; ``allowance=0`` holds the first token
    until the test releases it; ``max_batch``: replies generating at once, 1 keeps the others
    queued); the engines it made are in ``loader.engines``."""

    def make(allowance: int | None = None, max_batch: int = 1):
        from backend.engine import Engine

        engines: list[GatedEngine] = []

        def loader(ref):
            if ref not in (None, "tiny", str(tiny_folder)):
                return Engine.load(ref)
            engine = GatedEngine(Engine.load(str(tiny_folder), max_batch=max_batch), allowance)
            engines.append(engine)
            return engine

        loader.engines = engines
        return loader

    return make

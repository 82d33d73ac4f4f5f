"""Desktop test helpers: engines over the tiny random model whose tokens wait at a gate the test
controls, so a test can act while a reply is still streaming whatever this machine's speed."""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import pytest

from backend.api import DoneEvent, GenerateRequest, ModelInfo, TokenEvent

# How often a held token looks at its request's cancel event (an Event cannot wake a Condition).
_CANCEL_POLL_S = 0.01


class GatedEngine:
    """A real engine (model, tokenizer, sampling, cancellation) whose token events pass a gate.

    ``allowance`` is how many tokens may pass before the gate holds the next one: ``None`` (the
    default) never holds. ``release(n)`` lets ``n`` more through, ``open()`` all of them,
    ``hold()`` holds the next. A held token also passes as soon as its request is cancelled, so
    that stopping a reply (or shutting down) never waits for the test. ``waiting`` is True while
    a token is held; ``passed`` counts the tokens let through and ``texts`` holds their text.
    """

    def __init__(self, engine, allowance: int | None = None) -> None:
        self._engine = engine
        self._changed = threading.Condition()
        self._allowance = allowance
        self.waiting = False
        self.passed = 0
        self.texts: list[str] = []
        self.requests: list[GenerateRequest] = []

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

    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None
                 ) -> Iterator[TokenEvent | DoneEvent]:
        self.requests.append(request)
        for event in self._engine.generate(request, cancel):
            if isinstance(event, TokenEvent):
                self._pass(cancel)
                self.texts.append(event.text)
            yield event

    def _pass(self, cancel: threading.Event | None) -> None:
        with self._changed:
            self.waiting = True
            while self._allowance == 0 and not (cancel is not None and cancel.is_set()):
                self._changed.wait(_CANCEL_POLL_S)
            if self._allowance:
                self._allowance -= 1
            self.waiting = False
            self.passed += 1


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
    """``make_loader(allowance=None)``: a worker loader giving a fresh real engine over the tiny
    model behind a gate (``GatedEngine``; ``allowance=0`` holds the first token until the test
    releases it); the engines it made are in ``loader.engines``."""

    def make(allowance: int | None = None):
        from backend.engine import Engine

        engines: list[GatedEngine] = []

        def loader(ref):
            if ref not in (None, "tiny", str(tiny_folder)):
                return Engine.load(ref)
            engine = GatedEngine(Engine.load(str(tiny_folder)), allowance)
            engines.append(engine)
            return engine

        loader.engines = engines
        return loader

    return make

"""Desktop test helpers: engines over the tiny random model, paced so tests can act mid-reply."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

from backend.api import DoneEvent, GenerateRequest, ModelInfo, TokenEvent


class PacedEngine:
    """A real engine whose token stream is slowed to ``delay_s`` per token (on the worker
    thread), so a test can stop, switch or branch while a reply is still streaming. The model,
    tokenizer, sampling and cancellation are all the real engine's."""

    def __init__(self, engine, delay_s: float) -> None:
        self._engine = engine
        self.delay_s = delay_s
        self.requests: list[GenerateRequest] = []

    @property
    def info(self) -> ModelInfo:
        return self._engine.info

    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None
                 ) -> Iterator[TokenEvent | DoneEvent]:
        self.requests.append(request)
        for event in self._engine.generate(request, cancel):
            if isinstance(event, TokenEvent) and self.delay_s:
                time.sleep(self.delay_s)
            yield event


@pytest.fixture
def tiny_folder(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture
def make_loader(tiny_folder):
    """``make_loader(delay_s)``: a worker loader giving a fresh real engine over the tiny model,
    paced by ``delay_s`` per token; the engines it made are in ``loader.engines``."""

    def make(delay_s: float = 0.0):
        from backend.engine import Engine

        engines: list[PacedEngine] = []

        def loader(ref):
            if ref not in (None, "tiny", str(tiny_folder)):
                return Engine.load(ref)
            engine = PacedEngine(Engine.load(str(tiny_folder)), delay_s)
            engines.append(engine)
            return engine

        loader.engines = engines
        return loader

    return make

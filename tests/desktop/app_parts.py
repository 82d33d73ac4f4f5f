"""The real app offscreen over the tiny real model, as fixtures (import them into a test module).

``app(db, load_model=True)`` builds the window with ``create_app`` on a given store file, shows
it and waits for the model (or for its failure): for tests that are not about chatting itself.
``launch(allowance=None, db=None, defaults=TEST_DEFAULTS, theme="light", max_batch=1)`` does the same for
chatting tests, with seeded default settings and the engine behind a gate (``parts.engine``;
``allowance=0`` holds every token until the test lets it through: ``stream_until``,
``parts.engine.open()``). Every app they made is closed and shut down after the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from desktop.app import AppParts, create_app
from desktop.chat_settings import ChatSettings
from desktop.store import ChatStore

# Seeded: the tiny random model may end a reply at once for some seeds; a fixed seed keeps every
# test's replies the same on every run.
TEST_DEFAULTS = ChatSettings(temperature=1.0, top_p=1.0, min_p=0.0, max_tokens=40, seed=7)


def close(made: list[AppParts]) -> None:
    for parts in made:
        if parts.store._db is not None:
            parts.window.close()
            assert parts.shutdown(5.0)
        parts.theme.deleteLater()


@pytest.fixture
def launch(qtbot, make_loader, tmp_path):
    made: list[AppParts] = []

    def start(allowance: int | None = None, db=None, defaults: ChatSettings | None = TEST_DEFAULTS,
              theme="light", max_batch: int = 1) -> AppParts:
        store = ChatStore(db or tmp_path / "chats.sqlite3")
        if defaults is not None:
            store.set_default_settings(defaults)
        loader = make_loader(allowance, max_batch)
        parts = create_app("tiny", loader=loader, store=store, theme=theme)
        parts.loader = loader
        made.append(parts)
        parts.window.show()
        qtbot.waitExposed(parts.window)
        qtbot.waitUntil(lambda: parts.window.controller.model_info is not None, timeout=20000)
        parts.engine = loader.engines[-1]
        return parts

    yield start
    close(made)


@pytest.fixture
def app(qtbot, make_loader):
    made: list[AppParts] = []

    def start(db: Path, *, model: str = "tiny", wait_for_model: bool = True) -> AppParts:
        parts = create_app(model, loader=make_loader(), store=ChatStore(db))
        made.append(parts)
        # The load's outcome, whichever it is. (Its signals cross threads queued, so none is
        # handled before the event loop runs below. ``client.busy`` turns False one queued
        # event before the outcome is handled: waiting on it alone can see no model yet.)
        ended: list[bool] = []
        parts.window.controller.model_loaded.connect(lambda *_: ended.append(True))
        parts.window.controller.model_failed.connect(lambda *_: ended.append(False))
        parts.window.show()
        qtbot.waitExposed(parts.window)
        if wait_for_model:
            qtbot.waitUntil(lambda: bool(ended) and not parts.client.busy, timeout=20000)
        return parts

    yield start
    close(made)


def reply_settled(window, question: str) -> bool:
    """The reply to ``question`` is stored as ended. (``client.busy`` alone turns False one
    queued event before the reply's last signal is handled.)"""
    path = window.store.path(window.current_id)
    return (not window.client.busy and len(path) >= 2 and path[-2].message.content == question
            and path[-1].message.status != "streaming")

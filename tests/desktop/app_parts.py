"""The real app offscreen on a given store file, for tests that are not about chatting itself.

``app`` is a fixture (import it into a test module): ``app(db, load_model=True)`` builds the
window with ``create_app`` over the tiny real model, shows it and waits for the model (or for
its failure); every app it made is closed and shut down after the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from desktop.app import AppParts, create_app
from desktop.store import ChatStore


@pytest.fixture
def app(qtbot, make_loader):
    made: list[AppParts] = []

    def start(db: Path, *, model: str = "tiny", wait_for_model: bool = True) -> AppParts:
        parts = create_app(model, loader=make_loader(), store=ChatStore(db))
        made.append(parts)
        parts.window.show()
        qtbot.waitExposed(parts.window)
        if wait_for_model:
            qtbot.waitUntil(lambda: not parts.client.busy, timeout=20000)
        return parts

    yield start
    for parts in made:
        if parts.store._db is not None:
            parts.window.close()
            assert parts.shutdown(5.0)
        parts.theme.deleteLater()


def reply_settled(window, question: str) -> bool:
    """The reply to ``question`` is stored as ended. (``client.busy`` alone turns False one
    queued event before the reply's last signal is handled.)"""
    path = window.store.path(window.current_id)
    return (not window.client.busy and len(path) >= 2 and path[-2].message.content == question
            and path[-1].message.status != "streaming")

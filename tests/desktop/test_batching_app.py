"""Replies in several chats at once, in the real window offscreen with the real tiny model and
a batching engine: two chats stream together, Stop in one leaves the other streaming to its end,
a chat opened meanwhile is prefetched while they stream, and each stored reply equals what its
request gives alone."""

from __future__ import annotations

from PySide6.QtCore import Qt

from backend.api import DoneEvent, TokenEvent
from backend.engine import Engine
from tests.desktop.app_parts import launch  # noqa: F401 (a fixture)
from tests.desktop.conftest import stream_until


def send(qtbot, window, text: str) -> None:
    window.composer.input.setPlainText(text)
    qtbot.mouseClick(window.composer.send_button, Qt.MouseButton.LeftButton)


def last_reply(window, conversation_id: int):
    return window.store.path(conversation_id)[-1].message


def solo_text(folder, request) -> tuple[str, list[int]]:
    """The request alone on a fresh engine: its reply text and token ids."""
    events = list(Engine.load(str(folder)).generate(request))
    done = [e for e in events if isinstance(e, DoneEvent)][0]
    return done.text, [e.token_id for e in events if isinstance(e, TokenEvent)]


def test_two_chats_stream_at_once_and_stop_ends_only_its_own(qtbot, launch, tiny_folder):
    parts = launch(allowance=0, max_batch=4)
    w, engine = parts.window, parts.engine
    # An earlier chat with a stored state, to open while the others stream.
    send(qtbot, w, "Chat C: an earlier question")
    c = w.current_id
    engine.open()
    qtbot.waitUntil(lambda: last_reply(w, c).status == "complete", timeout=30000)
    engine.hold()

    w.new_chat()
    send(qtbot, w, "Chat A: tell me a long story")
    a = w.current_id
    w.new_chat()
    send(qtbot, w, "Chat B: and a poem")
    b = w.current_id
    # Both stream at once: each has text on screen while the other is still generating.
    stream_until(qtbot, engine, lambda: all(
        w.controller.live_text(last_reply(w, x).id) for x in (a, b)))
    assert engine.activity()[0] == 2
    assert w.controller.activity(a) == w.controller.activity(b) == "generating"

    w.open_conversation(c)  # prefetched between the two replies' steps
    qtbot.waitUntil(lambda: bool(engine.prefetched_while), timeout=30000)
    assert engine.prefetched_while[-1] == 2

    w.controller.stop(a)
    qtbot.waitUntil(lambda: last_reply(w, a).status != "streaming", timeout=30000)
    assert w.controller.activity(b) == "generating"  # B goes on after A stopped
    engine.open()
    qtbot.waitUntil(lambda: last_reply(w, b).status == "complete", timeout=30000)

    request_a, request_b = engine.requests[1], engine.requests[2]
    stopped, full = last_reply(w, a), last_reply(w, b)
    want_b, _ = solo_text(tiny_folder, request_b)
    want_a, _ = solo_text(tiny_folder, request_a)
    assert full.content == want_b
    assert stopped.content and want_a.startswith(stopped.content) and stopped.content != want_a

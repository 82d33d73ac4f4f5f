"""The app as a daily driver, in the real window offscreen with the real tiny model: a reply
queued behind another chat's says so (sidebar and message) and its statistics count the wait;
each chat keeps its half-typed message; titles are the user's first message unless they opt in
to model titles, which never replace one they typed; a reply that stopped early (its token limit,
or Stop) goes on in the same message with Continue; the drafting setting offers only what the
loaded model can do; the window's size and sidebar width come back after a restart; the model
manager closes with a button."""

from __future__ import annotations

import time

import pytest
from PySide6.QtCore import Qt

from desktop.chat_settings import ChatSettings
from desktop.titles import TITLE_MAX_TOKENS
from desktop.ui.conversation_list_model import ActivityRole
from tests.desktop.app_parts import launch  # noqa: F401 (a fixture, used by open_app)
from tests.desktop.conftest import stream_until

SETTINGS = ChatSettings(temperature=1.0, top_p=1.0, min_p=0.0, max_tokens=24, seed=7)


@pytest.fixture
def open_app(launch):
    """The shared ``launch`` (``tests/desktop/app_parts.py``) with these tests' defaults."""
    return lambda allowance=None, db=None: launch(allowance, db, defaults=SETTINGS)


def send(qtbot, window, text: str) -> None:
    window.composer.input.setPlainText(text)
    qtbot.mouseClick(window.composer.send_button, Qt.MouseButton.LeftButton)


def idle(window) -> bool:
    path = window.store.path(window.current_id) if window.current_id is not None else []
    return not window.client.busy and all(p.message.status != "streaming" for p in path)


def row_activity(window, conversation_id: int) -> str:
    model = window.conversations
    return model.data(model.index(model.row_of(conversation_id)), ActivityRole)


def test_a_reply_queued_behind_another_chat_says_so_and_counts_the_wait(qtbot, open_app):
    parts = open_app(allowance=0)
    w = parts.window
    send(qtbot, w, "Chat A: tell me a story")
    a = w.current_id
    stream_until(qtbot, parts.engine, lambda: bool(w.controller.live_text(w.store.path(a)[-1].message.id)))
    assert row_activity(w, a) == "generating"
    seen: list[str] = []  # chat B's sidebar states, in the order they were shown
    w.conversations.dataChanged.connect(
        lambda *_: b is not None and w.conversations.row_of(b) is not None
        and (row_activity(w, b) or "") not in seen[-1:] and seen.append(row_activity(w, b) or ""))

    b = None
    w.new_chat()
    send(qtbot, w, "Chat B: and a poem")
    b = w.current_id
    sent = time.monotonic()  # B was sent before this
    assert row_activity(w, b) == "queued" and row_activity(w, a) == "generating"
    seen.append("queued")
    widget = w.chat_view.message_widgets()[-1]
    assert widget.note.text() == "queued"
    assert widget.detail_text() == "Waiting for the reply in “Chat A: tell me a story” to finish…"
    stream_until(qtbot, parts.engine, lambda: len(w.controller.live_text(w.store.path(a)[-1].message.id)) > 10)
    still_queued = time.monotonic()  # B is still waiting here, while A streams
    assert row_activity(w, b) == "queued" and w.controller.waiting_for(b)
    parts.engine.open()
    qtbot.waitUntil(lambda: idle(w), timeout=30000)

    assert seen[:3] == ["queued", "generating", ""]  # then nothing: it ended
    assert row_activity(w, a) == "" and row_activity(w, b) == ""
    stats = w.store.path(b)[-1].message.stats
    # The wait is stored apart, and the time to first token counts from the send: it holds the
    # wait (at least as long as the test saw B queued) and the model's own time to first token.
    assert stats["queue_s"] >= still_queued - sent > 0
    assert stats["ttft_s"] > stats["queue_s"]
    line = w.chat_view.message_widgets()[-1].stats_label.text()
    assert line.startswith(f"{stats['ttft_s']:.2f} s to first token ({stats['queue_s']:.2f} s waiting)")


def test_each_chat_keeps_its_half_typed_message_also_after_a_restart(qtbot, open_app, tmp_path):
    db = tmp_path / "drafts.sqlite3"
    parts = open_app(db=db)
    w = parts.window
    send(qtbot, w, "first chat")
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    a = w.current_id
    w.new_chat()
    send(qtbot, w, "second chat")
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    b = w.current_id
    qtbot.keyClicks(w.composer.input, "half a thought for B")
    w.open_conversation(a)
    assert w.composer.input.toPlainText() == ""  # B's words stay with B
    qtbot.keyClicks(w.composer.input, "something for A")
    w.new_chat()
    assert w.composer.input.toPlainText() == ""
    w.open_conversation(b)
    assert w.composer.input.toPlainText() == "half a thought for B"
    w.open_conversation(a)
    assert w.composer.input.toPlainText() == "something for A"
    qtbot.mouseClick(w.composer.send_button, Qt.MouseButton.LeftButton)  # sent: A's draft is gone
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    assert w.composer.input.toPlainText() == ""
    w.open_conversation(b)
    w.close()
    assert parts.shutdown(5.0)

    w = open_app(db=db).window
    assert w.current_id == b and w.composer.input.toPlainText() == "half a thought for B"
    w.open_conversation(a)
    assert w.composer.input.toPlainText() == ""


def title_requests(engine) -> list:
    return [r for r in engine.requests if r.max_tokens == TITLE_MAX_TOKENS and r.sampling.temperature == 0.0]


def test_titles_are_the_first_message_unless_model_titles_are_chosen(qtbot, open_app):
    parts = open_app()
    w = parts.window
    assert not w.model_titles_action.isChecked()
    send(qtbot, w, "How do I   reverse a list in Python?")
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    assert w.store.conversation(w.current_id).title == "How do I reverse a list in Python?"
    assert title_requests(parts.engine) == []  # the model was never asked for one

    w.model_titles_action.trigger()  # opt in
    assert w.store.app_setting("auto_title_with_model") is True
    w.new_chat()
    send(qtbot, w, "Tell me about gardens")
    qtbot.waitUntil(lambda: idle(w) and len(title_requests(parts.engine)) == 1, timeout=30000)
    # A title the user typed is never replaced, even with model titles on.
    parts.engine.hold()
    w.new_chat()
    send(qtbot, w, "What is a river?")
    w.rename_conversation(w.current_id, "My rivers")
    parts.engine.open()
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    assert w.store.conversation(w.current_id).title == "My rivers"
    assert len(title_requests(parts.engine)) == 1


def test_drafting_choices_are_what_the_loaded_model_can_do(qtbot, open_app):
    parts = open_app()
    w = parts.window
    assert w.controller.model_info.drafters == ()  # the tiny model alone: no pair, no head
    send(qtbot, w, "hello")
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    # A chat whose stored choice this model cannot do (set with another model, or imported).
    w.store.set_settings(w.current_id, ChatSettings(**{**SETTINGS.to_dict(), "speculation": "model"}))
    dialog = w.open_chat_settings()
    items = dialog.speculation.model()
    offered = {dialog.speculation.itemData(i): items.item(i).isEnabled() for i in range(dialog.speculation.count())}
    assert offered == {"auto": True, "model": False, "mtp": False, "lookup": True, "none": True}
    assert dialog.speculation.currentData() == "auto"
    name = w.controller.model_info.name
    assert f"{name} has no paired draft model" in dialog.speculation_note.text()
    assert "no multi-token-prediction head" in dialog.speculation_note.text()
    assert dialog.speculation_note.isVisibleTo(dialog)
    dialog.reject()
    send(qtbot, w, "and again")  # the reply comes (drafting never changes it), not an error
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    reply = w.store.path(w.current_id)[-1].message
    assert reply.status == "complete" and parts.engine.requests[-1].draft == "auto"


def test_window_size_and_sidebar_width_come_back_after_a_restart(qtbot, open_app, tmp_path):
    db = tmp_path / "geometry.sqlite3"
    parts = open_app(db=db)
    w = parts.window
    # (Within the offscreen platform's screen, which restoring a geometry keeps a window on.)
    w.resize(760, 560)
    qtbot.waitUntil(lambda: w.width() == 760 and w.height() == 560)
    w.splitter.moveSplitter(220, 1)  # as a drag does
    sizes = w.splitter.sizes()
    assert sizes[0] == 220 and w.sidebar_width == 220
    w.close()
    assert parts.shutdown(5.0)

    w = open_app(db=db).window
    qtbot.waitUntil(lambda: (w.width(), w.height()) == (760, 560), timeout=5000)
    assert w.splitter.sizes() == sizes
    # A small window narrows the sidebar first, never below its minimum; a wide one gives it
    # back its width.
    w.resize(700, 500)
    qtbot.waitUntil(lambda: w.width() == 700)
    assert 180 <= w.sidebar.width() < 220
    w.resize(500, 400)
    qtbot.waitUntil(lambda: w.width() == max(500, w.minimumSizeHint().width()))
    assert w.sidebar.width() == 180
    w.resize(780, 560)
    qtbot.waitUntil(lambda: w.splitter.sizes()[0] == 220)
    manager = w.open_model_manager()
    assert manager.isVisible()
    qtbot.mouseClick(manager.close_button, Qt.MouseButton.LeftButton)
    assert not manager.isVisible()


def test_continue_writes_on_from_a_reply_that_hit_its_token_limit(qtbot, open_app):
    parts = open_app()
    w = parts.window
    w.store.set_default_settings(ChatSettings(**{**SETTINGS.to_dict(), "max_tokens": 6}))
    send(qtbot, w, "Tell me a long story about a lantern.")
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    [_, reply] = w.store.path(w.current_id)
    if reply.message.stats["finish_reason"] != "length":
        pytest.fail("the seeded reply ended before its limit; pick another seed")
    widget = w.chat_view.message_widgets()[-1]
    assert widget.limit_label.isVisible() and widget.continue_button.isVisible()
    qtbot.mouseClick(widget.continue_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    [_, after] = w.store.path(w.current_id)
    assert after.message.id == reply.message.id and after.sibling_count == 1  # the same message, longer
    assert after.message.content.startswith(reply.message.content)
    assert len(after.message.content) > len(reply.message.content)
    assert after.message.stats["generated_tokens"] > reply.message.stats["generated_tokens"]
    request = parts.engine.requests[-1]
    assert request.continue_reply and request.messages[-1] == {"role": "assistant", "content": reply.message.content}
    # Only the last reply of a branch can go on: an earlier one shows no Continue.
    send(qtbot, w, "and then?")
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    assert not w.chat_view.message_widgets()[1].continue_button.isVisible()
    assert w.controller.continue_reply(reply.message.id) is None


def test_continue_writes_on_from_a_reply_the_user_stopped(qtbot, open_app):
    parts = open_app(allowance=0)
    w = parts.window
    w.store.set_default_settings(ChatSettings(**{**SETTINGS.to_dict(), "max_tokens": 200}))
    send(qtbot, w, "Tell me a long story about a lantern.")
    stream_until(qtbot, parts.engine, lambda: len(w.chat_view.message_widgets()) == 2
                 and len(w.chat_view.message_widgets()[1].item.message.content) > 3)
    with qtbot.waitSignal(w.controller.reply_ended, timeout=20000):
        qtbot.mouseClick(w.composer.stop_button, Qt.MouseButton.LeftButton)
    [_, reply] = w.store.path(w.current_id)
    assert reply.message.status == "cancelled"
    widget = w.chat_view.message_widgets()[-1]
    assert widget.continue_button.isVisible() and not widget.limit_label.isVisible()  # stopped, not limited
    parts.engine.open()
    qtbot.mouseClick(widget.continue_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    [_, after] = w.store.path(w.current_id)
    assert after.message.id == reply.message.id and after.sibling_count == 1  # the same message, longer
    assert after.message.status == "complete"
    assert after.message.content.startswith(reply.message.content)
    assert len(after.message.content) > len(reply.message.content)
    if after.message.stats["finish_reason"] != "length":  # it ended by itself: nothing to go on from
        assert not w.chat_view.message_widgets()[-1].continue_button.isVisible()


def test_scrolling_up_reveals_earlier_messages_without_moving_the_view(qtbot, open_app, tmp_path):
    from desktop.ui.chat_view import REVEAL_STEP, WINDOW

    parts = open_app()
    w = parts.window
    turns = [("user" if i % 2 == 0 else "assistant", f"message number {i}") for i in range(WINDOW + 2 * REVEAL_STEP)]
    w.store.insert_many([("A long history", turns)])
    [summary] = [s for s in w.store.list_conversations() if s.title == "A long history"]
    w.conversations.refresh()
    w.open_conversation(summary.id)
    view = w.chat_view
    assert len(view.message_widgets()) == WINDOW
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    anchor = view.message_widgets()[0]  # the first shown message, about to be scrolled to

    def anchor_y() -> int:
        return anchor.mapTo(view.viewport(), anchor.rect().topLeft()).y()

    bar.setValue(0)  # the user scrolls to the top ...
    before = anchor_y()
    qtbot.waitUntil(lambda: len(view.message_widgets()) == WINDOW + REVEAL_STEP)  # ... more appear
    # The message that was at the top stays where the user saw it; earlier ones are above.
    qtbot.waitUntil(lambda: bar.value() > 0 and anchor_y() == before, timeout=5000)
    bar.setValue(0)  # and once more: the rest
    qtbot.waitUntil(lambda: len(view.message_widgets()) == len(turns))
    assert not view._earlier.isVisible()


def test_opening_a_long_chat_shows_its_newest_messages_at_once_and_builds_the_rest_after(qtbot, open_app):
    from desktop.ui.chat_view import FIRST_PAINT, WINDOW
    from desktop.ui.message_widget import MessageWidget

    w = open_app().window
    turns = [("user" if i % 2 == 0 else "assistant", f"message number {i}") for i in range(WINDOW + 10)]
    w.store.insert_many([("A long history", turns)])
    [summary] = [s for s in w.store.list_conversations() if s.title == "A long history"]
    w.conversations.refresh()
    view = w.chat_view
    column = view.widget().layout()

    def in_column() -> list[str]:
        """The messages in the column, top to bottom, without asking the view to finish."""
        items = (column.itemAt(i).widget() for i in range(column.count()))
        return [widget.item.message.content for widget in items if isinstance(widget, MessageWidget)]

    w.open_conversation(summary.id)
    assert in_column() == [text for _, text in turns[-FIRST_PAINT:]]  # no event has run yet
    # The others follow, newest first, each in its place, while the view stays at the bottom.
    qtbot.waitUntil(lambda: len(in_column()) == WINDOW)
    assert in_column() == [text for _, text in turns[-WINDOW:]]
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())
    # Asking for the widgets finishes the build at once.
    w.open_conversation(w.conversations.conversation_ids()[-1])
    w.open_conversation(summary.id)
    assert len(view.message_widgets()) == WINDOW and len(in_column()) == WINDOW


def test_a_chat_whose_state_is_warming_up_says_so_in_the_sidebar(qtbot, open_app):
    parts = open_app(allowance=None)
    w = parts.window
    send(qtbot, w, "Chat B: a first question")
    qtbot.waitUntil(lambda: idle(w), timeout=30000)
    b = w.current_id
    parts.engine.hold()
    w.new_chat()
    send(qtbot, w, "Chat A: tell me a story")
    a = w.current_id
    stream_until(qtbot, parts.engine, lambda: bool(w.controller.live_text(w.store.path(a)[-1].message.id)))
    seen: list[str] = []  # chat B's sidebar states, in the order they were shown
    w.conversations.dataChanged.connect(
        lambda *_: (row_activity(w, b) or "") not in seen[-1:] and seen.append(row_activity(w, b) or ""))
    # Opening B prefetches its state between A's steps; held here like a slow disk read, it
    # shows in B's row a while later.
    parts.engine.prefetch_gate.clear()
    w.open_conversation(b)
    assert row_activity(w, b) == ""  # not at once: most prefetches end before it is worth a repaint
    qtbot.waitUntil(lambda: row_activity(w, b) == "prefetching", timeout=5000)
    assert row_activity(w, a) == "generating"
    parts.engine.prefetch_gate.set()
    parts.engine.open()
    qtbot.waitUntil(lambda: idle(w) and not w.controller.active_conversations(), timeout=30000)
    assert row_activity(w, b) == "" and seen[-2:] == ["prefetching", ""]

"""Bad input seen through the real app, offscreen: every class of malformed database row
(``corrupt_rows.CASES``) and a model folder that fails to load each show one line where the user
looks, the chat keeps working, and nothing already stored is lost or rewritten."""

from __future__ import annotations

import shutil

import pytest
from PySide6.QtCore import Qt

from tests.desktop.app_parts import app, reply_settled  # noqa: F401  (fixture)
from tests.desktop.corrupt_rows import CASES, Case, make_database, raw_rows


def stored(db) -> dict[str, list[tuple]]:
    """The rows a test compares: all of them but the model the app remembers on load."""
    rows = raw_rows(db)
    rows["app_settings"] = [r for r in rows["app_settings"] if r[0] != b"last_model"]
    return rows


def send(qtbot, window, text: str) -> None:
    window.composer.input.setPlainText(text)
    qtbot.mouseClick(window.composer.send_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: reply_settled(window, text), timeout=20000)


def problem_line(window, chat, case: Case) -> str:
    """The one line the user sees about the case's bad part."""
    if case.where == "app":
        return window.statusBar().currentMessage()
    if case.where == "conversation":
        assert window.notice_label.isVisible()
        return window.notice_label.text()
    widget = window.chat_view.widget_for(getattr(chat, case.where))
    assert widget is not None and widget.note.isVisible()
    return widget.note.text()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_chat_with_a_malformed_row_opens_shows_one_line_and_keeps_working(qtbot, app, tmp_path, case):
    db = tmp_path / "chats.sqlite3"
    chat = make_database(db, case)
    before = stored(db)
    parts = app(db)
    w = parts.window
    assert w.current_id == chat.conversation
    shown = [widget.item.message for widget in w.chat_view.message_widgets()]
    assert [m.id for m in shown] == [item.message.id for item in w.store.path(chat.conversation)]
    assert len(shown) >= 2 and all(m.content for m in shown)
    line = problem_line(w, chat, case)
    assert case.problem in line and "\n" not in line
    if case.where != "conversation":
        assert w.notice_label.isHidden()  # the line is where the bad part is, not everywhere
    assert stored(db) == before  # opening it rewrote nothing

    send(qtbot, w, "still there?")
    [*_, question, reply] = w.store.path(chat.conversation)
    assert question.message.content == "still there?" and reply.message.status == "complete"
    assert stored(db)["messages"][: len(before["messages"])] == before["messages"]  # only added to


@pytest.fixture(params=["config not JSON", "weights truncated"])
def broken_model(request, tiny_folder, tmp_path):
    """A copy of the tiny model folder with one file damaged."""
    folder = tmp_path / "broken-model"
    shutil.copytree(tiny_folder, folder)
    if request.param == "config not JSON":
        (folder / "config.json").write_text('{"model_type": "llama",', encoding="utf-8")
    else:
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


def model_status(window) -> str:
    return window.status_label.text()


def test_a_model_that_fails_to_load_shows_one_line_and_the_chat_stays_usable(qtbot, app, tmp_path, broken_model):
    db = tmp_path / "chats.sqlite3"
    chat = make_database(db)
    before = stored(db)
    parts = app(db, model=str(broken_model))
    w = parts.window
    line = model_status(w)
    assert line.startswith("Model not loaded: ") and "broken-model" in line and "\n" not in line
    assert "internal error" not in line and "Traceback" not in line
    assert w.model_label.text() == "No model" and w.controller.model_info is None
    assert [widget.item.message.id for widget in w.chat_view.message_widgets()] == chat.messages
    send(qtbot, w, "anyone there?")
    reply = w.store.path(chat.conversation)[-1].message
    assert reply.status == "error" and reply.error == "no model is loaded"
    assert w.chat_view.widget_for(reply.id).note.text() == "failed: no model is loaded"
    assert stored(db)["messages"][: len(before["messages"])] == before["messages"]


def test_a_failed_switch_keeps_the_model_that_was_loaded(qtbot, app, tmp_path, broken_model):
    parts = app(tmp_path / "chats.sqlite3")
    w = parts.window
    tiny = w.controller.model_info.name
    with qtbot.waitSignal(w.controller.model_failed, timeout=20000):
        w.load_model(str(broken_model))
    assert model_status(w).startswith("Model not loaded: ") and model_status(w).endswith(f"(still using {tiny})")
    assert tiny in w.model_label.text()
    w.new_chat()
    send(qtbot, w, "hello")
    reply = w.store.path(w.current_id)[-1].message
    assert reply.status == "complete" and reply.model == tiny


def test_a_reply_whose_question_is_missing_cannot_be_regenerated(qtbot, app, tmp_path):
    db = tmp_path / "chats.sqlite3"
    chat = make_database(db, next(c for c in CASES if c.name == "reply's question missing"))
    w = app(db).window
    reply = w.chat_view.widget_for(chat.a1)
    assert not reply.regenerate_button.isEnabled()
    assert w.chat_view.widget_for(chat.a2).regenerate_button.isEnabled()
    assert w.controller.regenerate(chat.a1) is None and not w.client.busy  # the shortcut's path too
    assert [p.message.id for p in w.store.path(chat.conversation)] == [chat.a1, chat.u2, chat.a2]

"""The real app, offscreen, with the real tiny model: the user-facing checks of the desktop issue.

Every test drives widgets (buttons, the message box, the search box, dialogs) or the window's own
actions, and waits on signals or conditions - never on fixed sleeps. The engine is the real one
over the tiny random model; ``GatedEngine`` only holds its tokens at a gate the test opens, so
that a test can act while a reply is still being written, however fast this machine is.
"""

from __future__ import annotations

import json

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QAbstractButton, QApplication, QInputDialog, QLineEdit, QPlainTextEdit, QWidget

from desktop.chat_settings import ChatSettings
from tests.desktop.app_parts import TEST_DEFAULTS, launch  # noqa: F401 (a fixture)
from tests.desktop.conftest import stream_until

def send(qtbot, window, text: str) -> None:
    window.composer.input.setPlainText(text)
    qtbot.mouseClick(window.composer.send_button, Qt.MouseButton.LeftButton)


def wait_idle(qtbot, window, timeout=20000) -> None:
    """Until no reply and no auto-title request is queued or running, and no reply on screen
    is still stored as streaming (``busy`` turns False one queued event before a reply's last
    signal is handled)."""
    def idle() -> bool:
        path = window.store.path(window.current_id) if window.current_id is not None else []
        return not window.client.busy and all(p.message.status != "streaming" for p in path)

    qtbot.waitUntil(idle, timeout=timeout)


def path_texts(window) -> list[tuple[str, str]]:
    return [(p.message.role, p.message.content) for p in window.store.path(window.current_id)]


def shown(window) -> list[tuple[str, str]]:
    return [(w.item.message.role, w.item.message.content) for w in window.chat_view.message_widgets()]


def test_send_streams_then_stores_reply_with_stats(qtbot, launch):
    parts = launch(allowance=0)
    w, c = parts.window, parts.window.controller
    with qtbot.waitSignals([c.reply_queued, c.reply_started, c.reply_ended], order="strict", timeout=20000):
        send(qtbot, w, "Hello, Arbor!")
        qtbot.waitUntil(lambda: len(w.chat_view.message_widgets()) == 2 and w.chat_view.message_widgets()[1].streaming)
        reply_widget = w.chat_view.message_widgets()[1]
        assert reply_widget.note.text() == "writing…" and w.composer.generating
        stream_until(qtbot, parts.engine, lambda: reply_widget.item.message.content != "")
        assert reply_widget.streaming  # shown while the rest of the reply is still held
        parts.engine.open()
    [user, reply] = w.store.path(w.current_id)
    assert (user.message.role, user.message.content) == ("user", "Hello, Arbor!")
    assert reply.message.status == "complete" and reply.message.content
    assert reply.message.stats["generated_tokens"] > 0 and reply.message.model == parts.window.controller.model_info.name
    assert shown(w) == path_texts(w)
    widget = w.chat_view.message_widgets()[1]
    assert not widget.streaming and "tokens" in widget.stats_label.text() and "to first token" in widget.stats_label.text()
    assert not w.composer.generating
    assert w.conversations.data(w.conversations.index(1)) == "Hello, Arbor!"  # auto title, row 0 is "Today"


def test_the_drafters_round_costs_are_settled_after_loading_not_at_the_first_send(
        qtbot, launch, tmp_path, monkeypatch):
    profiles = tmp_path / "profiles"
    monkeypatch.setenv("ARBOR_PROFILES_DIR", str(profiles))
    parts = launch()
    assert parts.window.store.list_conversations() == []  # nothing was sent
    qtbot.waitUntil(lambda: any(f.name != "hashes.json" for f in profiles.glob("*.json")),
                    timeout=30000)


def test_stop_mid_reply_keeps_the_partial_text(qtbot, launch):
    parts = launch(allowance=0)
    w = parts.window
    w.store.set_default_settings(ChatSettings(max_tokens=400, temperature=1.0, min_p=0.0, top_p=1.0, seed=7))
    send(qtbot, w, "Tell me a long story")
    stream_until(qtbot, parts.engine, lambda: len(w.chat_view.message_widgets()) == 2
                 and len(w.chat_view.message_widgets()[1].item.message.content) > 3)
    with qtbot.waitSignal(w.controller.reply_ended, timeout=20000):
        qtbot.mouseClick(w.composer.stop_button, Qt.MouseButton.LeftButton)
    reply = w.store.path(w.current_id)[1].message
    assert reply.status == "cancelled" and 0 < reply.stats["generated_tokens"] < 400
    assert w.chat_view.message_widgets()[1].item.message.content == reply.content
    assert w.chat_view.message_widgets()[1].note.text() == "stopped"
    assert not w.composer.generating


def test_regenerate_then_navigate_sibling_replies(qtbot, launch):
    parts = launch()
    w = parts.window
    send(qtbot, w, "Give me a name")
    wait_idle(qtbot, w)
    first = w.store.path(w.current_id)[1].message
    qtbot.mouseClick(w.chat_view.message_widgets()[1].regenerate_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    second = w.store.path(w.current_id)[1]
    assert second.message.id != first.id and second.sibling_ids == (first.id, second.message.id)
    widget = w.chat_view.message_widgets()[1]
    assert widget.branch_label.text() == "2/2" and widget.previous_button.isEnabled()
    qtbot.mouseClick(widget.previous_button, Qt.MouseButton.LeftButton)
    assert w.chat_view.message_widgets()[1].item.message.id == first.id
    assert w.chat_view.message_widgets()[1].branch_label.text() == "1/2"
    qtbot.mouseClick(w.chat_view.message_widgets()[1].next_button, Qt.MouseButton.LeftButton)
    assert w.chat_view.message_widgets()[1].item.message.id == second.message.id


def test_edit_user_message_resends_as_a_new_branch(qtbot, launch):
    parts = launch()
    w = parts.window
    send(qtbot, w, "first question")
    wait_idle(qtbot, w)
    send(qtbot, w, "follow-up")
    wait_idle(qtbot, w)
    original = path_texts(w)
    first = w.chat_view.message_widgets()[0]
    qtbot.mouseClick(first.edit_button, Qt.MouseButton.LeftButton)
    assert first.editor.toPlainText() == "first question"
    first.editor.setPlainText("edited question")
    qtbot.mouseClick(first.send_edit_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    edited = path_texts(w)
    assert [role for role, _ in edited] == ["user", "assistant"] and edited[0][1] == "edited question"
    top = w.chat_view.message_widgets()[0]
    assert top.branch_label.text() == "2/2"
    qtbot.mouseClick(top.previous_button, Qt.MouseButton.LeftButton)
    assert path_texts(w) == original  # the old branch is intact, down to its leaf
    assert shown(w) == original


def test_switching_chats_and_branches_while_generating_never_misroutes_tokens(qtbot, launch):
    parts = launch()
    w = parts.window
    w.store.set_default_settings(ChatSettings(max_tokens=120, temperature=1.0, min_p=0.0, top_p=1.0, seed=7))
    misrouted = []

    def check_rows(top_left, bottom_right, roles=()):
        for row in range(top_left.row(), bottom_right.row() + 1):
            message = w.path_model.item(row).message
            if message.conversation_id != w.path_model.conversation_id or message.conversation_id != w.current_id:
                misrouted.append(message.id)

    w.path_model.dataChanged.connect(check_rows)
    send(qtbot, w, "chat A, first")
    wait_idle(qtbot, w)
    chat_a = w.current_id
    parts.engine.hold()  # from here A's regenerated reply streams only as the test lets it
    qtbot.mouseClick(w.chat_view.message_widgets()[1].regenerate_button, Qt.MouseButton.LeftButton)
    stream_until(qtbot, parts.engine, lambda: bool(w.controller.live_text(w.store.path(chat_a)[1].message.id)))
    streaming_id = w.store.path(chat_a)[1].message.id
    # Switch A to its other branch while the regenerated reply streams: it is off screen now.
    qtbot.mouseClick(w.chat_view.message_widgets()[1].previous_button, Qt.MouseButton.LeftButton)
    assert w.chat_view.widget_for(streaming_id) is None
    before = w.chat_view.message_widgets()[1].item.message.content
    stream_until(qtbot, parts.engine, lambda: len(w.controller.live_text(streaming_id) or "") > 20)
    assert w.chat_view.message_widgets()[1].item.message.content == before
    # A new chat while A is still generating: its reply is queued behind A's.
    qtbot.keyClick(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert w.current_id is None
    send(qtbot, w, "chat B")
    chat_b = w.current_id
    assert chat_b != chat_a and w.composer.generating
    # Back to A and forth to B while replies stream.
    w.open_conversation(chat_a)
    w.open_conversation(chat_b)
    parts.engine.open()
    wait_idle(qtbot, w, timeout=30000)
    assert not misrouted
    assert [role for role, _ in path_texts(w)] == ["user", "assistant"] and path_texts(w)[0][1] == "chat B"
    assert shown(w) == path_texts(w)
    regenerated = w.store.message(streaming_id)
    assert regenerated.status == "complete" and regenerated.conversation_id == chat_a
    w.open_conversation(chat_a)
    w.controller.select_branch(streaming_id)
    assert shown(w)[1] == ("assistant", regenerated.content)


def test_search_finds_messages_and_jumps_to_the_hit(qtbot, launch):
    parts = launch()
    w = parts.window
    send(qtbot, w, "where do zebras live")
    wait_idle(qtbot, w)
    zebra_chat = w.current_id
    w.new_chat()
    send(qtbot, w, "something else entirely")
    wait_idle(qtbot, w)
    qtbot.keyClick(w, Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)
    assert QApplication.focusWidget() is w.sidebar.search
    with qtbot.waitSignal(w.sidebar.search_changed, timeout=20000):  # after the typing pause
        qtbot.keyClicks(w.sidebar.search, "zebr")
    assert w.search_results.rowCount() == 2  # the title and the message
    assert w.sidebar.stack.currentWidget() is w.sidebar.results_view
    title_hit, message_hit = w.search_results.hit(0), w.search_results.hit(1)
    assert title_hit.message_id is None and title_hit.conversation_id == zebra_chat
    assert message_hit.conversation_id == zebra_chat and "zebras" in message_hit.snippet
    qtbot.keyClick(w.sidebar.search, Qt.Key.Key_Return)  # Enter opens the best hit
    assert w.current_id == zebra_chat
    w.new_chat()
    qtbot.keyClick(w.sidebar.search, Qt.Key.Key_Down)  # into the results, then to the message hit
    qtbot.keyClick(w.sidebar.results_view, Qt.Key.Key_Down)
    qtbot.keyClick(w.sidebar.results_view, Qt.Key.Key_Return)
    assert w.current_id == zebra_chat
    target = w.chat_view.widget_for(message_hit.message_id)
    assert target is not None and target.property("highlighted")
    qtbot.keyClick(w.sidebar.search, Qt.Key.Key_Escape)
    assert w.sidebar.search.text() == "" and w.sidebar.stack.currentWidget() is w.sidebar.list_view


def test_rename_pin_delete_and_undo(qtbot, launch, monkeypatch):
    parts = launch()
    w = parts.window
    send(qtbot, w, "one")
    wait_idle(qtbot, w)
    first = w.current_id
    w.new_chat()
    send(qtbot, w, "two")
    wait_idle(qtbot, w)
    second = w.current_id
    monkeypatch.setattr(QInputDialog, "getText", staticmethod(lambda *a, **k: ("Renamed chat", True)))
    w.sidebar.rename_requested.emit(first)
    assert w.store.conversation(first).title == "Renamed chat"
    assert w.conversations.data(w.conversations.index(w.conversations.row_of(first))) == "Renamed chat"
    w.sidebar.pin_toggled.emit(first)
    assert w.conversations.data(w.conversations.index(0)) == "Pinned"
    assert w.conversations.row_of(first) == 1
    w.open_conversation(second)
    w.sidebar.list_view.setFocus()
    qtbot.keyClick(w.sidebar.list_view, Qt.Key.Key_Delete)
    assert w.conversations.row_of(second) is None and w.current_id != second
    assert w.sidebar.undo_banner.isVisible() and "two" in w.sidebar.undo_label.text()
    qtbot.mouseClick(w.sidebar.undo_button, Qt.MouseButton.LeftButton)
    assert w.conversations.row_of(second) is not None and w.current_id == second
    assert not w.sidebar.undo_banner.isVisible()
    assert [p.message.content for p in w.store.path(second)][0] == "two"


def test_per_chat_settings_reach_the_engine_and_defaults_stay(qtbot, launch):
    parts = launch()
    w = parts.window
    send(qtbot, w, "hi")
    wait_idle(qtbot, w)
    dialog = w.open_chat_settings()
    dialog.system_prompt.setPlainText("You are terse.")
    dialog.temperature.setValue(0.0)
    dialog.max_tokens.setValue(7)
    dialog.fixed_seed.setChecked(True)
    dialog.seed.setValue(1234)
    dialog.buttons.button(dialog.buttons.StandardButton.Ok).click()
    settings = w.store.settings(w.current_id)
    assert (settings.system_prompt, settings.temperature, settings.max_tokens, settings.seed) == ("You are terse.", 0.0, 7, 1234)
    assert w.store.default_settings() == TEST_DEFAULTS
    send(qtbot, w, "again")
    wait_idle(qtbot, w)
    request = parts.loader.engines[-1].requests[-1]
    assert request.messages[0] == {"role": "system", "content": "You are terse."}
    assert request.sampling.temperature == 0.0 and request.sampling.seed == 1234 and request.max_tokens == 7
    assert w.store.path(w.current_id)[-1].message.stats["generated_tokens"] <= 7
    # Another chat still uses the defaults; "Save as app defaults" changes them.
    w.new_chat()
    dialog = w.open_chat_settings()
    assert dialog.settings() == TEST_DEFAULTS
    dialog.top_k.setValue(20)
    dialog.save_defaults_button.click()
    dialog.reject()
    assert w.store.default_settings().top_k == 20


def test_export_and_reimport_keep_the_whole_tree(qtbot, launch, tmp_path):
    parts = launch()
    w = parts.window
    send(qtbot, w, "export me")
    wait_idle(qtbot, w)
    w.regenerate_last()
    wait_idle(qtbot, w)
    original = w.current_id
    path = tmp_path / "chat.json"
    w.export_json([original], path)
    assert json.loads(path.read_text())["format"] == "arbor.conversations"
    [copy] = w.import_file(path)
    assert w.current_id == copy and copy != original
    assert path_texts(w) == [(p.message.role, p.message.content) for p in w.store.path(original)]
    assert w.store.path(copy)[1].sibling_count == 2
    md = tmp_path / "chat.md"
    w.export_markdown(copy, md)
    assert md.read_text().startswith("# export me") and "## You" in md.read_text()


def test_restart_finds_everything_as_it_was(qtbot, launch, tmp_path):
    db = tmp_path / "restart.sqlite3"
    parts = launch(db=db)
    w = parts.window
    send(qtbot, w, "remember me")
    wait_idle(qtbot, w)
    w.regenerate_last()
    wait_idle(qtbot, w)
    kept = w.current_id
    w.store.set_settings(kept, ChatSettings(system_prompt="persist", max_tokens=30))
    w.toggle_pin(kept)
    w.new_chat()
    send(qtbot, w, "second chat")
    wait_idle(qtbot, w)
    w.open_conversation(kept)
    w.set_theme("dark")
    before = (path_texts(w), [w.conversations.data(w.conversations.index(r)) for r in range(w.conversations.rowCount())])
    w.close()
    assert parts.shutdown(5.0)

    again = launch(db=db, defaults=None, theme=None)
    w2 = again.window
    assert w2.current_id == kept
    after = (path_texts(w2), [w2.conversations.data(w2.conversations.index(r)) for r in range(w2.conversations.rowCount())])
    assert after == before
    assert w2.store.settings(kept).system_prompt == "persist"
    assert again.theme.dark and w2.theme_actions["dark"].isChecked()
    assert w2.chat_view.message_widgets()[1].branch_label.text() == "2/2"


def test_model_manager_imports_and_switches_models(qtbot, launch, tiny_model_dir, monkeypatch):
    parts = launch()
    w = parts.window
    manager = w.open_model_manager()
    qtbot.waitUntil(lambda: manager._list_task is None, timeout=20000)
    manager.name_edit.setText("tiny-qwen")
    fractions: list[float] = []
    parts.tasks.progress.connect(lambda task, fraction, message: fractions.append(fraction))
    with qtbot.waitSignal(parts.tasks.done, timeout=30000):
        manager.import_path(tiny_model_dir("qwen2"))
    assert fractions and fractions == sorted(fractions) and fractions[-1] == 1.0
    assert manager.progress.value() == 1000  # the bar followed the task to its end
    assert not manager.running and manager.status.text() == "Added tiny-qwen."
    qtbot.waitUntil(lambda: any(manager.table_model.model_at(r).name == "tiny-qwen"
                                for r in range(manager.table_model.rowCount())), timeout=20000)
    row = next(r for r in range(manager.table_model.rowCount()) if manager.table_model.model_at(r).name == "tiny-qwen")
    assert manager.table_model.data(manager.table_model.index(row, 1)) == "qwen2"
    manager.table.selectRow(row)
    with qtbot.waitSignal(w.controller.model_loaded, timeout=20000):
        qtbot.mouseClick(manager.use_button, Qt.MouseButton.LeftButton)
    assert w.controller.model_info.name == "tiny-qwen" and "tiny-qwen" in w.model_label.text()
    assert w.store.app_setting("last_model") == "tiny-qwen"
    send(qtbot, w, "hello qwen")
    wait_idle(qtbot, w)
    assert w.store.path(w.current_id)[1].message.model == "tiny-qwen"
    monkeypatch.setattr("desktop.ui.model_manager.QMessageBox.question",
                        staticmethod(lambda *a, **k: manager_yes()))
    with qtbot.waitSignal(parts.tasks.done, timeout=20000):
        manager._delete()
    qtbot.waitUntil(lambda: all(manager.table_model.model_at(r).name != "tiny-qwen"
                                for r in range(manager.table_model.rowCount())), timeout=20000)


def manager_yes():
    from PySide6.QtWidgets import QMessageBox

    return QMessageBox.StandardButton.Yes


def test_keyboard_shortcuts(qtbot, launch):
    parts = launch(allowance=0)
    w = parts.window
    w.store.set_default_settings(ChatSettings(max_tokens=300, temperature=1.0, min_p=0.0, top_p=1.0, seed=7))
    send(qtbot, w, "first")
    qtbot.waitUntil(lambda: w.composer.generating and parts.engine.held(), timeout=20000)
    with qtbot.waitSignal(w.controller.reply_ended, timeout=20000):
        qtbot.keyClick(w.composer.input, Qt.Key.Key_Period, Qt.KeyboardModifier.ControlModifier)
    first = w.current_id
    parts.engine.open()
    w.store.set_default_settings(TEST_DEFAULTS)
    with qtbot.waitSignal(w.controller.reply_ended, timeout=20000):
        qtbot.keyClick(w, Qt.Key.Key_R, Qt.KeyboardModifier.ControlModifier)  # regenerate
    assert w.store.path(first)[1].sibling_count == 2
    qtbot.keyClick(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert w.current_id is None and QApplication.focusWidget() is w.composer.input
    send(qtbot, w, "second")
    wait_idle(qtbot, w)
    second = w.current_id
    qtbot.keyClick(w, Qt.Key.Key_PageDown, Qt.KeyboardModifier.ControlModifier)
    assert w.current_id == first
    qtbot.keyClick(w, Qt.Key.Key_PageUp, Qt.KeyboardModifier.ControlModifier)
    assert w.current_id == second
    w.sidebar.search.setFocus()
    qtbot.keyClick(w, Qt.Key.Key_L, Qt.KeyboardModifier.ControlModifier)
    assert QApplication.focusWidget() is w.composer.input
    # Esc in the message box stops a reply too.
    w.store.set_default_settings(ChatSettings(max_tokens=300, temperature=1.0, min_p=0.0, top_p=1.0, seed=7))
    parts.engine.hold()
    send(qtbot, w, "third")
    qtbot.waitUntil(lambda: w.composer.generating and parts.engine.held(), timeout=20000)
    with qtbot.waitSignal(w.controller.reply_ended, timeout=20000):
        qtbot.keyClick(w.composer.input, Qt.Key.Key_Escape)
    assert w.store.path(second)[-1].message.status == "cancelled"


def test_controls_have_accessible_names_and_themes_switch(qtbot, launch):
    parts = launch()
    w = parts.window
    send(qtbot, w, "hello")
    wait_idle(qtbot, w)
    unnamed = [
        type(widget).__name__
        for widget in w.findChildren(QWidget)
        if isinstance(widget, (QAbstractButton, QLineEdit, QPlainTextEdit)) and widget.isVisible() and not (widget.accessibleName() or (isinstance(widget, QAbstractButton) and widget.text()))
    ]
    assert unnamed == []
    w.set_theme("dark")
    assert parts.theme.dark and w.renderer.palette.pygments_style == "monokai"
    assert QGuiApplication.palette().color(QGuiApplication.palette().ColorRole.Window).lightness() < 80
    w.set_theme("light")
    assert QGuiApplication.palette().color(QGuiApplication.palette().ColorRole.Window).lightness() > 200

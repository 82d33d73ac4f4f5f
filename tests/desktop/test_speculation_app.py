"""Speculative decoding in the real app (offscreen, the real tiny model from the real model store,
loaded by reference alone, so its paired draft comes from the store): a chat's "Speculative decoding" setting, chosen in the settings
dialog, decides how its replies are drafted, the reply's stats line says what drafting did, and
the model manager shows, pairs and unpairs a model's draft."""

from __future__ import annotations

import shutil

import pytest
from PySide6.QtCore import Qt

from desktop.app import create_app
from desktop.chat_settings import ChatSettings
from desktop.store import ChatStore
from tests.desktop.app_parts import reply_settled
from tests.test_model_pairing import copy_with_other_vocabulary

GREEDY = ChatSettings(temperature=0.0, max_tokens=24)


@pytest.fixture
def model_store(tmp_path, monkeypatch, tiny_model_dir):
    """A store of its own holding the tiny model as "tiny-paired", paired with a copy of its
    own weights as "self-draft" (a draft the target always agrees with)."""
    from backend.weights.store import ModelStore

    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    copy = shutil.copytree(tiny_model_dir("llama"), tmp_path / "self-draft")
    store = ModelStore()
    store.import_path(tiny_model_dir("llama"), name="tiny-paired", draft=copy)
    return store


def fixed_depth_loader(ref):
    """``Engine.load(ref)`` as the app's loader calls it, drafting 4 tokens a round: the depth
    controller prices rounds by wall time, and on a busy machine it may not draft at all."""
    from backend.engine import Engine
    from backend.memory.budgets import CacheConfig

    return Engine.load(ref, cache=CacheConfig.memory_only(), draft_depth=4)


@pytest.fixture
def launch(qtbot, tmp_path):
    """``launch(model, loader)``: the app on a fresh chat store with greedy defaults, loaded
    with ``model`` by ``loader``."""
    started = []

    def start(model: str, loader):
        store = ChatStore(tmp_path / "chats.sqlite3")
        store.set_default_settings(GREEDY)
        parts = create_app(model, loader=loader, store=store, theme="light")
        started.append(parts)
        parts.window.show()
        qtbot.waitExposed(parts.window)
        qtbot.waitUntil(lambda: parts.window.controller.model_info is not None, timeout=30000)
        return parts

    yield start
    for parts in started:
        parts.window.close()
        assert parts.shutdown(5.0)
        parts.theme.deleteLater()


def choose_speculation(qtbot, window, choice: str | None) -> None:
    """Open the chat's settings dialog, pick ``choice`` (None: leave it), press OK."""
    dialog = window.open_chat_settings()
    if choice is not None:
        dialog.speculation.setCurrentIndex(dialog.speculation.findData(choice))
    qtbot.mouseClick(dialog.buttons.button(dialog.buttons.StandardButton.Ok),
                     Qt.MouseButton.LeftButton)


def reply_to(qtbot, window, text: str):
    window.composer.input.setPlainText(text)
    qtbot.mouseClick(window.composer.send_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: reply_settled(window, text), timeout=30000)
    reply = window.store.path(window.current_id)[-1].message
    assert reply.role == "assistant" and reply.status == "complete", reply
    return reply, window.chat_view.message_widgets()[-1].stats_label.text()


def test_the_chat_setting_decides_how_replies_are_drafted(qtbot, launch, model_store):
    w = launch("tiny-paired", fixed_depth_loader).window  # the pairing: from the store alone
    choose_speculation(qtbot, w, "none")
    assert w.store.settings(w.current_id).speculation == "none"
    plain, line = reply_to(qtbot, w, "Hello there, how are you?")
    assert plain.content and plain.stats["drafter"] == "" and plain.stats["drafted_tokens"] == 0
    assert "drafts" not in line

    w.new_chat()
    choose_speculation(qtbot, w, None)  # the dialog offers the app default: automatic
    assert w.store.settings(w.current_id).speculation == "auto"
    drafted, line = reply_to(qtbot, w, "Hello there, how are you?")
    stats = drafted.stats
    assert drafted.content == plain.content  # drafting never changes the reply
    assert stats["drafter"] == "model" and stats["drafted_tokens"] > 0
    assert stats["accepted_tokens"] == stats["drafted_tokens"]  # its own weights: all accepted
    assert stats["acceptance_by_position"] and set(stats["acceptance_by_position"]) == {1.0}
    assert stats["mean_accepted"] > 1.0  # rounds of 4 drafts (fewer near the token budget)
    assert f"drafts: {stats['accepted_tokens']} of {stats['drafted_tokens']} accepted" in line
    tip = w.chat_view.message_widgets()[-1].stats_label.toolTip()
    assert (f"Drafting by the draft model: {stats['accepted_tokens']} of {stats['drafted_tokens']} "
            f"drafts accepted (100%), {stats['mean_accepted']:.2f} per round") in tip
    assert "by position 100/100/100/100%" in tip

    w.new_chat()
    choose_speculation(qtbot, w, "lookup")
    looked_up, _ = reply_to(qtbot, w, "Hello there, how are you?")
    assert looked_up.content == plain.content and looked_up.stats["drafter"] == "lookup"
    # Each chat keeps its own choice; the defaults are untouched.
    assert w.store.default_settings().speculation == "auto"


def test_the_model_manager_shows_pairs_and_unpairs_drafts(qtbot, launch, model_store, make_loader,
                                                          tiny_model_dir, tmp_path, monkeypatch):
    parts = launch("tiny", loader=make_loader())
    manager = parts.window.open_model_manager()
    table = manager.table_model

    def draft_shown(name: str) -> str | None:
        rows = [r for r in range(table.rowCount()) if table.model_at(r).name == name]
        return table.data(table.index(rows[0], table.COLUMNS.index("Draft"))) if rows else None

    def finish(start) -> None:
        with qtbot.waitSignals([parts.tasks.done, manager.table_model.modelReset],
                               timeout=30000):
            start()

    qtbot.waitUntil(lambda: draft_shown("tiny-paired") is not None, timeout=30000)
    assert draft_shown("tiny-paired") == "self-draft" and draft_shown("self-draft") == ""
    # Import paired with an installed draft of the same vocabulary (a Qwen2 with the same
    # byte-level tokenizer).
    manager.name_edit.setText("tiny-qwen")
    manager.draft_combo.setCurrentIndex(manager.draft_combo.findData("self-draft"))
    finish(lambda: manager.import_path(tiny_model_dir("qwen2")))
    assert draft_shown("tiny-qwen") == "self-draft" and model_store.get("tiny-qwen").draft == "self-draft"
    # Another vocabulary: one line, nothing added.
    other = copy_with_other_vocabulary(tiny_model_dir("llama"), tmp_path / "other-vocab")
    before = model_store.names()
    manager.name_edit.setText("")
    with qtbot.waitSignal(parts.tasks.failed, timeout=30000):
        manager.import_path(other)
    assert "cannot draft for 'other-vocab'" in manager.status.text()
    assert "\n" not in manager.status.text() and model_store.names() == before
    # A paired draft is not deleted: the status names the models it drafts for.
    manager.table.selectRow(next(r for r in range(table.rowCount())
                                 if table.model_at(r).name == "self-draft"))
    monkeypatch.setattr("desktop.ui.model_manager.QMessageBox.question",
                        staticmethod(lambda *a, **k: yes()))
    with qtbot.waitSignal(parts.tasks.failed, timeout=30000):
        qtbot.mouseClick(manager.delete_button, Qt.MouseButton.LeftButton)
    assert "paired draft of 'tiny-paired', 'tiny-qwen'" in manager.status.text()
    assert "self-draft" in model_store.names()
    # Unpairing through the button.
    manager.table.selectRow(next(r for r in range(table.rowCount())
                                 if table.model_at(r).name == "tiny-qwen"))
    finish(lambda: qtbot.mouseClick(manager.unpair_button, Qt.MouseButton.LeftButton))
    assert draft_shown("tiny-qwen") == "" and model_store.get("tiny-qwen").draft is None
    assert manager.status.text() == "tiny-qwen has no paired draft now."


def yes():
    from PySide6.QtWidgets import QMessageBox

    return QMessageBox.StandardButton.Yes


def test_the_stats_line_and_stored_stats_of_drafting():
    from desktop.store.rows import clean_stats
    from desktop.ui.message_widget import format_stats
    from desktop.ui.stats_line import stats_tooltip

    stats = {"generated_tokens": 20, "ttft_s": 0.5, "decode_tps": 40.0, "prompt_tokens": 9,
             "cached_tokens": 0, "drafter": "lookup", "drafted_tokens": 12,
             "accepted_tokens": 9, "acceptance_by_position": [0.9, 0.75, 0.5],
             "mean_accepted": 2.25}
    assert clean_stats(stats) == (stats, [])
    assert format_stats(stats) == ("0.50 s to first token · 40.0 tok/s · 20 tokens · 9 prompt tokens · "
                                   "drafts: 9 of 12 accepted")
    assert ("Drafting by prompt lookup: 9 of 12 drafts accepted (75%), 2.25 per round; "
            "by position 90/75/50%") in stats_tooltip(stats)
    # Stored values of the wrong kind are dropped (and the line is shown without them).
    for bad in ("most", [0.9, "x"], [float("nan")], {"1": 0.9}, [True]):
        kept, dropped = clean_stats({**stats, "acceptance_by_position": bad, "drafter": 3,
                                     "mean_accepted": "long"})
        assert sorted(dropped) == ["acceptance_by_position", "drafter", "mean_accepted"], bad
        assert format_stats(kept).endswith("drafts: 9 of 12 accepted")
        assert "Drafting: 9 of 12 drafts accepted (75%)" in stats_tooltip(kept)


def test_the_speculation_setting_is_one_of_the_choices():
    defaults = ChatSettings(temperature=0.3)
    assert ChatSettings.from_dict({"speculation": "lookup"}, defaults).speculation == "lookup"
    for bad in ("fastest", 1, None, ["model"], {"model": 1}):
        assert ChatSettings.from_dict({"speculation": bad}, defaults) == defaults
    assert ChatSettings(speculation="fastest").validated().speculation == "auto"
    assert ChatSettings(speculation="none").to_overrides(ChatSettings()) == {"speculation": "none"}

"""The prefix cache in the real app (offscreen, the real tiny model, a real disk tier per test):
switching conversations reuses their cached states (and the stats line says so and from where),
a restart of the app keeps them warm, opening a chat prefetches its state, and the budgets set
in "Memory and cache" take effect at once and at the next start."""

from __future__ import annotations

import threading

from PySide6.QtCore import Qt

from backend.api import GenerateRequest
from backend.memory.budgets import MIB
from desktop.app import create_app
from desktop.cache_settings import stored_budgets
from desktop.chat_settings import ChatSettings
from desktop.store import ChatStore
from desktop.ui.message_widget import format_stats
from desktop.worker import InferenceClient
from tests.desktop.app_parts import reply_settled

SETTINGS = ChatSettings(temperature=1.0, top_p=1.0, min_p=0.0, max_tokens=12, seed=3)


def start(qtbot, make_loader, db, started):
    store = ChatStore(db)
    store.set_default_settings(SETTINGS)
    parts = create_app("tiny", loader=make_loader(), store=store, theme="light")
    started.append(parts)
    parts.window.show()
    qtbot.waitExposed(parts.window)
    qtbot.waitUntil(lambda: parts.window.controller.model_info is not None, timeout=20000)
    return parts


def stop(parts) -> None:
    parts.window.close()
    assert parts.shutdown(5.0)
    parts.theme.deleteLater()


def send_and_wait(qtbot, window, text: str) -> dict:
    """Send ``text`` in the chat on screen; the stored stats of the reply once it is done."""
    window.composer.input.setPlainText(text)
    qtbot.mouseClick(window.composer.send_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: reply_settled(window, text), timeout=30000)
    reply = window.store.path(window.current_id)[-1].message
    assert reply.role == "assistant" and reply.status == "complete", reply
    return reply.stats


def stats_line(window) -> str:
    return window.chat_view.message_widgets()[-1].stats_label.text()


def test_switching_back_restores_the_conversation_and_says_from_where(qtbot, make_loader,
                                                                       tmp_path):
    started = []
    parts = start(qtbot, make_loader, tmp_path / "chats.sqlite3", started)
    w = parts.window
    try:
        w.new_chat()
        first = send_and_wait(qtbot, w, "Tell me about the garden behind the old house.")
        a = w.current_id
        w.new_chat()
        send_and_wait(qtbot, w, "Something else entirely: the river in winter.")
        w.open_conversation(a)
        again = send_and_wait(qtbot, w, "And the lantern by the gate?")
        # The first exchange came back from the prefix cache after the other chat had taken the
        # live caches. (The tiny random model's replies are not canonical tokenizations of their
        # own text, so the template re-encodes them differently: the match ends in the reply.)
        assert again["cached_tokens"] >= first["prompt_tokens"]
        assert sum(again["cached_by_tier"].get(t, 0) for t in ("device", "host", "disk")) > 0
        line = stats_line(w)
        assert f"({again['cached_tokens']} cached" in line and " from " in line
        assert line == format_stats(again)
    finally:
        stop(parts)


def test_a_restart_keeps_conversations_warm_and_opening_a_chat_prefetches(qtbot, make_loader,
                                                                           tmp_path):
    started = []
    db = tmp_path / "chats.sqlite3"
    parts = start(qtbot, make_loader, db, started)
    w = parts.window
    w.new_chat()
    first = send_and_wait(qtbot, w, "Tell me about the garden behind the old house.")
    a = w.current_id
    stop(parts)

    parts = start(qtbot, make_loader, db, started)  # a new process, as far as Arbor can tell
    w = parts.window
    try:
        qtbot.waitUntil(lambda: not w.client.busy, timeout=20000)  # the prefetch on opening
        assert w.current_id == a  # the app reopens the last conversation ...
        again = send_and_wait(qtbot, w, "And the lantern by the gate?")
        assert again["cached_tokens"] >= first["prompt_tokens"]
        # ... and opening it already brought its state from disk to the device: the reply
        # credits the disk, where the prefetch read it (not the device it was restored from).
        assert again["cached_by_tier"].get("disk", 0) > 0, again["cached_by_tier"]
        assert again["cached_by_tier"].get("device", 0) == 0, again["cached_by_tier"]
    finally:
        stop(parts)


def test_budgets_take_effect_now_and_at_the_next_start(qtbot, make_loader, tmp_path):
    started = []
    parts = start(qtbot, make_loader, tmp_path / "chats.sqlite3", started)
    w = parts.window
    try:
        dialog = w.open_cache_dialog()
        dialog.budget_boxes["device"].setValue(0)
        dialog.budget_boxes["host"].setValue(7)
        qtbot.mouseClick(dialog.apply_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: dialog.last_stats is not None
                        and dialog.last_stats.tiers["host"].budget == 7 * MIB, timeout=20000)
        assert dialog.last_stats.tiers["device"].budget == 0
        w.new_chat()
        send_and_wait(qtbot, w, "Tell me about the garden behind the old house.")
        w.new_chat()
        send_and_wait(qtbot, w, "Something else entirely: the river in winter.")
        dialog.refresh()
        qtbot.waitUntil(lambda: dialog.last_stats.tiers["host"].entries > 0, timeout=20000)
        assert dialog.last_stats.tiers["device"].bytes == 0  # idle states left the device
        assert dialog.table.item(1, 1).text().endswith("MiB")
        assert stored_budgets(w.store).device_bytes == 0  # kept for the next start
        assert stored_budgets(w.store).host_bytes == 7 * MIB
        dialog.clear_cache()
        qtbot.waitUntil(lambda: dialog.last_stats.nodes == 0, timeout=20000)
        dialog.close()
    finally:
        stop(parts)


def test_a_reply_cancels_a_queued_prefetch(qtbot, make_loader):
    """A prefetch queued behind a running reply never delays the next reply: the next
    ``generate`` cancels it, so it ends without touching the engine."""
    loader = make_loader(allowance=0)  # the first reply waits at the gate
    client = InferenceClient(loader)
    try:
        with qtbot.waitSignal(client.model_loaded, timeout=20000):
            client.load_model("tiny")
        engine = loader.engines[-1]
        first = client.generate(GenerateRequest(prompt_ids=[5, 6, 7], max_tokens=3))
        qtbot.waitUntil(engine.held, timeout=20000)
        results: dict[int, object] = {}
        client.task_done.connect(lambda rid, result: results.__setitem__(rid, result))
        prefetch = client.prefetch([{"role": "user", "content": "hello"}])
        second = client.generate(GenerateRequest(prompt_ids=[5, 6, 8], max_tokens=3))
        engine.open()
        qtbot.waitUntil(lambda: prefetch in results and not client.is_pending(second),
                        timeout=20000)
        assert results[prefetch] is None  # ended as cancelled, before running
        assert not client.is_pending(first)
    finally:
        assert client.shutdown(5.0)


def test_prefetch_reports_what_it_brought_to_the_device(qtbot, make_loader):
    client = InferenceClient(make_loader())
    try:
        with qtbot.waitSignal(client.model_loaded, timeout=20000):
            client.load_model("tiny")
        done = threading.Event()
        client.finished.connect(lambda rid, d: done.set())
        messages = [{"role": "user", "content": "Tell me about the garden."}]
        client.generate(GenerateRequest(messages=messages, max_tokens=4))
        qtbot.waitUntil(done.is_set, timeout=20000)
        with qtbot.waitSignal(client.task_done, timeout=20000) as blocker:
            client.prefetch(messages)
        assert blocker.args[1] > 0  # tokens of the conversation ready on the device
    finally:
        assert client.shutdown(5.0)

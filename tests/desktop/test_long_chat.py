"""A 400-message chat, imported into the real app (offscreen, the real engine), never hits a wall:
it answers under every context-overflow policy; under the default (drop old turns in large
steps) ten further turns each reuse at least 90% of their prompt from the prefix cache; the
context meter and its warning say what the model sees; "stop at the limit" explains itself in
one line and loses nothing.

The model is the tiny random Llama with its context raised from 512 to 2,048 tokens (RoPE needs
no position table, so only the config changes). Why: the 400-message chat is ~9 times that
context, as a long chat is for SmolLM2's 8,192, and ten turns of this chat fit in half its room
as they do there, while each policy's first, uncached prompt takes a fraction of a second to
read instead of the ~30 s SmolLM2 needs on a 2-core CPU.
"""

from __future__ import annotations

import json
import shutil

import pytest
from PySide6.QtCore import Qt

from desktop.app import create_app
from desktop.chat_settings import ChatSettings
from desktop.store import ChatStore
from tests.fixtures.long_chat import write_long_chat

CONTEXT = 2048
SETTINGS = ChatSettings(temperature=1.0, top_p=1.0, min_p=0.0, max_tokens=8, seed=7)


@pytest.fixture(scope="module")
def long_context_model(tiny_model_dir, tmp_path_factory):
    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path_factory.mktemp("long") / "tiny-2k")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


@pytest.fixture
def window(qtbot, long_context_model, tmp_path):
    from backend.engine import Engine

    store = ChatStore(tmp_path / "chats.sqlite3")
    store.set_default_settings(SETTINGS)
    parts = create_app("tiny-2k", loader=lambda ref: Engine.load(str(long_context_model)), store=store,
                       theme="light")
    parts.window.show()
    qtbot.waitExposed(parts.window)
    qtbot.waitUntil(lambda: parts.window.controller.model_info is not None, timeout=30000)
    yield parts.window
    parts.window.close()
    assert parts.shutdown(5.0)
    parts.theme.deleteLater()


def reply_to(qtbot, window, text: str):
    window.composer.input.setPlainText(text)
    qtbot.mouseClick(window.composer.send_button, Qt.MouseButton.LeftButton)

    def ended() -> bool:
        path = window.store.path(window.current_id)
        return (not window.client.busy and path[-2].message.content == text
                and path[-1].message.status != "streaming")

    qtbot.waitUntil(ended, timeout=60000)
    return window.store.path(window.current_id)[-1].message


def set_policy(window, policy: str) -> None:
    dialog = window.open_chat_settings()
    dialog.context_overflow.setCurrentIndex(dialog.context_overflow.findData(policy))
    dialog.buttons.button(dialog.buttons.StandardButton.Ok).click()
    assert window.store.settings(window.current_id).context_overflow == policy


def test_a_400_message_chat_answers_and_stays_warm(qtbot, window, tmp_path):
    [chat] = window.import_file(write_long_chat(tmp_path / "long.json", messages=400))
    assert window.current_id == chat and len(window.store.path(chat)) == 400
    # The file brings the settings it was exported with; short replies here (the tiny random
    # model's text is not how its tokenizer would write it, so a reply's ids are reused only up
    # to where they first differ: the shorter the replies, the less that costs).
    window.apply_chat_settings(SETTINGS)
    # Opening it measures what the model will see: the meter, and a line saying what is left out.
    qtbot.waitUntil(lambda: chat in window.context_use, timeout=30000)
    use = window.context_use[chat]
    assert use.context == CONTEXT and use.total > 8 * CONTEXT and 0 < use.prompt <= CONTEXT // 2
    assert use.dropped > 300 and not use.over
    assert window.context_label.text() == f"{use.prompt:,} / {CONTEXT:,} tokens"
    assert window.context_warning.isVisible() and f"{use.dropped} older messages" in window.context_warning.text()

    assert window.store.settings(chat).context_overflow == "drop_old_turns"  # the default
    first = reply_to(qtbot, window, "Let us go on: what about the garden now?")
    assert first.status == "complete" and first.stats["dropped_messages"] > 300
    for turn in range(10):
        reply = reply_to(qtbot, window, f"And turn {turn}: anything new about the river?")
        stats = reply.stats
        assert reply.status == "complete", reply.error
        assert stats["cached_tokens"] >= 0.9 * stats["prompt_tokens"], (turn, stats)
        assert sum(stats["cached_by_tier"].values()) == stats["cached_tokens"]
        assert stats["prompt_tokens"] + 8 <= CONTEXT

    for policy in ("rolling_window", "truncate_middle"):
        set_policy(window, policy)
        reply = reply_to(qtbot, window, f"Under {policy}: one more thing?")
        assert reply.status == "complete" and reply.stats["dropped_messages"] > 300, reply.error

    set_policy(window, "stop")
    qtbot.waitUntil(lambda: window.context_use[chat].over, timeout=30000)  # warned before sending
    assert "the next reply will fail" in window.context_warning.text()
    before = [(p.message.role, p.message.content) for p in window.store.path(chat)]
    question = "Under stop: and now?"
    failed = reply_to(qtbot, window, question)
    after = [(p.message.role, p.message.content) for p in window.store.path(chat)]
    assert after[:len(before)] == before and after[len(before)] == ("user", question)  # nothing lost
    assert failed.status == "error" and "\n" not in failed.error
    assert f"the model's context is {CONTEXT}" in failed.error and "Stop at the limit" in failed.error
    widget = window.chat_view.message_widgets()[-1]
    assert widget.detail_text() == failed.error and widget.detail.isVisible()

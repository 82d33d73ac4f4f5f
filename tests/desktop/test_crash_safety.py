"""Crash safety: SIGKILL the app mid-reply; after restart the chat and the partial reply are there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from desktop.app import create_app
from desktop.store import ChatStore

REPO = Path(__file__).resolve().parents[2]


def test_sigkill_mid_reply_loses_nothing_that_was_shown(qtbot, tiny_folder, tmp_path):
    database = tmp_path / "crash.sqlite3"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "ARBOR_HOME": str(tmp_path / "home")}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.desktop.crash_app", str(database), str(tiny_folder)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    last = None
    watchdog = threading.Timer(90, child.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    try:
        for line in child.stdout:  # blocks until the child shows something; ends if it dies
            update = json.loads(line)
            assert not update.get("ended"), "the reply ended before the test could kill the app"
            last = update
            if len(last["shown"]) >= 20:
                break
        assert last is not None and len(last["shown"]) >= 20, "the child never showed a streaming reply"
    finally:
        watchdog.cancel()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL

    store = ChatStore(database)
    assert store.interrupted_on_open == 1
    [user, reply] = store.path(last["conversation"])
    assert user.message.content == "Tell me everything about trees."
    assert reply.message.id == last["message"] and reply.message.status == "interrupted"
    assert reply.message.content.startswith(last["shown"])  # everything shown was saved

    parts = create_app(load_model=False, store=store, theme="light")
    try:
        window = parts.window
        window.show()
        assert window.current_id == last["conversation"]
        widget = window.chat_view.message_widgets()[1]
        assert widget.item.message.content == reply.message.content
        assert widget.note.text().startswith("interrupted")
        assert window.conversations.row_of(last["conversation"]) is not None
    finally:
        window.close()
        assert parts.shutdown(5.0)
        parts.theme.deleteLater()

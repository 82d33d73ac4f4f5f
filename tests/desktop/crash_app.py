"""The app in a child process for the crash test: ``python -m tests.desktop.crash_app DB MODEL``.

Opens the real window (offscreen) over the real tiny model and sends one message; its reply
shows its first tokens (each as its own update), then waits at the engine's gate until the kill.
After every update of the reply *on screen* it prints one JSON line
``{"conversation": id, "message": id, "shown": text}``. The test kills it with SIGKILL mid-reply.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

SHOWN_TOKENS = 100  # of max_tokens=400: the reply is still streaming when the test kills the app


def main(database: str, model_folder: str) -> int:
    from desktop.app import create_app
    from desktop.chat_settings import ChatSettings
    from desktop.store import ChatStore
    from tests.desktop.conftest import GatedEngine

    def loader(ref):
        from backend.engine import Engine

        return GatedEngine(Engine.load(model_folder), allowance=SHOWN_TOKENS)

    store = ChatStore(database)
    store.set_default_settings(ChatSettings(max_tokens=400, temperature=0.0))  # greedy: a long reply every run
    # Every token its own update: what passed the gate is on screen, however fast it came.
    parts = create_app("tiny", loader=loader, store=store, theme="light", updates_per_second=1e9)
    window = parts.window

    def report(conversation_id: int, message_id: int, _text: str) -> None:
        widget = window.chat_view.widget_for(message_id)
        if widget is not None:  # connected after the window's own slot: this text is on screen
            shown = widget.item.message.content
            print(json.dumps({"conversation": conversation_id, "message": message_id, "shown": shown}), flush=True)

    window.controller.reply_updated.connect(report)
    window.controller.reply_ended.connect(lambda *_: print(json.dumps({"ended": True}), flush=True))
    window.controller.model_loaded.connect(lambda _info: window.send("Tell me everything about trees."))
    window.show()
    return parts.app.exec()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

"""The app in a child process for the crash test: ``python -m tests.desktop.crash_app DB MODEL``.

Opens the real window (offscreen) over the real tiny model, paced so the reply takes seconds,
sends one message, and after every update of the reply *on screen* prints one JSON line
``{"conversation": id, "message": id, "shown": text}``. The test kills it with SIGKILL mid-reply.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def main(database: str, model_folder: str) -> int:
    from desktop.app import create_app
    from desktop.chat_settings import ChatSettings
    from desktop.store import ChatStore
    from tests.desktop.conftest import PacedEngine

    def loader(ref):
        from backend.engine import Engine

        return PacedEngine(Engine.load(model_folder), delay_s=0.03)

    store = ChatStore(database)
    store.set_default_settings(ChatSettings(max_tokens=400, temperature=0.0))  # greedy: a long reply every run
    parts = create_app("tiny", loader=loader, store=store, theme="light")
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

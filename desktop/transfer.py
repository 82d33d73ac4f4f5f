"""Export and import of conversations.

JSON keeps everything: the whole message tree (every branch), settings, statistics; importing it
creates new conversations with the same content. Markdown is for reading and sharing: the path the
user is looking at, reasoning left out.

JSON document::

    {"format": "arbor.conversations", "version": 1,
     "conversations": [ChatStore.export_tree(...), ...]}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from desktop.reasoning import split_reasoning
from desktop.store import ChatStore, StoreError

FORMAT = "arbor.conversations"
VERSION = 1


def export_json(store: ChatStore, conversation_ids: Iterable[int]) -> dict[str, Any]:
    """The document for ``conversation_ids`` (in that order)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "conversations": [store.export_tree(cid) for cid in conversation_ids],
    }


def write_json(store: ChatStore, conversation_ids: Iterable[int], path: Path) -> None:
    path.write_text(json.dumps(export_json(store, conversation_ids), indent=1, ensure_ascii=False), encoding="utf-8")


def import_json(store: ChatStore, document: Any) -> list[int]:
    """Import every conversation of ``document``, all or nothing; returns the new ids.

    Accepts the document above or a single exported conversation. Raises ``StoreError`` with a
    one-line reason naming the bad conversation; then nothing at all is written.
    """
    if isinstance(document, dict) and document.get("format") == FORMAT:
        if not isinstance(document.get("version"), int) or document["version"] > VERSION:
            raise StoreError(f"unsupported export version {document.get('version')!r} (this build reads {VERSION})")
        conversations = document.get("conversations")
    elif isinstance(document, dict) and "messages" in document:
        conversations = [document]
    else:
        raise StoreError("not an Arbor conversation export")
    if not isinstance(conversations, list):
        raise StoreError("the export's 'conversations' is not a list")
    return store.import_trees(conversations)


def read_json(store: ChatStore, path: Path) -> list[int]:
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StoreError(f"{path}: cannot read the export ({exc})") from exc
    return import_json(store, document)


def export_markdown(store: ChatStore, conversation_id: int) -> str:
    """The current path of one conversation as Markdown."""
    conversation = store.conversation(conversation_id)
    settings = store.settings(conversation_id)
    lines = [f"# {conversation.title}", ""]
    if settings.system_prompt:
        lines += ["> **System:** " + settings.system_prompt.replace("\n", "\n> "), ""]
    for item in store.path(conversation_id):
        message = item.message
        speaker = "You" if message.role == "user" else (message.model or "Assistant")
        _, answer = split_reasoning(message.content) if message.role == "assistant" else ("", message.content)
        lines += [f"## {speaker}", "", answer.strip(), ""]
    return "\n".join(lines).rstrip() + "\n"

"""Whole conversations as plain data: what ``ChatStore.export_tree`` writes and
``ChatStore.import_trees`` reads back (``desktop.transfer`` wraps them in a file format).

An exported tree::

    {"title", "title_source", "created_at", "updated_at", "pinned", "model",
     "settings": ChatSettings.to_dict(), "current_leaf": <message id>,
     "messages": [{"id", "parent", "role", "content", "status", "created_at",
                   "stats", "model", "error"}, ...]}   # parents before their children

Import is in two steps so that it is all or nothing: ``validate`` checks every conversation of
a file first and raises ``StoreError`` with one line naming the conversation and the problem;
only then does ``insert`` write them, all inside the caller's transaction. Values a file may hold
but Arbor would never store (unknown statuses, non-finite dates, statistics of the wrong kind)
are replaced by defaults rather than refused.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any, Hashable

from desktop.chat_settings import ChatSettings
from desktop.store.records import (
    PLACEHOLDER_TITLE,
    ROLES,
    TITLE_SOURCES,
    Conversation,
    Message,
    StoreError,
)
from desktop.store.rows import clean_stats, shown_value, valid_timestamp

#: Statuses an imported message may keep (a reply cannot still be streaming in a file).
_FINISHED_STATUSES = ("complete", "cancelled", "interrupted", "error")


def export_tree(conversation: Conversation, settings: ChatSettings, messages: list[Message]) -> dict[str, Any]:
    """``conversation`` with its effective ``settings`` and every message (oldest first)."""
    return {
        "title": conversation.title,
        "title_source": conversation.title_source,
        "created_at": conversation.created_at,
        "updated_at": conversation.updated_at,
        "pinned": conversation.pinned,
        "model": conversation.model,
        "settings": settings.to_dict(),
        "current_leaf": conversation.current_leaf_id,
        "messages": [
            {
                "id": m.id,
                "parent": m.parent_id,
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "created_at": m.created_at,
                "stats": m.stats,
                "model": m.model,
                "error": m.error,
            }
            for m in messages
        ],
    }


@dataclass(frozen=True)
class ImportedMessage:
    key: Hashable  # the message's id in the file
    parent_key: Hashable | None
    role: str
    content: str
    status: str
    created_at: float
    stats: dict[str, Any] | None
    model: str | None
    error: str | None


@dataclass(frozen=True)
class ImportedTree:
    """One conversation of a file, checked and with defaults filled in."""

    title: str
    title_source: str
    created_at: float
    updated_at: float
    pinned: bool
    model: str | None
    settings: ChatSettings
    current_leaf_key: Hashable | None
    messages: tuple[ImportedMessage, ...]


def validate(data: Any, *, now: float, label: str = "") -> ImportedTree:
    """``data`` (one exported tree) checked; ``StoreError`` otherwise, its message starting with
    ``label`` (which conversation of the file this is)."""
    prefix = f"{label}: " if label else ""
    if not isinstance(data, dict):
        raise StoreError(f"{prefix}not a conversation (an object with a message list)")
    raw_messages = data.get("messages")
    if not isinstance(raw_messages, list):
        raise StoreError(f"{prefix}conversation has no message list")
    messages: list[ImportedMessage] = []
    seen: set[Hashable] = set()
    for index, m in enumerate(raw_messages):
        problem = _message_problem(m, seen)
        if problem:
            raise StoreError(f"{prefix}message {index} {problem}")
        if m.get("id") is not None:
            seen.add(m["id"])
        stats, _dropped = clean_stats(m.get("stats"))
        messages.append(ImportedMessage(
            key=m.get("id"),
            parent_key=m.get("parent"),
            role=m["role"],
            content=m["content"],
            status=m.get("status") if m.get("status") in _FINISHED_STATUSES else "complete",
            created_at=_timestamp(m.get("created_at"), now),
            stats=stats,
            model=_text_or_none(m.get("model")),
            error=_text_or_none(m.get("error")),
        ))
    leaf = data.get("current_leaf")
    return ImportedTree(
        title=str(data.get("title") or PLACEHOLDER_TITLE),
        title_source=data.get("title_source") if data.get("title_source") in TITLE_SOURCES else "user",
        created_at=_timestamp(data.get("created_at"), now),
        updated_at=_timestamp(data.get("updated_at"), now),
        pinned=bool(data.get("pinned")),
        model=_text_or_none(data.get("model")),
        settings=ChatSettings.from_dict(data.get("settings") if isinstance(data.get("settings"), dict) else None),
        current_leaf_key=leaf if _is_key(leaf) and leaf in seen else None,
        messages=tuple(messages),
    )


def insert(db: sqlite3.Connection, tree: ImportedTree, defaults: ChatSettings) -> int:
    """Write one validated tree (new ids) inside the caller's transaction; returns its id."""
    cursor = db.execute(
        "INSERT INTO conversations (title, title_source, created_at, updated_at, pinned, model, settings)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (tree.title, tree.title_source, tree.created_at, tree.updated_at, int(tree.pinned), tree.model,
         json.dumps(tree.settings.to_overrides(defaults))),
    )
    conversation_id = int(cursor.lastrowid)
    new_ids: dict[Hashable, int] = {}
    last_id: int | None = None
    for m in tree.messages:
        cursor = db.execute(
            "INSERT INTO messages (conversation_id, parent_id, role, content, status, stats, model, error,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (conversation_id, new_ids.get(m.parent_key) if m.parent_key is not None else None, m.role,
             m.content, m.status, json.dumps(m.stats) if m.stats is not None else None, m.model, m.error,
             m.created_at),
        )
        last_id = int(cursor.lastrowid)
        if m.key is not None:
            new_ids[m.key] = last_id
    leaf = new_ids.get(tree.current_leaf_key) if tree.current_leaf_key is not None else last_id
    db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf, conversation_id))
    return conversation_id


def _message_problem(m: Any, seen: set[Hashable]) -> str | None:
    """Why message ``m`` cannot be imported (None: it can), given the ids before it."""
    if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
        return "is not a user/assistant message with text content"
    key, parent = m.get("id"), m.get("parent")
    if key is not None and not _is_key(key):
        return f"has an id that is not a number or text ({shown_value(key)})"
    if key is not None and key in seen:
        return f"repeats the id {key!r} of an earlier message"
    if parent is not None and not (_is_key(parent) and parent in seen):
        return f"answers message {shown_value(parent)}, which does not come before it"
    return None


def _is_key(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _timestamp(value: Any, default: float) -> float:
    seconds = valid_timestamp(value)
    return default if seconds is None else seconds


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None



"""Filling a store with many plain conversations at once (benchmarks, screenshots)."""

from __future__ import annotations

import sqlite3
from typing import Iterable

from desktop.store.records import Role


def insert_many(db: sqlite3.Connection, conversations: Iterable[tuple[str, list[tuple[Role, str]]]],
                now: float) -> None:
    """Insert ``(title, [(role, text), ...])`` linear conversations inside the caller's
    transaction, each an hour older than the one before it."""
    for index, (title, turns) in enumerate(conversations):
        stamp = now - index * 3600.0
        cursor = db.execute(
            "INSERT INTO conversations (title, title_source, created_at, updated_at) VALUES (?, 'user', ?, ?)",
            (title, stamp, stamp),
        )
        conversation_id = cursor.lastrowid
        parent = None
        for role, text in turns:
            parent = db.execute(
                "INSERT INTO messages (conversation_id, parent_id, role, content, created_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (conversation_id, parent, role, text, stamp),
            ).lastrowid
        db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (parent, conversation_id))

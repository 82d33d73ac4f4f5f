"""Databases holding rows Arbor never writes: one case per class of malformed row.

``make_database(path, case)`` writes a real conversation through ``ChatStore`` and then damages
one value with plain SQL, the way another tool, a hand edit or a damaged disk would (CHECK
constraints and foreign keys off where the damage needs it). ``raw_rows(path)`` reads every row
as stored bytes, so a test can show that reading the damaged file changed nothing.
"""

from __future__ import annotations

import sqlite3
from string import Template
from dataclasses import dataclass
from pathlib import Path

from desktop.chat_settings import ChatSettings
from desktop.store import ChatStore

#: Defaults that keep the tiny model's replies short and the same on every run.
TEST_DEFAULTS = ChatSettings(temperature=1.0, top_p=1.0, min_p=0.0, max_tokens=20, seed=7)


@dataclass(frozen=True)
class Chat:
    """The ids of the conversation ``make_database`` writes: u1 -> a1 -> u2 -> a2 (the leaf)."""

    conversation: int
    u1: int
    a1: int
    u2: int
    a2: int

    @property
    def messages(self) -> list[int]:
        return [self.u1, self.a1, self.u2, self.a2]


@dataclass(frozen=True)
class Case:
    """One class of malformed row. ``damage`` is SQL with ``$conversation``, ``$u1``, ... for
    the ids; ``where`` is which record carries the problem line (a message key of ``Chat``,
    ``"conversation"`` or ``"app"``); ``problem`` is a piece of that line."""

    name: str
    damage: str
    where: str
    problem: str


CASES = [
    Case("stats not JSON", "UPDATE messages SET stats = '{\"ttft_s\": 0.' WHERE id = $a1", "a1",
         "statistics unreadable"),
    Case("stats not an object", "UPDATE messages SET stats = '[1, 2]' WHERE id = $a1", "a1",
         "statistics unreadable"),
    Case("stats field of the wrong kind",
         "UPDATE messages SET stats = '{\"generated_tokens\": \"many\", \"ttft_s\": 0.5}' WHERE id = $a1", "a1",
         "statistics field 'generated_tokens' unreadable"),
    Case("unknown status", "UPDATE messages SET status = 'done' WHERE id = $a1", "a1", "unknown status 'done'"),
    Case("unknown role", "UPDATE messages SET role = 'system' WHERE id = $a1", "a1", "unknown role 'system'"),
    Case("text not UTF-8", "UPDATE messages SET content = CAST(x'616e73ff776572' AS TEXT) WHERE id = $a1", "a1",
         "text is not valid UTF-8"),
    Case("message date not a number", "UPDATE messages SET created_at = 'noon' WHERE id = $a1", "a1",
         "date unreadable"),
    Case("parent missing", "UPDATE messages SET parent_id = 9999 WHERE id = $u2", "u2",
         "earlier message 9999 is missing"),
    Case("reply's question missing", "UPDATE messages SET parent_id = 9999 WHERE id = $a1", "a1",
         "earlier message 9999 is missing"),
    Case("parents in a loop", "UPDATE messages SET parent_id = $a2 WHERE id = $u1", "u1",
         "loop back to it"),
    Case("chat settings not JSON", "UPDATE conversations SET settings = '{oops' WHERE id = $conversation",
         "conversation", "chat settings unreadable"),
    Case("chat settings not an object", "UPDATE conversations SET settings = '[]' WHERE id = $conversation",
         "conversation", "chat settings unreadable"),
    Case("unknown title source",
         "UPDATE conversations SET title_source = 'robot' WHERE id = $conversation", "conversation",
         "unknown title source 'robot'"),
    Case("title not UTF-8",
         "UPDATE conversations SET title = CAST(x'54726970ff' AS TEXT) WHERE id = $conversation",
         "conversation", "title is not valid UTF-8"),
    Case("chat date out of range",
         "UPDATE conversations SET updated_at = 1e300 WHERE id = $conversation", "conversation",
         "date unreadable"),
    Case("current message missing",
         "UPDATE conversations SET current_leaf_id = 9999 WHERE id = $conversation", "conversation",
         "current message 9999 is missing"),
    Case("current message in another chat",
         "UPDATE conversations SET current_leaf_id = (SELECT MIN(id) FROM messages) WHERE id = $conversation",
         "conversation", "is missing (showing the newest branch)"),
    Case("app setting not JSON", "UPDATE app_settings SET value = 'dark' WHERE key = 'theme'", "app",
         "stored setting 'theme' unreadable"),
    Case("chat defaults not an object",
         "UPDATE app_settings SET value = '[0.7]' WHERE key = 'chat_defaults'", "app",
         "stored setting 'chat_defaults' unreadable"),
]


def make_database(path: Path, case: Case | None = None) -> Chat:
    """A store file with one four-message conversation (plus another chat with one message,
    which the conversation must never show), damaged by ``case``."""
    store = ChatStore(path)
    store.set_default_settings(TEST_DEFAULTS)
    store.set_app_setting("theme", "light")
    other = store.create_conversation("Other chat")
    store.add_message(other.id, None, "user", "a message of another chat")
    chat = store.create_conversation("Trip")
    store.set_settings(chat.id, ChatSettings(system_prompt="Be brief."))
    u1 = store.add_message(chat.id, None, "user", "first question")
    a1 = store.add_message(chat.id, u1.id, "assistant", "answer one")
    store.finish_message(a1.id, "answer one", "complete", stats={"generated_tokens": 3, "ttft_s": 0.25})
    u2 = store.add_message(chat.id, a1.id, "user", "second question")
    a2 = store.add_message(chat.id, u2.id, "assistant", "answer two")
    store.set_app_setting("last_conversation", chat.id)
    ids = Chat(chat.id, u1.id, a1.id, u2.id, a2.id)
    store.close()
    if case is not None:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA ignore_check_constraints = ON")
        db.execute(Template(case.damage).substitute(ids.__dict__))
        db.close()
    return ids


def raw_rows(path: Path) -> dict[str, list[tuple]]:
    """Every row of the data tables, values as stored (text as bytes)."""
    db = sqlite3.connect(path)
    db.text_factory = bytes
    try:
        return {table: db.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall()
                for table in ("conversations", "messages", "app_settings")}
    finally:
        db.close()

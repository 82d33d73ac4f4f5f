"""The conversation database's schema, its migrations, and opening a connection.

Schema versions live in ``PRAGMA user_version``; ``MIGRATIONS[v]`` upgrades v-1 to v inside one
transaction, and a database from a newer Arbor is refused rather than damaged. Before a file is
migrated it is copied to ``<file>.v<old version>.bak``.

Durability: WAL journal with ``synchronous=NORMAL`` - every committed write survives a killed
process (the WAL is in the OS page cache); an OS crash may lose the last few commits, never
corrupt the file.
"""

from __future__ import annotations

import sqlite3
from typing import Callable

from desktop.store.records import StoreError
from desktop.store.rows import decode_text


def run_script(db: sqlite3.Connection, script: str) -> None:
    """Run SQL statements one by one inside the caller's transaction (``executescript`` would
    commit it first)."""
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            db.execute(pending)
            pending = ""
    if pending.strip():
        raise ValueError(f"incomplete SQL statement: {pending.strip()[:60]}")


def _migrate_v1_core(db: sqlite3.Connection) -> None:
    """Conversations, the message tree and app settings."""
    run_script(db,
        """
        CREATE TABLE conversations (
            id              INTEGER PRIMARY KEY,
            title           TEXT NOT NULL,
            title_source    TEXT NOT NULL DEFAULT 'placeholder',
            created_at      REAL NOT NULL,
            updated_at      REAL NOT NULL,
            pinned          INTEGER NOT NULL DEFAULT 0,
            deleted_at      REAL,
            model           TEXT,
            settings        TEXT NOT NULL DEFAULT '{}',
            current_leaf_id INTEGER
        );
        CREATE INDEX conversations_in_sidebar_order
            ON conversations (pinned DESC, updated_at DESC, id DESC) WHERE deleted_at IS NULL;
        CREATE TABLE messages (
            id              INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            parent_id       INTEGER REFERENCES messages (id) ON DELETE CASCADE,
            role            TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
            content         TEXT NOT NULL,
            status          TEXT NOT NULL DEFAULT 'complete',
            error           TEXT,
            stats           TEXT,
            model           TEXT,
            created_at      REAL NOT NULL
        );
        CREATE INDEX messages_by_conversation ON messages (conversation_id, parent_id, id);
        CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming';
        CREATE TABLE app_settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        """
    )


def _migrate_v2_search(db: sqlite3.Connection) -> None:
    """FTS5 indexes over titles and messages, kept current by triggers, back-filled once.

    A reply being streamed is not indexed until it ends: its checkpoints would otherwise
    re-index the whole growing text many times a second.
    """
    run_script(db,
        """
        CREATE VIRTUAL TABLE message_search USING fts5 (content, tokenize = 'unicode61 remove_diacritics 2');
        CREATE VIRTUAL TABLE title_search USING fts5 (title, tokenize = 'unicode61 remove_diacritics 2');
        CREATE TRIGGER message_indexed AFTER INSERT ON messages WHEN new.status != 'streaming' BEGIN
            INSERT INTO message_search (rowid, content) VALUES (new.id, new.content);
        END;
        CREATE TRIGGER message_reindexed AFTER UPDATE OF content, status ON messages BEGIN
            DELETE FROM message_search WHERE rowid = old.id;
            INSERT INTO message_search (rowid, content)
                SELECT new.id, new.content WHERE new.status != 'streaming';
        END;
        CREATE TRIGGER message_unindexed AFTER DELETE ON messages BEGIN
            DELETE FROM message_search WHERE rowid = old.id;
        END;
        CREATE TRIGGER title_indexed AFTER INSERT ON conversations BEGIN
            INSERT INTO title_search (rowid, title) VALUES (new.id, new.title);
        END;
        CREATE TRIGGER title_reindexed AFTER UPDATE OF title ON conversations BEGIN
            DELETE FROM title_search WHERE rowid = old.id;
            INSERT INTO title_search (rowid, title) VALUES (new.id, new.title);
        END;
        CREATE TRIGGER title_unindexed AFTER DELETE ON conversations BEGIN
            DELETE FROM title_search WHERE rowid = old.id;
        END;
        INSERT INTO message_search (rowid, content)
            SELECT id, content FROM messages WHERE status != 'streaming';
        INSERT INTO title_search (rowid, title) SELECT id, title FROM conversations;
        """
    )


#: ``MIGRATIONS[v]`` turns a version ``v - 1`` database into version ``v``.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _migrate_v1_core,
    2: _migrate_v2_search,
}
SCHEMA_VERSION = max(MIGRATIONS)


class Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error) on an autocommit connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, value, traceback) -> None:
        self._db.execute("ROLLBACK" if kind is not None else "COMMIT")


def schema_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def open_database(location: str) -> sqlite3.Connection:
    """An autocommit connection to ``location`` (``":memory:"`` for tests), migrated to
    ``SCHEMA_VERSION``. Raises ``StoreError`` for a file from a newer Arbor or a file that is not
    a database."""
    try:
        db = sqlite3.connect(location, isolation_level=None)
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{location}: cannot open the conversation database ({exc})") from exc
    try:
        db.row_factory = sqlite3.Row
        db.text_factory = decode_text  # text that is not UTF-8 must not make a whole query fail
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA foreign_keys = ON")
        db.execute("PRAGMA busy_timeout = 5000")
        _migrate(db, location)
    except BaseException as exc:
        db.close()
        if isinstance(exc, sqlite3.DatabaseError):
            raise StoreError(f"{location}: cannot open the conversation database ({exc})") from exc
        raise
    return db


def _migrate(db: sqlite3.Connection, location: str) -> None:
    current = schema_version(db)
    if current > SCHEMA_VERSION:
        raise StoreError(
            f"{location} was written by a newer Arbor (schema v{current}; this build reads up to "
            f"v{SCHEMA_VERSION})"
        )
    if current and current < SCHEMA_VERSION and location != ":memory:":
        backup = sqlite3.connect(f"{location}.v{current}.bak")
        with backup:
            db.backup(backup)
        backup.close()
    for version in range(current + 1, SCHEMA_VERSION + 1):
        with Transaction(db):
            MIGRATIONS[version](db)
            db.execute(f"PRAGMA user_version = {version}")

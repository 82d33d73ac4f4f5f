"""Conversations in SQLite: a message tree per chat, per-chat settings, full-text search.

Scope: everything the app persists about chats. One ``ChatStore`` per process, used only from the
GUI thread (the connection refuses other threads). Non-scope: the model store (models live in
``backend.models.store``), rendering, generation.

Shape of the data
    conversation  id, title (+ where it came from: placeholder / auto / user), timestamps,
                  pinned, soft-delete mark, model reference, settings overrides (JSON), and the
                  leaf of the path the user is looking at (``current_leaf_id``).
    message       a node of the conversation's tree: ``parent_id`` is the message it answers or
                  follows (``None`` for the first). Editing a user message or regenerating a reply
                  adds a *sibling* (same parent); nothing is overwritten. A reply being streamed
                  has ``status='streaming'`` and its content is checkpointed as it grows, so a
                  crash loses nothing already shown; on the next open such replies become
                  ``'interrupted'``.

Durability: WAL journal with ``synchronous=NORMAL`` - every committed write survives a killed
process (the WAL is in the OS page cache); an OS crash may lose the last few commits, never
corrupt the file.

Schema versions live in ``PRAGMA user_version``; ``MIGRATIONS[v]`` upgrades v-1 to v inside one
transaction, and a database from a newer Arbor is refused rather than damaged.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from backend.errors import ArborError
from desktop.chat_settings import ChatSettings

Role = Literal["user", "assistant"]
MessageStatus = Literal["complete", "streaming", "cancelled", "interrupted", "error"]
TitleSource = Literal["placeholder", "auto", "user"]

PLACEHOLDER_TITLE = "New chat"
CHAT_DEFAULTS_KEY = "chat_defaults"
#: Markers around matched words in search snippets (control characters never typed by users).
HIT_START, HIT_END = "\x02", "\x03"


class StoreError(ArborError):
    """The conversation database cannot be used (newer schema, unreadable file, bad import)."""


# ---------------------------------------------------------------------------------------------
# Plain data handed to the UI


@dataclass(frozen=True)
class ConversationSummary:
    """What the sidebar shows for one conversation."""

    id: int
    title: str
    created_at: float
    updated_at: float
    pinned: bool


@dataclass(frozen=True)
class Conversation:
    """One conversation's own fields (its messages come from ``ChatStore.path``)."""

    id: int
    title: str
    title_source: TitleSource
    created_at: float
    updated_at: float
    pinned: bool
    model: str | None
    settings_overrides: dict[str, Any]
    current_leaf_id: int | None

    @property
    def summary(self) -> ConversationSummary:
        return ConversationSummary(self.id, self.title, self.created_at, self.updated_at, self.pinned)


@dataclass(frozen=True)
class Message:
    """One node of a conversation's tree. ``stats`` is the reply's statistics (see
    ``desktop.worker.stats_from_done``); ``model`` names the model that wrote a reply."""

    id: int
    conversation_id: int
    parent_id: int | None
    role: Role
    content: str
    status: MessageStatus
    created_at: float
    stats: dict[str, Any] | None = None
    model: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class PathItem:
    """A message on the displayed path plus its siblings (itself included, oldest first)."""

    message: Message
    sibling_ids: tuple[int, ...] = field(default=())

    @property
    def sibling_index(self) -> int:
        return self.sibling_ids.index(self.message.id) if self.sibling_ids else 0

    @property
    def sibling_count(self) -> int:
        return max(len(self.sibling_ids), 1)


@dataclass(frozen=True)
class SearchHit:
    """A search result: a conversation title (``message_id is None``) or one message.
    ``snippet`` marks matched words with ``HIT_START``/``HIT_END``."""

    conversation_id: int
    message_id: int | None
    title: str
    snippet: str


# ---------------------------------------------------------------------------------------------
# Schema and migrations


def _run_script(db: sqlite3.Connection, script: str) -> None:
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
    _run_script(db, 
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
    _run_script(db, 
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


def fts_query(text: str) -> str | None:
    """An FTS5 query for what a user typed: every word must match, the last one as a prefix
    (so results appear while typing). ``None`` when there is nothing searchable."""
    words = [w for w in text.split() if any(ch.isalnum() for ch in w)]
    if not words:
        return None
    quoted = ['"' + w.replace('"', '""') + '"' for w in words]
    quoted[-1] += "*"
    return " ".join(quoted)


# ---------------------------------------------------------------------------------------------
# The store


class ChatStore:
    """All conversations of one data dir. See the module docstring for the data's shape."""

    def __init__(self, path: Path | str, *, clock: Callable[[], float] = time.time) -> None:
        """Open (creating or migrating) the database at ``path``; ``":memory:"`` for tests.

        Replies left ``'streaming'`` by a crashed or killed process become ``'interrupted'``.
        Raises ``StoreError`` for a file from a newer Arbor or a file that is not a database.
        """
        self.location = str(path)
        self._clock = clock
        if self.location != ":memory:":
            Path(self.location).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.location, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.execute("PRAGMA busy_timeout = 5000")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.location}: cannot open the conversation database ({exc})") from exc
        self.interrupted_on_open = self._mark_interrupted()

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self._db is not None:
            self._db.close()
            self._db = None  # type: ignore[assignment]

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        current = self.schema_version
        if current > SCHEMA_VERSION:
            raise StoreError(
                f"{self.location} was written by a newer Arbor (schema v{current}; this build reads up to "
                f"v{SCHEMA_VERSION})"
            )
        if current and current < SCHEMA_VERSION and self.location != ":memory:":
            backup = sqlite3.connect(f"{self.location}.v{current}.bak")
            with backup:
                self._db.backup(backup)
            backup.close()
        for version in range(current + 1, SCHEMA_VERSION + 1):
            with self._transaction():
                MIGRATIONS[version](self._db)
                self._db.execute(f"PRAGMA user_version = {version}")

    def _transaction(self):
        return _Transaction(self._db)

    def _mark_interrupted(self) -> int:
        cursor = self._db.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming'")
        return cursor.rowcount

    # -- conversations ---------------------------------------------------------------------------

    def create_conversation(
        self,
        title: str = PLACEHOLDER_TITLE,
        *,
        model: str | None = None,
        settings_overrides: dict[str, Any] | None = None,
    ) -> Conversation:
        """A new, empty conversation at the top of the sidebar."""
        now = self._clock()
        source = "placeholder" if title == PLACEHOLDER_TITLE else "user"
        cursor = self._db.execute(
            "INSERT INTO conversations (title, title_source, created_at, updated_at, model, settings)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (title, source, now, now, model, json.dumps(settings_overrides or {})),
        )
        return self.conversation(int(cursor.lastrowid))

    def conversation(self, conversation_id: int) -> Conversation:
        """The conversation ``conversation_id`` (``KeyError`` if there is none or it is deleted)."""
        row = self._db.execute(
            "SELECT * FROM conversations WHERE id = ? AND deleted_at IS NULL", (conversation_id,)
        ).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return _conversation_from_row(row)

    def count_conversations(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM conversations WHERE deleted_at IS NULL").fetchone()[0])

    def list_conversations(self, offset: int = 0, limit: int = 100) -> list[ConversationSummary]:
        """A page of the sidebar: pinned first, then the most recently active."""
        rows = self._db.execute(
            "SELECT id, title, created_at, updated_at, pinned FROM conversations WHERE deleted_at IS NULL"
            " ORDER BY pinned DESC, updated_at DESC, id DESC LIMIT ? OFFSET ?",
            (limit, offset),
        ).fetchall()
        return [ConversationSummary(r["id"], r["title"], r["created_at"], r["updated_at"], bool(r["pinned"])) for r in rows]

    def rename(self, conversation_id: int, title: str, *, source: TitleSource = "user") -> None:
        """Set the title; an automatic title never replaces one the user chose."""
        title = " ".join(title.split()) or PLACEHOLDER_TITLE
        if source == "auto":
            self._db.execute(
                "UPDATE conversations SET title = ?, title_source = 'auto' WHERE id = ? AND title_source != 'user'",
                (title, conversation_id),
            )
        else:
            self._db.execute(
                "UPDATE conversations SET title = ?, title_source = ? WHERE id = ?", (title, source, conversation_id)
            )

    def set_pinned(self, conversation_id: int, pinned: bool) -> None:
        self._db.execute("UPDATE conversations SET pinned = ? WHERE id = ?", (int(pinned), conversation_id))

    def set_model(self, conversation_id: int, model: str | None) -> None:
        self._db.execute("UPDATE conversations SET model = ? WHERE id = ?", (model, conversation_id))

    def delete(self, conversation_id: int) -> None:
        """Hide the conversation (undoable with ``restore`` until ``purge_deleted``)."""
        self._db.execute(
            "UPDATE conversations SET deleted_at = ? WHERE id = ? AND deleted_at IS NULL",
            (self._clock(), conversation_id),
        )

    def restore(self, conversation_id: int) -> None:
        """Undo ``delete``."""
        self._db.execute("UPDATE conversations SET deleted_at = NULL WHERE id = ?", (conversation_id,))

    def purge_deleted(self) -> int:
        """Remove deleted conversations for good (with their messages); returns how many."""
        with self._transaction():
            return self._db.execute("DELETE FROM conversations WHERE deleted_at IS NOT NULL").rowcount

    # -- settings --------------------------------------------------------------------------------

    def app_setting(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM app_settings WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_app_setting(self, key: str, value: Any) -> None:
        self._db.execute(
            "INSERT INTO app_settings (key, value) VALUES (?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )

    def default_settings(self) -> ChatSettings:
        """The app-wide defaults every chat starts from."""
        return ChatSettings.from_dict(self.app_setting(CHAT_DEFAULTS_KEY))

    def set_default_settings(self, settings: ChatSettings) -> None:
        self.set_app_setting(CHAT_DEFAULTS_KEY, settings.validated().to_dict())

    def settings(self, conversation_id: int) -> ChatSettings:
        """The effective settings of one chat: the defaults plus its overrides."""
        return ChatSettings.from_dict(self.conversation(conversation_id).settings_overrides, self.default_settings())

    def set_settings(self, conversation_id: int, settings: ChatSettings) -> None:
        """Store ``settings`` for one chat as overrides of the current defaults."""
        overrides = settings.validated().to_overrides(self.default_settings())
        self._db.execute("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(overrides), conversation_id))

    # -- messages --------------------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: int,
        parent_id: int | None,
        role: Role,
        content: str,
        *,
        status: MessageStatus = "complete",
        model: str | None = None,
    ) -> Message:
        """Append a node under ``parent_id`` and make it the conversation's current leaf."""
        if parent_id is not None:
            parent = self.message(parent_id)
            if parent.conversation_id != conversation_id:
                raise ValueError(f"message {parent_id} belongs to conversation {parent.conversation_id}, "
                                 f"not {conversation_id}")
        now = self._clock()
        with self._transaction():
            cursor = self._db.execute(
                "INSERT INTO messages (conversation_id, parent_id, role, content, status, model, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, parent_id, role, content, status, model, now),
            )
            message_id = int(cursor.lastrowid)
            self._db.execute(
                "UPDATE conversations SET current_leaf_id = ?, updated_at = ? WHERE id = ?",
                (message_id, now, conversation_id),
            )
        return self.message(message_id)

    def checkpoint(self, message_id: int, content: str) -> None:
        """Save the text streamed so far (one small committed UPDATE)."""
        self._db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, message_id))

    def finish_message(
        self,
        message_id: int,
        content: str,
        status: MessageStatus,
        *,
        stats: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """Record a reply's final text, status and statistics."""
        self._db.execute(
            "UPDATE messages SET content = ?, status = ?, stats = ?, error = ? WHERE id = ?",
            (content, status, json.dumps(stats) if stats is not None else None, error, message_id),
        )

    def message(self, message_id: int) -> Message:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return _message_from_row(row)

    def children(self, conversation_id: int) -> dict[int | None, list[int]]:
        """``{parent_id: [child ids, oldest first]}`` for the whole tree."""
        tree: dict[int | None, list[int]] = {}
        for row in self._db.execute(
            "SELECT id, parent_id FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ):
            tree.setdefault(row[1], []).append(row[0])
        return tree

    def path(self, conversation_id: int) -> list[PathItem]:
        """The messages from the first one down to the current leaf, each with its siblings."""
        conversation = self.conversation(conversation_id)
        if conversation.current_leaf_id is None:
            return []
        tree = self.children(conversation_id)
        parent_of = {child: parent for parent, kids in tree.items() for child in kids}
        chain: list[int] = []
        node: int | None = conversation.current_leaf_id
        while node is not None:
            chain.append(node)
            node = parent_of.get(node)
        chain.reverse()
        rows = {
            row["id"]: _message_from_row(row)
            for row in self._db.execute(
                f"SELECT * FROM messages WHERE id IN ({','.join('?' * len(chain))})", chain
            )
        }
        return [PathItem(rows[i], tuple(tree.get(rows[i].parent_id, [i]))) for i in chain]

    def lineage(self, message_id: int) -> list[Message]:
        """``message_id`` and its ancestors, the first message first (what a reply answers)."""
        rows = self._db.execute(
            "WITH RECURSIVE chain (id, depth) AS (SELECT ?, 0 UNION ALL"
            " SELECT m.parent_id, chain.depth + 1 FROM messages m JOIN chain ON m.id = chain.id"
            " WHERE m.parent_id IS NOT NULL)"
            " SELECT messages.* FROM chain JOIN messages ON messages.id = chain.id ORDER BY chain.depth DESC",
            (message_id,),
        ).fetchall()
        if not rows:
            raise KeyError(f"no message {message_id}")
        return [_message_from_row(r) for r in rows]

    def select_message(self, message_id: int) -> int:
        """Show the branch through ``message_id``: the new leaf is found by following the newest
        child from there. Returns the leaf's id."""
        message = self.message(message_id)
        tree = self.children(message.conversation_id)
        leaf = message_id
        while tree.get(leaf):
            leaf = tree[leaf][-1]
        self._db.execute(
            "UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf, message.conversation_id)
        )
        return leaf

    def set_current_leaf(self, conversation_id: int, message_id: int | None) -> None:
        self._db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (message_id, conversation_id))

    def streaming_messages(self) -> list[Message]:
        rows = self._db.execute("SELECT * FROM messages WHERE status = 'streaming'").fetchall()
        return [_message_from_row(r) for r in rows]

    # -- search ----------------------------------------------------------------------------------

    def search(self, text: str, limit: int = 200) -> list[SearchHit]:
        """Conversations whose title matches, then messages that match, best first."""
        query = fts_query(text)
        if query is None:
            return []
        hits: list[SearchHit] = []
        for row in self._db.execute(
            "SELECT c.id, c.title, highlight(title_search, 0, ?, ?) FROM title_search"
            " JOIN conversations c ON c.id = title_search.rowid"
            " WHERE title_search MATCH ? AND c.deleted_at IS NULL ORDER BY rank LIMIT ?",
            (HIT_START, HIT_END, query, limit),
        ):
            hits.append(SearchHit(row[0], None, row[1], row[2]))
        for row in self._db.execute(
            "SELECT m.conversation_id, m.id, c.title, snippet(message_search, 0, ?, ?, '…', 12)"
            " FROM message_search JOIN messages m ON m.id = message_search.rowid"
            " JOIN conversations c ON c.id = m.conversation_id"
            " WHERE message_search MATCH ? AND c.deleted_at IS NULL ORDER BY rank LIMIT ?",
            (HIT_START, HIT_END, query, limit),
        ):
            hits.append(SearchHit(row[0], row[1], row[2], row[3]))
        return hits[:limit]

    # -- whole trees (export / import) -----------------------------------------------------------

    def export_tree(self, conversation_id: int) -> dict[str, Any]:
        """The whole conversation as plain JSON-able data (see ``desktop.transfer``)."""
        conversation = self.conversation(conversation_id)
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        messages = [_message_from_row(r) for r in rows]
        return {
            "title": conversation.title,
            "title_source": conversation.title_source,
            "created_at": conversation.created_at,
            "updated_at": conversation.updated_at,
            "pinned": conversation.pinned,
            "model": conversation.model,
            "settings": self.settings(conversation_id).to_dict(),
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

    def import_tree(self, data: dict[str, Any]) -> int:
        """Insert a conversation exported by ``export_tree`` (new ids); returns its id.

        Validates the tree first (known roles, parents that exist earlier in the file) and raises
        ``StoreError`` naming the problem; nothing is written unless the whole tree is valid.
        """
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise StoreError("conversation has no message list")
        seen: set[Any] = set()
        for index, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or not isinstance(m.get("content"), str):
                raise StoreError(f"message {index} is not a user/assistant message with text content")
            if m.get("parent") is not None and m["parent"] not in seen:
                raise StoreError(f"message {index} answers message {m['parent']!r}, which does not come before it")
            seen.add(m.get("id"))
        now = self._clock()
        title = str(data.get("title") or PLACEHOLDER_TITLE)
        settings = ChatSettings.from_dict(data.get("settings") if isinstance(data.get("settings"), dict) else None)
        overrides = settings.to_overrides(self.default_settings())
        with self._transaction():
            cursor = self._db.execute(
                "INSERT INTO conversations (title, title_source, created_at, updated_at, pinned, model, settings)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    title,
                    data.get("title_source") if data.get("title_source") in ("placeholder", "auto", "user") else "user",
                    _number(data.get("created_at"), now),
                    _number(data.get("updated_at"), now),
                    int(bool(data.get("pinned"))),
                    data.get("model") if isinstance(data.get("model"), str) else None,
                    json.dumps(overrides),
                ),
            )
            conversation_id = int(cursor.lastrowid)
            new_ids: dict[Any, int] = {}
            for m in messages:
                status = m.get("status") if m.get("status") in ("complete", "cancelled", "interrupted", "error") else "complete"
                stats = m.get("stats") if isinstance(m.get("stats"), dict) else None
                cursor = self._db.execute(
                    "INSERT INTO messages (conversation_id, parent_id, role, content, status, stats, model, error,"
                    " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        conversation_id,
                        new_ids.get(m.get("parent")) if m.get("parent") is not None else None,
                        m["role"],
                        m["content"],
                        status,
                        json.dumps(stats) if stats is not None else None,
                        m.get("model") if isinstance(m.get("model"), str) else None,
                        m.get("error") if isinstance(m.get("error"), str) else None,
                        _number(m.get("created_at"), now),
                    ),
                )
                new_ids[m.get("id")] = int(cursor.lastrowid)
            leaf = new_ids.get(data.get("current_leaf"))
            if leaf is None and new_ids:
                leaf = list(new_ids.values())[-1]
            self._db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf, conversation_id))
        return conversation_id

    # -- bulk helpers (benchmarks, screenshots) ----------------------------------------------------

    def insert_many(self, conversations: Iterable[tuple[str, list[tuple[Role, str]]]]) -> None:
        """Insert ``(title, [(role, text), ...])`` linear conversations in one transaction."""
        now = self._clock()
        with self._transaction():
            for index, (title, turns) in enumerate(conversations):
                stamp = now - index * 3600.0
                cursor = self._db.execute(
                    "INSERT INTO conversations (title, title_source, created_at, updated_at) VALUES (?, 'user', ?, ?)",
                    (title, stamp, stamp),
                )
                conversation_id = cursor.lastrowid
                parent = None
                for role, text in turns:
                    parent = self._db.execute(
                        "INSERT INTO messages (conversation_id, parent_id, role, content, created_at)"
                        " VALUES (?, ?, ?, ?, ?)",
                        (conversation_id, parent, role, text, stamp),
                    ).lastrowid
                self._db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (parent, conversation_id))


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error) on an autocommit connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, value, traceback) -> None:
        self._db.execute("ROLLBACK" if kind is not None else "COMMIT")


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _conversation_from_row(row: sqlite3.Row) -> Conversation:
    try:
        overrides = json.loads(row["settings"] or "{}")
    except ValueError:
        overrides = {}
    return Conversation(
        id=row["id"],
        title=row["title"],
        title_source=row["title_source"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        pinned=bool(row["pinned"]),
        model=row["model"],
        settings_overrides=overrides if isinstance(overrides, dict) else {},
        current_leaf_id=row["current_leaf_id"],
    )


def _message_from_row(row: sqlite3.Row) -> Message:
    stats = json.loads(row["stats"]) if row["stats"] else None
    return Message(
        id=row["id"],
        conversation_id=row["conversation_id"],
        parent_id=row["parent_id"],
        role=row["role"],
        content=row["content"],
        status=row["status"],
        created_at=row["created_at"],
        stats=stats,
        model=row["model"],
        error=row["error"],
    )

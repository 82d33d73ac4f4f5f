"""``ChatStore``: every conversation of one data dir, in SQLite.

Scope: everything the app persists about chats. One ``ChatStore`` per process, used only from the
GUI thread (the connection refuses other threads). Non-scope: the model store (models live in
``backend.weights.store``), rendering, generation.

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

Reading never fails on what a row holds: unreadable values are shown as absent and named in the
record's ``problems`` (``desktop.store.rows``), broken parent links are repaired in the view
(``desktop.store.tree``), and nothing stored is rewritten for it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

from desktop.chat_settings import ChatSettings
from desktop.store import bulk, trees
from desktop.store.records import (
    CHAT_DEFAULTS_KEY,
    HIT_END,
    HIT_START,
    PLACEHOLDER_TITLE,
    Conversation,
    ConversationSummary,
    Message,
    MessageStatus,
    PathItem,
    Role,
    SearchHit,
    StoreError,
    TitleSource,
)
from desktop.store.rows import MESSAGE_COLUMNS, RowReader, shown_value
from desktop.store.schema import Transaction, open_database, schema_version
from desktop.store.tree import MessageTree


def fts_query(text: str) -> str | None:
    """An FTS5 query for what a user typed: every word must match, the last one as a prefix
    (so results appear while typing). ``None`` when there is nothing searchable."""
    words = [w for w in text.split() if any(ch.isalnum() for ch in w)]
    if not words:
        return None
    quoted = ['"' + w.replace('"', '""') + '"' for w in words]
    quoted[-1] += "*"
    return " ".join(quoted)


class ChatStore:
    """All conversations of one data dir. See the module docstring for the data's shape."""

    def __init__(self, path: Path | str, *, clock: Callable[[], float] = time.time) -> None:
        """Open (creating or migrating) the database at ``path``; ``":memory:"`` for tests.

        Replies left ``'streaming'`` by a crashed or killed process become ``'interrupted'``.
        Raises ``StoreError`` for a file from a newer Arbor or a file that is not a database.
        ``app_setting_problems`` names the app settings that could not be read (key -> line).
        """
        self.location = str(path)
        self._clock = clock
        if self.location != ":memory:":
            Path(self.location).parent.mkdir(parents=True, exist_ok=True)
        self._db = open_database(self.location)
        self._rows = RowReader(self.location)
        self.interrupted_on_open = self._mark_interrupted()
        self.app_setting_problems: dict[str, str] = self._check_app_settings()

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self._db is not None:
            self._db.close()
            self._db = None  # type: ignore[assignment]

    @property
    def schema_version(self) -> int:
        return schema_version(self._db)

    def _transaction(self) -> Transaction:
        return Transaction(self._db)

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
        """The conversation ``conversation_id`` (``KeyError`` if there is none or it is deleted).

        A stored current leaf that is not a message of this conversation (or none while it has
        messages) is shown as the newest message's branch, with a problem line."""
        row = self._db.execute(
            "SELECT c.*,"
            " EXISTS (SELECT 1 FROM messages m WHERE m.id = c.current_leaf_id AND m.conversation_id = c.id)"
            " AS leaf_found,"
            " EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id) AS has_messages"
            " FROM conversations c WHERE c.id = ? AND c.deleted_at IS NULL",
            (conversation_id,),
        ).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        conversation = self._rows.conversation(row)
        stored_leaf = row["current_leaf_id"]
        if row["leaf_found"] or (stored_leaf is None and not row["has_messages"]):
            return conversation
        leaf = self._tree(conversation_id).newest_leaf(None)
        problem = ("no current message" if stored_leaf is None
                   else f"current message {shown_value(stored_leaf)} is missing")
        problem += " (showing the newest branch)" if leaf is not None else ""
        self._rows.report("conversation", conversation_id, problem)
        return replace(conversation, current_leaf_id=leaf, problems=conversation.problems + (problem,))

    def count_conversations(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM conversations WHERE deleted_at IS NULL").fetchone()[0])

    def list_conversations(self, offset: int = 0, limit: int = 100) -> list[ConversationSummary]:
        """A page of the sidebar: pinned first, then the most recently active."""
        rows = self._db.execute(
            "SELECT id, title, created_at, updated_at, pinned FROM conversations WHERE deleted_at IS NULL"
            " ORDER BY pinned DESC, updated_at DESC, id DESC LIMIT ? OFFSET ?",
            (limit, offset),
        ).fetchall()
        return [self._rows.summary(r) for r in rows]

    def rename(self, conversation_id: int, title: str, *, source: TitleSource = "user") -> None:
        """Set the title; an automatic title never replaces one the user chose."""
        title = " ".join(title.split()) or PLACEHOLDER_TITLE
        if source == "auto":
            self._db.execute(
                "UPDATE conversations SET title = ?, title_source = 'auto'"
                " WHERE id = ? AND title_source IN ('placeholder', 'auto')",
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
        """The stored JSON value of ``key``; ``default`` when there is none or it is unreadable."""
        row = self._db.execute("SELECT value FROM app_settings WHERE key = ?", (key,)).fetchone()
        return default if row is None else self._rows.app_setting(key, row[0], default)[0]

    def set_app_setting(self, key: str, value: Any) -> None:
        self._db.execute(
            "INSERT INTO app_settings (key, value) VALUES (?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )
        self.app_setting_problems.pop(key, None)

    def default_settings(self) -> ChatSettings:
        """The app-wide defaults every chat starts from (the built-in ones when unreadable)."""
        stored = self.app_setting(CHAT_DEFAULTS_KEY)
        return ChatSettings.from_dict(stored if isinstance(stored, dict) else None)

    def set_default_settings(self, settings: ChatSettings) -> None:
        self.set_app_setting(CHAT_DEFAULTS_KEY, settings.validated().to_dict())

    def settings(self, conversation_id: int) -> ChatSettings:
        """The effective settings of one chat: the defaults plus its overrides."""
        return ChatSettings.from_dict(self.conversation(conversation_id).settings_overrides, self.default_settings())

    def set_settings(self, conversation_id: int, settings: ChatSettings) -> None:
        """Store ``settings`` for one chat as overrides of the current defaults."""
        overrides = settings.validated().to_overrides(self.default_settings())
        self._db.execute("UPDATE conversations SET settings = ? WHERE id = ?", (json.dumps(overrides), conversation_id))

    def _check_app_settings(self) -> dict[str, str]:
        problems: dict[str, str] = {}
        for key, raw in self._db.execute("SELECT key, value FROM app_settings ORDER BY key"):
            value, problem = self._rows.app_setting(key, raw, None)
            if problem is None and key == CHAT_DEFAULTS_KEY and not isinstance(value, dict):
                problem = f"stored setting {key!r} unreadable (using the default)"
                self._rows.report("app setting", key, problem)
            if problem is not None:
                problems[key] = problem
        return problems

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
        row = self._db.execute(f"SELECT {MESSAGE_COLUMNS} FROM messages m WHERE m.id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return self._rows.message(row)

    def children(self, conversation_id: int) -> dict[int | None, list[int]]:
        """``{parent_id: [child ids, oldest first]}`` for the whole tree (broken links repaired,
        see ``desktop.store.tree``)."""
        return self._tree(conversation_id).children

    def path(self, conversation_id: int) -> list[PathItem]:
        """The messages from the first one down to the current leaf, each with its siblings."""
        conversation = self.conversation(conversation_id)
        if conversation.current_leaf_id is None:
            return []
        tree = self._tree(conversation_id)
        chain = tree.chain(conversation.current_leaf_id)
        messages = self._messages(chain, tree)
        return [PathItem(messages[i], tree.siblings(i)) for i in chain]

    def lineage(self, message_id: int) -> list[Message]:
        """``message_id`` and its ancestors, the first message first (what a reply answers)."""
        tree = self._tree(self.message(message_id).conversation_id)
        chain = tree.chain(message_id)
        messages = self._messages(chain, tree)
        return [messages[i] for i in chain]

    def select_message(self, message_id: int) -> int:
        """Show the branch through ``message_id``: the new leaf is found by following the newest
        child from there. Returns the leaf's id."""
        message = self.message(message_id)
        leaf = self._tree(message.conversation_id).newest_leaf(message_id)
        self._db.execute(
            "UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf, message.conversation_id)
        )
        return leaf

    def set_current_leaf(self, conversation_id: int, message_id: int | None) -> None:
        self._db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (message_id, conversation_id))

    def streaming_messages(self) -> list[Message]:
        rows = self._db.execute(f"SELECT {MESSAGE_COLUMNS} FROM messages m WHERE m.status = 'streaming'").fetchall()
        return [self._rows.message(r) for r in rows]

    def _tree(self, conversation_id: int) -> MessageTree:
        return MessageTree(
            (row[0], row[1])
            for row in self._db.execute("SELECT id, parent_id FROM messages WHERE conversation_id = ?", (conversation_id,))
        )

    def _messages(self, ids: list[int], tree: MessageTree) -> dict[int, Message]:
        """The messages ``ids`` of one conversation by id, with the tree's repairs applied."""
        rows = self._db.execute(
            f"SELECT {MESSAGE_COLUMNS} FROM messages m WHERE m.id IN ({','.join('?' * len(ids))})", ids
        ).fetchall()
        messages = {}
        for row in rows:
            message = self._rows.message(row)
            loop = tree.problems.get(message.id)
            if loop is not None:
                self._rows.report("message", message.id, loop)
                message = replace(message, parent_id=None, problems=message.problems + (loop,))
            messages[message.id] = message
        return messages

    # -- search ----------------------------------------------------------------------------------

    def search(self, text: str, limit: int = 200) -> list[SearchHit]:
        """Conversations whose title matches, then messages that match, best first."""
        query = fts_query(text)
        if query is None:
            return []
        hits: list[SearchHit] = []
        for row in self._db.execute(
            "SELECT c.id, CAST(c.title AS TEXT), highlight(title_search, 0, ?, ?) FROM title_search"
            " JOIN conversations c ON c.id = title_search.rowid"
            " WHERE title_search MATCH ? AND c.deleted_at IS NULL ORDER BY rank LIMIT ?",
            (HIT_START, HIT_END, query, limit),
        ):
            hits.append(SearchHit(row[0], None, str(row[1]), str(row[2])))
        for row in self._db.execute(
            "SELECT m.conversation_id, m.id, CAST(c.title AS TEXT), snippet(message_search, 0, ?, ?, '…', 12)"
            " FROM message_search JOIN messages m ON m.id = message_search.rowid"
            " JOIN conversations c ON c.id = m.conversation_id"
            " WHERE message_search MATCH ? AND c.deleted_at IS NULL ORDER BY rank LIMIT ?",
            (HIT_START, HIT_END, query, limit),
        ):
            hits.append(SearchHit(row[0], row[1], str(row[2]), str(row[3])))
        return hits[:limit]

    # -- whole trees (export / import) -----------------------------------------------------------

    def export_tree(self, conversation_id: int) -> dict[str, Any]:
        """The whole conversation as plain JSON-able data (see ``desktop.store.trees``)."""
        rows = self._db.execute(
            f"SELECT {MESSAGE_COLUMNS} FROM messages m WHERE m.conversation_id = ? ORDER BY m.id", (conversation_id,)
        ).fetchall()
        return trees.export_tree(self.conversation(conversation_id), self.settings(conversation_id),
                                 [self._rows.message(r) for r in rows])

    def import_tree(self, data: dict[str, Any]) -> int:
        """Insert one conversation exported by ``export_tree`` (new ids); returns its id.
        ``StoreError`` names the problem of an invalid tree; nothing is written then."""
        return self.import_trees([data])[0]

    def import_trees(self, documents: list[Any]) -> list[int]:
        """Insert several exported conversations, all or nothing: every one is checked before
        the first is written, and all are written in one transaction. Returns the new ids;
        ``StoreError`` names the first conversation that is not valid and why."""
        now = self._clock()
        checked = [
            trees.validate(data, now=now, label=_conversation_label(data, index, len(documents)))
            for index, data in enumerate(documents)
        ]
        defaults = self.default_settings()
        try:
            with self._transaction():
                return [trees.insert(self._db, tree, defaults) for tree in checked]
        except sqlite3.DatabaseError as exc:  # rolled back: nothing of the import is kept
            raise StoreError(f"{self.location}: cannot write the import ({exc})") from exc

    # -- bulk helpers (benchmarks, screenshots) ----------------------------------------------------

    def insert_many(self, conversations: Iterable[tuple[str, list[tuple[Role, str]]]]) -> None:
        """Insert ``(title, [(role, text), ...])`` linear conversations in one transaction."""
        with self._transaction():
            bulk.insert_many(self._db, conversations, self._clock())


def _conversation_label(data: Any, index: int, count: int) -> str:
    """How an import error names a conversation of a file with ``count`` of them."""
    if count == 1:
        return ""
    title = data.get("title") if isinstance(data, dict) else None
    named = f" ({shown_value(title)})" if isinstance(title, str) and title else ""
    return f"conversation {index + 1} of {count}{named}"

"""Conversations in SQLite: a message tree per chat, per-chat settings, full-text search.

``ChatStore`` (``chat_store.py``) is the one entry point; the rest of the package is what it is
made of:

    records.py     the plain data handed to the UI (``Conversation``, ``Message``, ``PathItem``,
                   ``SearchHit``, ...) and ``StoreError``
    schema.py      tables, ``MIGRATIONS`` (``PRAGMA user_version``), opening a connection (WAL)
    rows.py        rows -> records, tolerant of values Arbor never writes (``problems``)
    tree.py        a conversation's message tree, with broken parent links repaired
    trees.py       whole conversations as plain data: export, all-or-nothing import
    bulk.py        many conversations at once (benchmarks, screenshots)
"""

from desktop.store.chat_store import ChatStore, fts_query
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
from desktop.store.schema import MIGRATIONS, SCHEMA_VERSION

__all__ = [
    "CHAT_DEFAULTS_KEY",
    "HIT_END",
    "HIT_START",
    "MIGRATIONS",
    "PLACEHOLDER_TITLE",
    "SCHEMA_VERSION",
    "ChatStore",
    "Conversation",
    "ConversationSummary",
    "Message",
    "MessageStatus",
    "PathItem",
    "Role",
    "SearchHit",
    "StoreError",
    "TitleSource",
    "fts_query",
]

"""The plain data the conversation store hands out, and its error type.

Every record is frozen and holds only Python values, so the UI can keep it without a
connection. ``problems`` lists, one line each, the stored parts of that row that could not be
read (see ``desktop.store.rows``); an empty tuple means the row was read as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from backend.errors import ArborError

Role = Literal["user", "assistant"]
MessageStatus = Literal["complete", "streaming", "cancelled", "interrupted", "error"]
TitleSource = Literal["placeholder", "auto", "user"]

ROLES: tuple[Role, ...] = ("user", "assistant")
MESSAGE_STATUSES: tuple[MessageStatus, ...] = ("complete", "streaming", "cancelled", "interrupted", "error")
TITLE_SOURCES: tuple[TitleSource, ...] = ("placeholder", "auto", "user")

PLACEHOLDER_TITLE = "New chat"
CHAT_DEFAULTS_KEY = "chat_defaults"
#: Markers around matched words in search snippets (control characters never typed by users).
HIT_START, HIT_END = "\x02", "\x03"


class StoreError(ArborError):
    """The conversation database cannot be used (newer schema, unreadable file, bad import)."""


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
    problems: tuple[str, ...] = ()

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
    problems: tuple[str, ...] = ()


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

"""Reading stored rows into records, whatever the file holds.

A database can hold values Arbor never writes: a file edited by hand or by another tool, a
damaged disk, an older build's bug. One bad value must never make a conversation unopenable, so
every reader here returns a record in which each unreadable value is treated as absent (the
column's default) and adds one line per bad part to the record's ``problems``; the UI shows that
line next to the part, and the problem is logged once per store. Nothing here writes: the stored
value stays as it is.

What counts as unreadable, and what is shown instead:

    any text column    not UTF-8 (SQLite keeps any bytes): the text with U+FFFD replacements
    timestamps         not a finite number of seconds in 1970..9999: 0 (the epoch)
    role               not user/assistant (only when the CHECK was bypassed): a reply
    status             unknown: complete
    title_source       unknown: the user's (so an automatic title never replaces that title)
    settings (JSON)    not a JSON object: no overrides (the app defaults)
    stats (JSON)       not a JSON object: no statistics; a known field of the wrong type: dropped
    app settings       not JSON: the caller's default

Broken links between rows (a parent outside the conversation, parents in a loop, a current
message that is missing) are repaired in the view by ``desktop.store.tree``.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
from typing import Any

from desktop.store.records import (
    MESSAGE_STATUSES,
    PLACEHOLDER_TITLE,
    ROLES,
    TITLE_SOURCES,
    Conversation,
    ConversationSummary,
    Message,
)

log = logging.getLogger(__name__)

#: The statistics stored with a reply (``desktop.worker.stats_from_done`` writes them): each
#: field's kind. Fields not listed here are kept as they are.
STATS_FIELDS: dict[str, type] = {
    "finish_reason": str,
    "prompt_tokens": float,
    "cached_tokens": float,
    "generated_tokens": float,
    "ttft_s": float,
    "prefill_tps": float,
    "decode_tps": float,
    "drafter": str,
    "drafted_tokens": float,
    "accepted_tokens": float,
    "acceptance_by_position": list,  # of draft position j: accepted / reached (numbers)
    "mean_accepted": float,
    "cached_by_tier": dict,  # tier name -> tokens (numbers)
    "restore_s": float,
    "queue_s": float,  # waiting behind other work before the model began (ttft_s includes it)
    "dropped_messages": float,
}
#: What every query for whole messages selects from ``messages m``: ``RowReader.message`` needs
#: ``parent_found``.
MESSAGE_COLUMNS = (
    "m.*, (m.parent_id IS NULL OR EXISTS (SELECT 1 FROM messages p"
    " WHERE p.id = m.parent_id AND p.conversation_id = m.conversation_id)) AS parent_found"
)
#: 9999-12-31: the last day ``datetime`` can show.
LATEST_TIMESTAMP = 253402214400.0

#: How each text column is named in a problem line.
_TEXT_COLUMNS = {"title": "title", "content": "text", "model": "model name", "error": "error message"}


class InvalidText(str):
    """Text decoded from stored bytes that are not UTF-8 (bad bytes replaced by U+FFFD)."""


def decode_text(raw: bytes) -> str:
    """The connection's ``text_factory``: strict UTF-8, else ``InvalidText`` (the default factory
    raises instead, and one bad value fails the whole query)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return InvalidText(raw.decode("utf-8", "replace"))


def valid_timestamp(value: Any) -> float | None:
    """``value`` as seconds since the epoch, or None when it is not a finite number in range."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        if 0.0 <= value <= LATEST_TIMESTAMP:
            return float(value)
    return None


def clean_stats(value: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """``value`` as reply statistics: None unless it is a dict; known fields of the wrong kind
    are dropped. Returns the statistics and the names of the dropped fields."""
    if not isinstance(value, dict):
        return None, []
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for key, item in value.items():
        kind = STATS_FIELDS.get(key)
        if kind is str and not isinstance(item, str):
            dropped.append(key)
        elif kind is float and not _finite_number(item):
            dropped.append(key)
        elif kind is dict and not (isinstance(item, dict) and all(
                isinstance(k, str) and _finite_number(v) for k, v in item.items())):
            dropped.append(key)
        elif kind is list and not (isinstance(item, list) and all(map(_finite_number, item))):
            dropped.append(key)
        else:
            kept[key] = item
    return kept, dropped


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RowReader:
    """Turns rows of one database into records; logs each problem once."""

    def __init__(self, location: str) -> None:
        self._location = location
        self._logged: set[tuple[str, object, str]] = set()

    # -- records ---------------------------------------------------------------------------------

    def summary(self, row: sqlite3.Row) -> ConversationSummary:
        """A sidebar row (``id, title, created_at, updated_at, pinned``)."""
        problems: list[str] = []
        summary = self._summary(row, problems)
        self._report("conversation", row["id"], problems)
        return summary

    def conversation(self, row: sqlite3.Row) -> Conversation:
        """A whole ``conversations`` row; ``current_leaf_id`` is as stored (the caller checks it
        against the tree)."""
        problems: list[str] = []
        summary = self._summary(row, problems)
        title_source = row["title_source"]
        if title_source not in TITLE_SOURCES:
            problems.append(f"unknown title source {shown_value(title_source)} (kept as your title)")
            title_source = "user"
        overrides = self._json(row["settings"])
        if not isinstance(overrides, dict):
            problems.append("chat settings unreadable (using the defaults)")
            overrides = {}
        conversation = Conversation(
            id=summary.id,
            title=summary.title,
            title_source=title_source,
            created_at=summary.created_at,
            updated_at=summary.updated_at,
            pinned=summary.pinned,
            model=self._text(row, "model", problems),
            settings_overrides=overrides,
            current_leaf_id=row["current_leaf_id"],
            problems=tuple(problems),
        )
        self._report("conversation", row["id"], problems)
        return conversation

    def message(self, row: sqlite3.Row) -> Message:
        """A ``messages`` row plus ``parent_found`` (whether its parent is a message of the same
        conversation; see ``MESSAGE_COLUMNS``)."""
        problems: list[str] = []
        role = row["role"]
        if role not in ROLES:
            problems.append(f"unknown role {shown_value(role)} (shown as a reply)")
            role = "assistant"
        status = row["status"]
        if status not in MESSAGE_STATUSES:
            problems.append(f"unknown status {shown_value(status)} (shown as complete)")
            status = "complete"
        stats = self._stats(row["stats"], problems)
        parent_id = row["parent_id"]
        if parent_id is not None and not row["parent_found"]:
            problems.append(f"its earlier message {shown_value(parent_id)} is missing (shown as a first message)")
            parent_id = None
        message = Message(
            id=row["id"],
            conversation_id=row["conversation_id"],
            parent_id=parent_id,
            role=role,
            content=self._text(row, "content", problems) or "",
            status=status,
            created_at=self._timestamp(row, "created_at", problems),
            stats=stats,
            model=self._text(row, "model", problems),
            error=self._text(row, "error", problems),
            problems=tuple(problems),
        )
        self._report("message", row["id"], problems)
        return message

    def app_setting(self, key: str, raw: Any, default: Any) -> tuple[Any, str | None]:
        """The JSON value of an app setting, or ``(default, problem)`` when it is not JSON."""
        value = self._json(raw)
        if value is _UNREADABLE:
            problem = f"stored setting {key!r} unreadable (using the default)"
            self._report("app setting", key, [problem])
            return default, problem
        return value, None

    def report(self, kind: str, key: object, problem: str) -> None:
        """Log a problem found outside one row (a broken link between rows), once."""
        self._report(kind, key, [problem])

    # -- columns ---------------------------------------------------------------------------------

    def _summary(self, row: sqlite3.Row, problems: list[str]) -> ConversationSummary:
        return ConversationSummary(
            id=row["id"],
            title=self._text(row, "title", problems) or PLACEHOLDER_TITLE,
            created_at=self._timestamp(row, "created_at", problems),
            updated_at=self._timestamp(row, "updated_at", problems),
            pinned=bool(row["pinned"]),
        )

    def _text(self, row: sqlite3.Row, column: str, problems: list[str]) -> str | None:
        value = row[column]
        if value is None or type(value) is str:  # the usual case, first
            return value
        if isinstance(value, bytes):  # a BLOB in a text column
            value = decode_text(value)
        if isinstance(value, InvalidText):
            problems.append(f"{_TEXT_COLUMNS[column]} is not valid UTF-8 (shown with replacement characters)")
            return str(value)
        return None if value is None else str(value)

    def _timestamp(self, row: sqlite3.Row, column: str, problems: list[str]) -> float:
        value = row[column]
        if type(value) is float and 0.0 <= value <= LATEST_TIMESTAMP:  # the usual case, first
            return value
        seconds = valid_timestamp(value)
        if seconds is None:
            problems.append(f"date unreadable ({shown_value(row[column])})")
            return 0.0
        return seconds

    def _stats(self, raw: Any, problems: list[str]) -> dict[str, Any] | None:
        if raw is None or raw == "":
            return None
        stats, dropped = clean_stats(self._json(raw))
        if stats is None:
            problems.append("statistics unreadable (not shown)")
        elif dropped:
            names = ", ".join(repr(name) for name in dropped)
            problems.append(f"statistics field{'s' if len(dropped) > 1 else ''} {names} unreadable (not shown)")
        return stats

    @staticmethod
    def _json(raw: Any) -> Any:
        if not isinstance(raw, (str, bytes)):
            return _UNREADABLE
        try:
            return json.loads(raw)
        except ValueError:
            return _UNREADABLE

    def _report(self, kind: str, key: object, problems: list[str]) -> None:
        for problem in problems:
            if (kind, key, problem) not in self._logged:
                self._logged.add((kind, key, problem))
                log.warning("%s: %s %s: %s", self._location, kind, key, problem)


_UNREADABLE = object()


def shown_value(value: Any) -> str:
    """A stored or imported value for a one-line message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

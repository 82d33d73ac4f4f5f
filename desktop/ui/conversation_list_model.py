"""The sidebar's item model: conversations grouped by date, loaded a page at a time.

A thin adapter over plain data: ``fetch_page(offset, limit)`` returns ``ConversationSummary``
rows in sidebar order and ``count()`` how many exist (both usually ``ChatStore`` methods). The model
holds a flat list of rows - a header row before each date group - and turns every change into
the smallest Qt row operations (insert, remove, move, dataChanged), so the view keeps its
selection and scroll position while conversations move to the top or get renamed.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from PySide6.QtCore import QAbstractListModel, QModelIndex, QPersistentModelIndex, Qt

from desktop.store import ConversationSummary

PAGE_SIZE = 100

ConversationIdRole = Qt.ItemDataRole.UserRole + 1
IsHeaderRole = Qt.ItemDataRole.UserRole + 2
PinnedRole = Qt.ItemDataRole.UserRole + 3
WarmRole = Qt.ItemDataRole.UserRole + 4
UpdatedAtRole = Qt.ItemDataRole.UserRole + 5
SummaryRole = Qt.ItemDataRole.UserRole + 6
ActivityRole = Qt.ItemDataRole.UserRole + 7  # "generating", "queued", "prefetching" or ""

#: How the sidebar names each activity.
ACTIVITY_WORDS = {"generating": "writing…", "queued": "queued", "prefetching": "warming up"}

Index = QModelIndex | QPersistentModelIndex


def date_group(summary: ConversationSummary, now: float) -> str:
    """The sidebar group of a conversation: Pinned, Today, Yesterday, Previous 7 days,
    Previous 30 days, then one group per month ("March 2024")."""
    if summary.pinned:
        return "Pinned"
    today = dt.datetime.fromtimestamp(now).date()
    day = dt.datetime.fromtimestamp(summary.updated_at).date()
    age = (today - day).days
    if age <= 0:
        return "Today"
    if age == 1:
        return "Yesterday"
    if age < 7:
        return "Previous 7 days"
    if age < 30:
        return "Previous 30 days"
    return day.strftime("%B %Y")


@dataclass(frozen=True)
class HeaderRow:
    label: str

    @property
    def key(self) -> tuple[str, Any]:
        return ("header", self.label)


@dataclass(frozen=True)
class ConversationRow:
    summary: ConversationSummary

    @property
    def key(self) -> tuple[str, Any]:
        return ("conversation", self.summary.id)


Row = HeaderRow | ConversationRow


def build_rows(summaries: Iterable[ConversationSummary], now: float) -> list[Row]:
    """Summaries in sidebar order -> rows with a header before each group."""
    rows: list[Row] = []
    current = None
    for summary in summaries:
        group = date_group(summary, now)
        if group != current:
            rows.append(HeaderRow(group))
            current = group
        rows.append(ConversationRow(summary))
    return rows


class ConversationListModel(QAbstractListModel):
    """See the module docstring. ``loaded`` counts conversations (not header rows) in memory."""

    def __init__(
        self,
        fetch_page: Callable[[int, int], list[ConversationSummary]],
        count: Callable[[], int],
        *,
        page_size: int = PAGE_SIZE,
        clock: Callable[[], float] = time.time,
        parent=None,
    ) -> None:
        super().__init__(parent)
        self._fetch_page = fetch_page
        self._count = count
        self._page_size = page_size
        self._clock = clock
        self._summaries: list[ConversationSummary] = []
        self._rows: list[Row] = []
        self._total = 0
        self._warm: frozenset[int] = frozenset()
        self._activity: dict[int, str] = {}
        self.reload()

    # -- Qt model API ----------------------------------------------------------------------------

    def rowCount(self, parent: Index = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._rows)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        row = self._rows[index.row()]
        if isinstance(row, HeaderRow):
            if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.AccessibleTextRole):
                return row.label
            if role == IsHeaderRole:
                return True
            return None
        summary = row.summary
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            return summary.title
        activity = self._activity.get(summary.id, "")
        if role == Qt.ItemDataRole.ToolTipRole:
            return summary.title + (f" ({ACTIVITY_WORDS[activity]})" if activity else "")
        if role == Qt.ItemDataRole.AccessibleTextRole:
            extras = [" (pinned)" if summary.pinned else "", " (warm)" if summary.id in self._warm else "",
                      f" ({ACTIVITY_WORDS[activity]})" if activity else ""]
            return summary.title + "".join(extras)
        if role == ActivityRole:
            return activity
        if role == ConversationIdRole:
            return summary.id
        if role == IsHeaderRole:
            return False
        if role == PinnedRole:
            return summary.pinned
        if role == WarmRole:
            return summary.id in self._warm
        if role == UpdatedAtRole:
            return summary.updated_at
        if role == SummaryRole:
            return summary
        return None

    def flags(self, index: Index) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        if isinstance(self._rows[index.row()], HeaderRow):
            return Qt.ItemFlag.ItemNeverHasChildren
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemNeverHasChildren

    def canFetchMore(self, parent: Index = QModelIndex()) -> bool:
        return not parent.isValid() and len(self._summaries) < self._total

    def fetchMore(self, parent: Index = QModelIndex()) -> None:
        if parent.isValid():
            return
        page = self._fetch_page(len(self._summaries), self._page_size)
        if not page:
            self._total = len(self._summaries)
            return
        self._append(page)

    # -- queries ---------------------------------------------------------------------------------

    @property
    def loaded(self) -> int:
        return len(self._summaries)

    @property
    def total(self) -> int:
        return self._total

    def conversation_id(self, row: int) -> int | None:
        if 0 <= row < len(self._rows) and isinstance(self._rows[row], ConversationRow):
            return self._rows[row].summary.id  # type: ignore[union-attr]
        return None

    def row_of(self, conversation_id: int) -> int | None:
        for row, item in enumerate(self._rows):
            if isinstance(item, ConversationRow) and item.summary.id == conversation_id:
                return row
        return None

    def conversation_ids(self) -> list[int]:
        return [s.id for s in self._summaries]

    # -- changes ---------------------------------------------------------------------------------

    def reload(self) -> None:
        """Forget everything and load the first page (model reset)."""
        self.beginResetModel()
        self._total = self._count()
        self._summaries = self._fetch_page(0, self._page_size)
        self._rows = build_rows(self._summaries, self._clock())
        self.endResetModel()

    def refresh(self) -> None:
        """Re-read as many conversations as are loaded (at least a page) and apply the
        differences as row moves, inserts, removals and data changes."""
        self._total = self._count()
        wanted = max(len(self._summaries), self._page_size)
        self._sync(self._fetch_page(0, wanted))

    def ensure_loaded(self, conversation_id: int, limit: int = 100_000) -> int | None:
        """Fetch pages until ``conversation_id`` is loaded; its row, or None if it is not listed."""
        while self.row_of(conversation_id) is None and self.canFetchMore() and self.loaded < limit:
            self.fetchMore()
        return self.row_of(conversation_id)

    def set_warm(self, conversation_ids: Iterable[int]) -> None:
        """Mark which conversations are warm in the engine's cache (the badge)."""
        warm = frozenset(conversation_ids)
        changed = warm ^ self._warm
        self._warm = warm
        for row, item in enumerate(self._rows):
            if isinstance(item, ConversationRow) and item.summary.id in changed:
                index = self.index(row)
                self.dataChanged.emit(index, index, [WarmRole, Qt.ItemDataRole.AccessibleTextRole])

    def set_activity(self, activity: dict[int, str]) -> None:
        """Which conversations have a reply queued or generating, or a prefetch running
        (conversation id -> ``ActivityRole`` value); the others have none."""
        changed = {cid for cid in activity.keys() | self._activity.keys()
                   if activity.get(cid) != self._activity.get(cid)}
        self._activity = {cid: a for cid, a in activity.items() if a in ACTIVITY_WORDS}
        for row, item in enumerate(self._rows):
            if isinstance(item, ConversationRow) and item.summary.id in changed:
                index = self.index(row)
                self.dataChanged.emit(index, index, [ActivityRole, Qt.ItemDataRole.ToolTipRole,
                                                     Qt.ItemDataRole.AccessibleTextRole])

    def _append(self, page: list[ConversationSummary]) -> None:
        """Add the next page at the end in one insert (the common case of scrolling down)."""
        now = self._clock()
        current = date_group(self._summaries[-1], now) if self._summaries else None
        known_ids = {s.id for s in self._summaries}
        known_headers = {row.key for row in self._rows if isinstance(row, HeaderRow)}
        rows: list[Row] = []
        for summary in page:
            group = date_group(summary, now)
            if group != current:
                rows.append(HeaderRow(group))
                current = group
            rows.append(ConversationRow(summary))
        if any(s.id in known_ids for s in page) or any(
            isinstance(r, HeaderRow) and r.key in known_headers for r in rows
        ):
            # The list changed since the last page was read: fall back to a full diff.
            self._sync(self._summaries + [s for s in page if s.id not in known_ids])
            return
        start = len(self._rows)
        self.beginInsertRows(QModelIndex(), start, start + len(rows) - 1)
        self._rows.extend(rows)
        self._summaries.extend(page)
        self.endInsertRows()

    def _sync(self, summaries: list[ConversationSummary]) -> None:
        """Make the rows equal ``build_rows(summaries)`` with minimal row operations."""
        new_rows = build_rows(summaries, self._clock())
        self._summaries = list(summaries)
        self._total = max(self._total, len(summaries))
        wanted = {row.key for row in new_rows}
        root = QModelIndex()
        # 1. Remove rows that are gone, bottom up, in contiguous runs.
        end = len(self._rows) - 1
        while end >= 0:
            if self._rows[end].key in wanted:
                end -= 1
                continue
            start = end
            while start > 0 and self._rows[start - 1].key not in wanted:
                start -= 1
            self.beginRemoveRows(root, start, end)
            del self._rows[start:end + 1]
            self.endRemoveRows()
            end = start - 1
        # 2. Walk the wanted order: keep a row, move it up, or insert a run of new rows.
        present = {row.key for row in self._rows}
        target = 0
        while target < len(new_rows):
            row = new_rows[target]
            if target < len(self._rows) and self._rows[target].key == row.key:
                self._replace(target, row)
                target += 1
            elif row.key in present:
                source = next(i for i in range(target + 1, len(self._rows)) if self._rows[i].key == row.key)
                self.beginMoveRows(root, source, source, root, target)
                self._rows.insert(target, self._rows.pop(source))
                self.endMoveRows()
                self._replace(target, row)
                target += 1
            else:
                stop = target + 1
                while stop < len(new_rows) and new_rows[stop].key not in present:
                    stop += 1
                self.beginInsertRows(root, target, stop - 1)
                self._rows[target:target] = new_rows[target:stop]
                self.endInsertRows()
                target = stop

    def _replace(self, row: int, item: Row) -> None:
        if self._rows[row] != item:
            self._rows[row] = item
            index = self.index(row)
            self.dataChanged.emit(index, index)

"""Item models: checked with qtmodeltester, driven through the changes the app makes."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, Qt

from desktop.store import ConversationSummary, Message, PathItem, SearchHit
from desktop.ui.conversation_list_model import (
    ConversationIdRole,
    ConversationListModel,
    IsHeaderRole,
    WarmRole,
    date_group,
)
from desktop.ui.message_path_model import MessagePathModel, SiblingCountRole, SiblingIndexRole
from desktop.ui.simple_models import ModelTableModel, SearchResultsModel, human_bytes, snippet_html

NOW = dt.datetime(2025, 6, 15, 12, 0).timestamp()
DAY = 86400.0


class FakeSource:
    """Plain data behind the sidebar model, in sidebar order."""

    def __init__(self, summaries):
        self.summaries = list(summaries)
        self.pages: list[tuple[int, int]] = []

    def ordered(self):
        return sorted(self.summaries, key=lambda s: (not s.pinned, -s.updated_at, -s.id))

    def fetch(self, offset, limit):
        self.pages.append((offset, limit))
        return self.ordered()[offset:offset + limit]

    def count(self):
        return len(self.summaries)

    def update(self, cid, **changes):
        self.summaries = [ConversationSummary(**{**s.__dict__, **changes}) if s.id == cid else s for s in self.summaries]


def summary(cid, age_days, pinned=False, title=None):
    stamp = NOW - age_days * DAY
    return ConversationSummary(cid, title or f"chat {cid}", stamp, stamp, pinned)


def titles(model):
    return [model.data(model.index(r)) for r in range(model.rowCount())]


def test_date_groups():
    assert date_group(summary(1, 0), NOW) == "Today"
    assert date_group(summary(1, 1), NOW) == "Yesterday"
    assert date_group(summary(1, 3), NOW) == "Previous 7 days"
    assert date_group(summary(1, 20), NOW) == "Previous 30 days"
    assert date_group(summary(1, 200), NOW) == "November 2024"
    assert date_group(summary(1, 200, pinned=True), NOW) == "Pinned"


def test_sidebar_model_groups_pages_and_passes_modeltester(qtmodeltester):
    source = FakeSource([summary(i, i * 0.3) for i in range(1, 26)])
    model = ConversationListModel(source.fetch, source.count, page_size=10, clock=lambda: NOW)
    assert model.loaded == 10 and model.canFetchMore()
    assert titles(model)[:3] == ["Today", "chat 1", "Yesterday"]
    assert model.data(model.index(0), IsHeaderRole) is True
    assert not model.flags(model.index(0)) & Qt.ItemFlag.ItemIsSelectable
    qtmodeltester.check(model, force_py=True)  # the tester fetches every page, checking each
    assert model.loaded == 25 and source.pages == [(0, 10), (10, 10), (20, 10)]
    assert [model.conversation_id(r) for r in range(model.rowCount()) if model.conversation_id(r)] == list(range(1, 26))


def test_sidebar_refresh_moves_rows_and_keeps_selection(qtmodeltester):
    source = FakeSource([summary(i, i * 2.0) for i in range(1, 8)])
    model = ConversationListModel(source.fetch, source.count, clock=lambda: NOW)
    qtmodeltester.check(model, force_py=True)
    selected = QPersistentModelIndex(model.index(model.row_of(5)))
    source.update(6, updated_at=NOW)  # a new message in chat 6: it moves to Today
    source.update(3, title="renamed")
    source.update(7, pinned=True)
    source.summaries.append(summary(99, 0.1))
    source.summaries = [s for s in source.summaries if s.id != 2]
    model.refresh()
    assert titles(model) == ["Pinned", "chat 7", "Today", "chat 6", "chat 99", "Previous 7 days", "chat 1",
                             "renamed", "Previous 30 days", "chat 4", "chat 5"]
    assert selected.isValid() and selected.data(ConversationIdRole) == 5


def test_warm_badge_role(qtbot):
    source = FakeSource([summary(i, 0) for i in range(1, 4)])
    model = ConversationListModel(source.fetch, source.count, clock=lambda: NOW)
    with qtbot.waitSignal(model.dataChanged):
        model.set_warm({2})
    assert [model.data(model.index(model.row_of(i)), WarmRole) for i in (1, 2, 3)] == [False, True, False]
    assert "(warm)" in model.data(model.index(model.row_of(2)), Qt.ItemDataRole.AccessibleTextRole)


def message(mid, parent, role, content="x"):
    return Message(mid, 1, parent, role, content, "complete", 0.0)


def test_message_path_model_diffs_paths(qtmodeltester, qtbot):
    """The tester stays connected after ``check`` and validates every later change."""
    model = MessagePathModel()
    qtmodeltester.check(model, force_py=True)
    path = [PathItem(message(1, None, "user")), PathItem(message(2, 1, "assistant"), (2,))]
    model.set_path(1, path)
    # Regenerate: reply 3 becomes a sibling of 2. Row 0 stays, row 1 is replaced.
    with qtbot.waitSignals([model.rowsRemoved, model.rowsInserted], order="strict"):
        model.set_path(1, [path[0], PathItem(message(3, 1, "assistant"), (2, 3))])
    assert model.data(model.index(1), SiblingIndexRole) == 1
    assert model.data(model.index(1), SiblingCountRole) == 2
    with qtbot.waitSignal(model.dataChanged):
        assert model.set_text(3, "streamed")
    assert model.data(model.index(1)) == "streamed"
    assert not model.set_text(2, "not on the path")
    with qtbot.waitSignal(model.modelReset):
        model.set_path(2, [])


def test_search_and_model_table_models(qtmodeltester):
    hits = SearchResultsModel()
    hits.set_hits("borrow", [SearchHit(1, None, "Rust", "\x02Rust\x03"), SearchHit(1, 5, "Rust", "the \x02borrow\x03 <checker>")])
    qtmodeltester.check(hits, force_py=True)
    assert snippet_html("the \x02borrow\x03 <checker>") == "the <b>borrow</b> &lt;checker&gt;"
    from backend.weights.store import StoredModel

    table = ModelTableModel()
    table.set_models([StoredModel("tiny", Path("/m/tiny"), "llama", None, 2_500_000, 640_000),
                      StoredModel("SmolLM2", Path("/m/s"), "llama", "4-bit g32", 100, 135_000_000)])
    table.set_loaded("tiny")
    qtmodeltester.check(table, force_py=True)
    assert table.data(table.index(0, 0)) == "tiny  (loaded)"
    assert table.data(table.index(1, 3)) == "135.0M" and table.data(table.index(0, 4)) == "2.4 MB"
    assert human_bytes(512) == "512 B"
    assert not table.index(0, 0).parent().isValid() and table.rowCount(QModelIndex()) == 2

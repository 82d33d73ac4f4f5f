"""The "Memory and cache" dialog: the budgets it shows are the ones the engine got (also on the
first opening, whatever the free disk space does meanwhile: the default disk budget is written
once and derived again only on "Restore defaults"), its columns fit their contents, and a
degraded disk tier is named with the reason."""

from __future__ import annotations

import itertools

from PySide6.QtCore import QObject, Qt, QTimer, Signal

from backend.api import CacheStats, TierStats
from backend.memory.budgets import MIB, CacheBudgets
from desktop.app import create_app
from desktop.cache_settings import CACHE_BUDGETS_KEY
from desktop.store import ChatStore
from desktop.ui.cache_dialog import COLUMNS, CacheDialog


class StatsClient(QObject):
    """Stands in for the inference client to isolate the dialog: every stats request is
    answered with ``stats``."""

    task_done = Signal(int, object)

    def __init__(self, stats: CacheStats) -> None:
        super().__init__()
        self.stats = stats
        self._ids = itertools.count(1)

    def cache_stats(self) -> int:
        request_id = next(self._ids)
        stats = self.stats
        QTimer.singleShot(0, lambda: self.task_done.emit(request_id, stats))  # as the worker answers
        return request_id

    def is_pending(self, request_id: int) -> bool:
        return False


def tiers(disk_budget: int = 4096 * MIB) -> dict[str, TierStats]:
    return {"device": TierStats(3 * MIB, 256 * MIB, 2, 40, 0),
            "host": TierStats(0, 512 * MIB, 0, 0, 1),
            "disk": TierStats(12 * MIB, disk_budget, 5, 70, 0)}


def test_a_read_only_disk_tier_is_named_with_its_reason(qtbot, tmp_path):
    note = "the disk is full (No space left on device); retrying in 30 s"
    stats = CacheStats(tiers(), nodes=7, live_tokens=120, live_hits=10, disk_read_only=True,
                       disk_mode="read-only", disk_note=note)
    store = ChatStore(tmp_path / "chats.sqlite3")
    dialog = CacheDialog(store, StatsClient(stats))
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitUntil(lambda: dialog.last_stats is stats)
    assert dialog.disk_state.isVisible()
    assert dialog.disk_state.text() == f"The disk cache is read-only: {note}."
    assert dialog.table.item(2, 0).text() == "Disk (read-only)"
    dialog.client.stats = off = CacheStats(tiers(), 7, 120, 10, disk_mode="off",
                                           disk_note="the cache folder cannot be created")
    dialog.refresh()
    qtbot.waitUntil(lambda: dialog.last_stats is off)
    assert dialog.disk_state.text() == "The disk cache is off: the cache folder cannot be created."
    dialog.client.stats = on = CacheStats(tiers(), 7, 120, 10)
    dialog.refresh()
    qtbot.waitUntil(lambda: dialog.last_stats is on)
    assert not dialog.disk_state.isVisible() and dialog.table.item(2, 0).text() == "Disk"
    dialog.close()
    store.close()


def test_the_shown_budgets_are_the_engines_and_stay_put_until_restored(qtbot, tmp_path, tiny_model_dir,
                                                                      monkeypatch):
    # The machine's default disk budget follows the free space: a new value at every look.
    disk = itertools.count(5000, 700)
    def machine_default() -> CacheBudgets:
        return CacheBudgets(256 * MIB, 512 * MIB, next(disk) * MIB)

    for where in ("desktop.cache_settings", "desktop.ui.cache_dialog"):
        monkeypatch.setattr(f"{where}.default_budgets", machine_default)
    store = ChatStore(tmp_path / "chats.sqlite3")
    assert store.app_setting(CACHE_BUDGETS_KEY) is None
    # The app's own loader: the engine gets the budgets the app stores.
    parts = create_app(str(tiny_model_dir("llama")), store=store, theme="light")
    parts.window.show()
    try:
        qtbot.waitUntil(lambda: parts.window.controller.model_info is not None, timeout=30000)
        assert store.app_setting(CACHE_BUDGETS_KEY) == {"device": 256, "host": 512, "disk": 5000}
        for _ in range(2):  # first and later openings alike
            dialog = parts.window.open_cache_dialog()
            qtbot.waitUntil(lambda: dialog.last_stats is not None, timeout=20000)
            assert dialog.budget_boxes["disk"].value() == 5000
            for row, tier in enumerate(("device", "host", "disk")):
                field = dialog.budget_boxes[tier]
                assert dialog.table.item(row, COLUMNS.index("Budget")).text() == f"{field.value():,} MiB"
            table = dialog.table
            for column in range(len(COLUMNS)):  # every cell's text fits its column
                widest = max(table.fontMetrics().horizontalAdvance(table.item(r, column).text())
                             for r in range(table.rowCount()))
                assert table.columnWidth(column) >= widest
            assert table.horizontalHeader().length() <= table.viewport().width()
            dialog.close()
        dialog = parts.window.open_cache_dialog()
        qtbot.mouseClick(dialog.defaults_button, Qt.MouseButton.LeftButton)
        derived = dialog.budget_boxes["disk"].value()
        assert derived > 5000 and store.app_setting(CACHE_BUDGETS_KEY)["disk"] == derived
        qtbot.waitUntil(lambda: dialog.last_stats is not None
                        and dialog.last_stats.tiers["disk"].budget == derived * MIB, timeout=20000)
        assert dialog.table.item(2, COLUMNS.index("Budget")).text() == f"{derived:,} MiB"
        dialog.close()
    finally:
        parts.window.close()
        assert parts.shutdown(5.0)
        parts.theme.deleteLater()


def test_closing_the_window_closes_an_open_cache_dialog(qtbot, tmp_path, tiny_model_dir):
    # Regression: a dialog left open applied its fields on focus-out after the store had closed.
    store = ChatStore(tmp_path / "chats.sqlite3")
    parts = create_app(str(tiny_model_dir("llama")), store=store, theme="light")
    parts.window.show()
    try:
        qtbot.waitUntil(lambda: parts.window.controller.model_info is not None, timeout=30000)
        dialog = parts.window.open_cache_dialog()
        qtbot.waitUntil(dialog.isVisible)
    finally:
        parts.window.close()
        assert parts.shutdown(5.0)
        parts.theme.deleteLater()
    assert parts.window._cache_dialog is None
    qtbot.waitUntil(lambda: not dialog.isVisible())

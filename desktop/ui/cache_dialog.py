"""Memory and cache: the prefix cache's tier budgets, what each tier holds now, and "clear".

Every saved conversation shares one prefix cache; its idle states live on three tiers (device
memory, host RAM, disk), each within a byte budget. The dialog edits the budgets (applied at
once, and kept for the next start), shows each tier's use, refreshed every second from the
inference worker (``InferenceClient.cache_stats``), and can clear the whole cache.
"""

from __future__ import annotations

from PySide6.QtCore import QTimer, Slot
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QMessageBox,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from backend.api import CacheStats
from backend.memory.budgets import MIB, CacheBudgets
from desktop.cache_settings import TIERS, default_budgets, save_budgets, stored_budgets

REFRESH_MS = 1000
COLUMNS = ("Tier", "In use", "Budget", "Stored states", "Tokens served", "Moved out")
TIER_LABELS = {"device": "Device (MLX memory)", "host": "Host RAM", "disk": "Disk"}


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


class CacheDialog(QDialog):
    def __init__(self, store, client, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Memory and cache")
        self.setObjectName("cacheDialog")
        self.store, self.client = store, client
        self._pending_stats: int | None = None
        self.last_stats: CacheStats | None = None
        defaults = default_budgets()
        current = stored_budgets(store)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel(
            "All conversations share one cache of model states. Idle ones move from device\n"
            "memory to host RAM to disk as each tier fills, so any chat resumes quickly, also\n"
            "after a restart."))
        form = QFormLayout()
        self.budget_boxes: dict[str, QSpinBox] = {}
        for tier, default, value in zip(
                TIERS, (defaults.device_bytes, defaults.host_bytes, defaults.disk_bytes),
                (current.device_bytes, current.host_bytes, current.disk_bytes)):
            box = QSpinBox()
            box.setRange(0, 1 << 22)
            box.setSuffix(" MiB")
            box.setValue(value // MIB)
            box.setAccessibleName(f"{TIER_LABELS[tier]} budget")
            box.setToolTip(f"Default on this machine: {default // MIB} MiB (0 turns the tier off)")
            self.budget_boxes[tier] = box
            form.addRow(f"{TIER_LABELS[tier]} (default {default // MIB} MiB)", box)
        layout.addLayout(form)
        self.table = QTableWidget(len(TIERS), len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setAccessibleName("Cache use per tier")
        layout.addWidget(self.table)
        self.summary = QLabel("Waiting for the model…")
        layout.addWidget(self.summary)
        buttons = QDialogButtonBox(QDialogButtonBox.Close)
        self.apply_button = QPushButton("Apply budgets")
        self.defaults_button = QPushButton("Restore defaults")
        self.clear_button = QPushButton("Clear cache…")
        for button in (self.apply_button, self.defaults_button, self.clear_button):
            buttons.addButton(button, QDialogButtonBox.ActionRole)
        buttons.rejected.connect(self.reject)
        self.apply_button.clicked.connect(self.apply_budgets)
        self.defaults_button.clicked.connect(self.restore_defaults)
        self.clear_button.clicked.connect(self.confirm_clear)
        layout.addWidget(buttons)
        client.task_done.connect(self._on_task_done)
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.refresh)
        self._timer.start(REFRESH_MS)
        self.refresh()

    # -- budgets ---------------------------------------------------------------------------------
    def budgets(self) -> CacheBudgets:
        mb = {tier: box.value() for tier, box in self.budget_boxes.items()}
        return CacheBudgets(mb["device"] * MIB, mb["host"] * MIB, mb["disk"] * MIB)

    @Slot()
    def apply_budgets(self) -> None:
        budgets = self.budgets()
        save_budgets(self.store, budgets)
        self.client.set_cache_budgets(budgets)
        self.refresh()

    @Slot()
    def restore_defaults(self) -> None:
        defaults = default_budgets()
        for tier, value in zip(TIERS, (defaults.device_bytes, defaults.host_bytes,
                                       defaults.disk_bytes)):
            self.budget_boxes[tier].setValue(value // MIB)
        self.apply_budgets()

    @Slot()
    def confirm_clear(self) -> None:
        answer = QMessageBox.question(
            self, "Clear cache", "Forget every stored conversation state? Chats stay; the next "
            "reply in each one reads its history again.")
        if answer == QMessageBox.Yes:
            self.clear_cache()

    def clear_cache(self) -> None:
        self.client.clear_cache()
        self.refresh()

    # -- live use --------------------------------------------------------------------------------
    @Slot()
    def refresh(self) -> None:
        if self._pending_stats is None or not self.client.is_pending(self._pending_stats):
            self._pending_stats = self.client.cache_stats()

    @Slot(int, object)
    def _on_task_done(self, request_id: int, result: object) -> None:
        if request_id != self._pending_stats or not isinstance(result, CacheStats):
            return
        self._pending_stats = None
        self.last_stats = result
        for row, tier in enumerate(TIERS):
            t = result.tiers[tier]
            cells = (TIER_LABELS[tier], _mib(t.bytes), _mib(t.budget), f"{t.entries:,}",
                     f"{t.hits:,}", f"{t.evictions:,}")
            for col, text in enumerate(cells):
                self.table.setItem(row, col, QTableWidgetItem(text))
        shared = " (read-only: another Arbor process writes this model's disk cache)" \
            if result.disk_read_only else ""
        self.summary.setText(f"{result.nodes:,} stored states; the live caches hold "
                             f"{result.live_tokens:,} tokens{shared}")

    def done(self, code: int) -> None:  # noqa: D401 - Qt override
        self._timer.stop()
        super().done(code)

"""Memory and cache: the prefix cache's tier budgets, what each tier holds now, and "clear".

Every saved conversation shares one prefix cache; its idle states live on three tiers (device
memory, host RAM, disk), each within a byte budget. The dialog edits the budgets (applied when a
field is left or "Apply budgets" is pressed, and kept for the next start), shows each tier's use,
refreshed every second from the inference worker (``InferenceClient.cache_stats``), says when
the disk tier is read-only or off and why, and can clear the whole cache. The table's budgets
are the engine's, in the fields' unit, so the two always read the same once applied.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Slot
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHeaderView,
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
DISK_MODES = {"read-only": "read-only", "off": "off"}


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


def budget_text(n: int) -> str:
    """A budget as the fields show it: whole MiB."""
    return f"{n // MIB:,} MiB"


class CacheDialog(QDialog):
    def __init__(self, store, client, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Memory and cache")
        self.setObjectName("cacheDialog")
        self.store, self.client = store, client
        self._pending_stats: int | None = None
        self.last_stats: CacheStats | None = None
        current = stored_budgets(store)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel(
            "All conversations share one cache of model states. Idle ones move from device\n"
            "memory to host RAM to disk as each tier fills, so any chat resumes quickly, also\n"
            "after a restart."))
        form = QFormLayout()
        self.budget_boxes: dict[str, QSpinBox] = {}
        for tier, value in zip(TIERS, (current.device_bytes, current.host_bytes, current.disk_bytes)):
            box = QSpinBox()
            box.setRange(0, 1 << 22)
            box.setSuffix(" MiB")
            box.setGroupSeparatorShown(True)
            box.setValue(value // MIB)
            box.setAccessibleName(f"{TIER_LABELS[tier]} budget")
            box.setToolTip("0 turns the tier off; “Restore defaults” sets this machine's defaults")
            box.editingFinished.connect(self._apply_if_changed)
            self.budget_boxes[tier] = box
            form.addRow(TIER_LABELS[tier], box)
        layout.addLayout(form)
        self.table = QTableWidget(len(TIERS), len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setAccessibleName("Cache use per tier")
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.setSizeAdjustPolicy(QAbstractScrollArea.SizeAdjustPolicy.AdjustToContents)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self._fill_table(None)
        layout.addWidget(self.table)
        self.summary = QLabel("Waiting for the model…")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        # The disk tier when it is not fully working: its state and why, in full.
        self.disk_state = QLabel()
        self.disk_state.setObjectName("diskState")
        self.disk_state.setWordWrap(True)
        self.disk_state.setAccessibleName("Disk cache state")
        self.disk_state.hide()
        layout.addWidget(self.disk_state)
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
    def _apply_if_changed(self) -> None:
        if self.budgets() != stored_budgets(self.store):
            self.apply_budgets()

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
        self._fill_table(result)
        self.summary.setText(f"{result.nodes:,} stored states; the live caches hold "
                             f"{result.live_tokens:,} tokens")
        mode = result.disk_mode if result.disk_mode in DISK_MODES else "on"
        if mode == "on" and result.disk_read_only:  # an engine that only sets the flag
            mode = "read-only"
        note = result.disk_note or ("another Arbor process writes this model's disk cache"
                                    if mode == "read-only" else "")
        self.disk_state.setText(f"The disk cache is {DISK_MODES[mode]}" + (f": {note}" if note else "") + "."
                                if mode != "on" else "")
        self.disk_state.setVisible(mode != "on")

    def _fill_table(self, stats: CacheStats | None) -> None:
        """One row per tier; the columns as wide as their contents, the table as wide as them."""
        for row, tier in enumerate(TIERS):
            label = TIER_LABELS[tier]
            if stats is None:
                cells = (label, "…", budget_text(self.budget_boxes[tier].value() * MIB), "…", "…", "…")
            else:
                t = stats.tiers[tier]
                mode = "read-only" if stats.disk_mode == "on" and stats.disk_read_only else stats.disk_mode
                if tier == "disk" and mode in DISK_MODES:
                    label += f" ({DISK_MODES[mode]})"
                cells = (label, _mib(t.bytes), budget_text(t.budget), f"{t.entries:,}",
                         f"{t.hits:,}", f"{t.evictions:,}")
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if col:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, col, item)
        self.table.resizeColumnsToContents()
        header = self.table.horizontalHeader()
        height = header.height() + sum(self.table.rowHeight(r) for r in range(len(TIERS)))
        frame = 2 * self.table.frameWidth()
        self.table.setMinimumSize(header.length() + frame, height + frame)  # the dialog grows to fit

    def done(self, code: int) -> None:  # noqa: D401 - Qt override
        self._timer.stop()
        super().done(code)

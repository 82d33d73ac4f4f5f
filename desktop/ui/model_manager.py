"""The model manager: installed models with their paired drafts, import (folder or GGUF, optional
quantization, optionally paired with an installed draft model), Hub download with progress and
resume, delete, unpair a draft, and "use this model"."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from desktop.model_tasks import ModelTaskRunner
from desktop.ui.simple_models import ModelNameRole, ModelTableModel

QUANTIZE_CHOICES = (("Keep weights as they are", None), ("Quantize to 8-bit", 8), ("Quantize to 4-bit", 4))


class ModelManagerDialog(QDialog):
    """See the module docstring. ``use_requested(name)`` asks the window to load a model."""

    use_requested = Signal(str)
    models_changed = Signal()

    def __init__(self, tasks: ModelTaskRunner, loaded_name: str | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("modelManager")
        self.setWindowTitle("Models")
        self.resize(760, 520)
        self.tasks = tasks
        self.table_model = ModelTableModel(self)
        self.table_model.set_loaded(loaded_name)
        self._current_task: int | None = None
        self._done_text: str | None = None  # what the status says when the current task ends
        self._list_task: int | None = None

        layout = QVBoxLayout(self)
        self.table = QTableView()
        self.table.setAccessibleName("Installed models")
        self.table.setModel(self.table_model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.table.doubleClicked.connect(lambda _index: self._use())
        layout.addWidget(self.table, 1)

        row = QHBoxLayout()
        self.use_button = QPushButton("Use")
        self.use_button.setAccessibleName("Use selected model")
        self.delete_button = QPushButton("Delete")
        self.delete_button.setAccessibleName("Delete selected model")
        self.unpair_button = QPushButton("Unpair draft")
        self.unpair_button.setAccessibleName("Unpair the selected model's draft")
        row.addWidget(self.use_button)
        row.addWidget(self.delete_button)
        row.addWidget(self.unpair_button)
        row.addStretch(1)
        layout.addLayout(row)

        add = QGroupBox("Add a model")
        add_layout = QVBoxLayout(add)
        options = QHBoxLayout()
        options.addWidget(QLabel("Name"))
        self.name_edit = QLineEdit()
        self.name_edit.setPlaceholderText("optional (default: from the source)")
        self.name_edit.setAccessibleName("Model name")
        options.addWidget(self.name_edit, 1)
        self.quantize_combo = QComboBox()
        self.quantize_combo.setAccessibleName("Quantization")
        for label, bits in QUANTIZE_CHOICES:
            self.quantize_combo.addItem(label, bits)
        options.addWidget(self.quantize_combo)
        add_layout.addLayout(options)
        local = QHBoxLayout()
        self.import_folder_button = QPushButton("Import folder…")
        self.import_folder_button.setAccessibleName("Import a Hugging Face model folder")
        self.import_gguf_button = QPushButton("Import GGUF…")
        self.import_gguf_button.setAccessibleName("Import a GGUF file")
        local.addWidget(self.import_folder_button)
        local.addWidget(self.import_gguf_button)
        local.addStretch(1)
        local.addWidget(QLabel("Draft"))
        self.draft_combo = QComboBox()
        self.draft_combo.setAccessibleName("Draft model to pair with an import")
        self.draft_combo.setToolTip("An installed model with the same vocabulary that drafts "
                                    "tokens for the imported one (speculative decoding)")
        self._set_draft_choices([])
        local.addWidget(self.draft_combo)
        add_layout.addLayout(local)
        hub = QHBoxLayout()
        self.repo_edit = QLineEdit()
        self.repo_edit.setPlaceholderText("Hugging Face repo id, e.g. HuggingFaceTB/SmolLM2-360M-Instruct")
        self.repo_edit.setAccessibleName("Hub repository id")
        self.file_edit = QLineEdit()
        self.file_edit.setPlaceholderText("GGUF file (if several)")
        self.file_edit.setAccessibleName("GGUF file name")
        self.download_button = QPushButton("Download")
        self.download_button.setAccessibleName("Download from the Hub")
        hub.addWidget(self.repo_edit, 3)
        hub.addWidget(self.file_edit, 2)
        hub.addWidget(self.download_button)
        add_layout.addLayout(hub)
        layout.addWidget(add)

        progress_row = QHBoxLayout()
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Task progress")
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName("Cancel task")
        progress_row.addWidget(self.progress, 1)
        progress_row.addWidget(self.cancel_button)
        layout.addLayout(progress_row)
        self.status = QLabel()
        self.status.setAccessibleName("Task status")
        self.status.setWordWrap(True)
        layout.addWidget(self.status)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        self.close_button = self.buttons.button(QDialogButtonBox.StandardButton.Close)
        self.close_button.setAccessibleName("Close the model manager")
        self.buttons.rejected.connect(self.close)  # a running task goes on; its result shows next time
        layout.addWidget(self.buttons)
        self._set_running(False)

        self.use_button.clicked.connect(self._use)
        self.delete_button.clicked.connect(self._delete)
        self.unpair_button.clicked.connect(self._unpair)
        self.import_folder_button.clicked.connect(self._pick_folder)
        self.import_gguf_button.clicked.connect(self._pick_gguf)
        self.download_button.clicked.connect(self._download)
        self.repo_edit.returnPressed.connect(self._download)
        self.cancel_button.clicked.connect(self.cancel_task)
        tasks.progress.connect(self._on_progress)
        tasks.done.connect(self._on_done)
        tasks.failed.connect(self._on_failed)
        tasks.cancelled.connect(self._on_cancelled)
        self.refresh()

    # -- actions (public so tests and shortcuts can drive them) ----------------------------------

    def refresh(self) -> None:
        self._list_task = self.tasks.list_models()

    def import_path(self, source: Path) -> int:
        return self._start(self.tasks.import_model(Path(source), self.name_edit.text().strip() or None,
                                                   self.quantize_combo.currentData(),
                                                   draft=self.draft_combo.currentData()),
                           f"Importing {Path(source).name}…")

    def download(self, repo_id: str, filename: str | None = None) -> int:
        return self._start(self.tasks.download_model(repo_id.strip(), filename=filename or None,
                                                     name=self.name_edit.text().strip() or None,
                                                     quantize=self.quantize_combo.currentData()),
                           f"Downloading {repo_id}…")

    def cancel_task(self) -> None:
        if self._current_task is not None:
            self.tasks.cancel(self._current_task)

    def selected_name(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        return rows[0].data(ModelNameRole) if rows else None

    def set_loaded(self, name: str | None) -> None:
        self.table_model.set_loaded(name)

    # -- internals -------------------------------------------------------------------------------

    def _start(self, task_id: int, message: str, done_text: str | None = None) -> int:
        self._current_task = task_id
        self._done_text = done_text
        self.progress.setValue(0)
        self.status.setText(message)
        self._set_running(True)
        return task_id

    def _set_running(self, running: bool) -> None:
        self.progress.setVisible(running)
        self.cancel_button.setVisible(running)
        for button in (self.import_folder_button, self.import_gguf_button, self.download_button, self.delete_button,
                       self.unpair_button):
            button.setEnabled(not running)

    def _set_draft_choices(self, names: list[str]) -> None:
        """"No draft" and every installed model, keeping the current choice while it exists."""
        current = self.draft_combo.currentData()
        self.draft_combo.clear()
        self.draft_combo.addItem("No draft", None)
        for name in names:
            self.draft_combo.addItem(name, name)
        self.draft_combo.setCurrentIndex(max(0, self.draft_combo.findData(current)))

    def _use(self) -> None:
        name = self.selected_name()
        if name:
            self.use_requested.emit(name)

    def _delete(self) -> None:
        name = self.selected_name()
        if not name:
            return
        answer = QMessageBox.question(self, "Delete model", f"Delete “{name}” from disk?")
        if answer == QMessageBox.StandardButton.Yes:
            self._start(self.tasks.remove_model(name), f"Deleting {name}…")

    def _unpair(self) -> None:
        name = self.selected_name()
        if not name:
            return
        if self.table_model.model_named(name).draft is None:
            self.status.setText(f"{name} has no paired draft.")
            return
        self._start(self.tasks.unpair_model(name), f"Unpairing {name}'s draft…",
                    f"{name} has no paired draft now.")

    def _pick_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder")
        if folder:
            self.import_path(Path(folder))

    def _pick_gguf(self) -> None:
        file, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF file", "", "GGUF models (*.gguf)")
        if file:
            self.import_path(Path(file))

    def _download(self) -> None:
        repo = self.repo_edit.text().strip()
        if repo and self._current_task is None:
            self.download(repo, self.file_edit.text().strip() or None)

    def _on_progress(self, task_id: int, fraction: float, message: str) -> None:
        if task_id == self._current_task:
            self.progress.setValue(int(fraction * 1000))
            self.progress.setFormat(f"{fraction * 100:.0f}%")
            self.status.setText(message)

    def _on_done(self, task_id: int, result) -> None:
        if task_id == self._list_task:
            self._list_task = None
            self.table_model.set_models(result)
            self._set_draft_choices([model.name for model in result])
            self.table.resizeColumnsToContents()
            self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
            return
        if task_id != self._current_task:
            return
        self._current_task = None
        self._set_running(False)
        name = getattr(result, "name", None)
        self.status.setText(self._done_text or (f"Added {name}." if name else "Done."))
        self.models_changed.emit()
        self.refresh()

    def _on_failed(self, task_id: int, message: str) -> None:
        if task_id == self._list_task:
            self._list_task = None
            self.status.setText(message)
            return
        if task_id == self._current_task:
            self._current_task = None
            self._set_running(False)
            self.status.setText(message)

    def _on_cancelled(self, task_id: int) -> None:
        if task_id == self._current_task:
            self._current_task = None
            self._set_running(False)
            self.status.setText("Cancelled. A download continues where it stopped next time.")

    @property
    def running(self) -> bool:
        return self._current_task is not None

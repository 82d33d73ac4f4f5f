"""Model-manager jobs off the GUI thread: list, import, download from the Hub, delete.

One ``ModelTaskRunner`` thread runs the jobs in order (so two imports never race for a name) while
the inference worker keeps chatting. Each job has a task id and a ``threading.Event``:
``cancel(task_id)`` stops a download at its next chunk (the part files stay so it resumes) and an
import at its next progress report (imports are atomic, nothing is left behind).

Signals per task: ``progress(task, fraction, message)``* -> ``done(task, result)`` |
``failed(task, message)`` | ``cancelled(task)``. Progress is throttled to ~20 updates a second.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from desktop import qt_compat  # noqa: F401,I001  (before any signal is emitted; see the module)
from PySide6.QtCore import QDeadlineTimer, QObject, QThread, Signal, Slot

from backend.errors import ArborError
from desktop import paths
from desktop.worker import describe_error

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.05


class TaskCancelled(ArborError):
    """Raised inside a job's progress callback once the user cancelled it."""


def _model_store():
    from backend.models.store import ModelStore  # imports MLX: only ever on the task thread

    return ModelStore()


class _TaskWorker(QObject):
    progress = Signal(int, float, str)
    done = Signal(int, object)
    failed = Signal(int, str)
    cancelled = Signal(int)

    def __init__(self, store_factory: Callable[[], Any]) -> None:
        super().__init__()
        self._store_factory = store_factory

    @Slot(int, object, object)
    def run(self, task_id: int, job: Callable[..., Any], cancel: threading.Event) -> None:
        last = [0.0]

        def report(fraction: float, message: str) -> None:
            if cancel.is_set():
                raise TaskCancelled("cancelled")
            now = time.monotonic()
            if now - last[0] >= PROGRESS_INTERVAL_S or fraction >= 1.0:
                last[0] = now
                self.progress.emit(task_id, float(fraction), message)

        if cancel.is_set():
            self.cancelled.emit(task_id)
            return
        try:
            result = job(self._store_factory(), report, cancel)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the user
            from backend.hub import DownloadCancelled

            if isinstance(exc, (TaskCancelled, DownloadCancelled)) or cancel.is_set():
                self.cancelled.emit(task_id)
                return
            if not isinstance(exc, ArborError):
                log.exception("model task %d failed", task_id)
            self.failed.emit(task_id, describe_error(exc))
            return
        self.done.emit(task_id, result)


class ModelTaskRunner(QObject):
    """GUI-side handle; see the module docstring."""

    progress = Signal(int, float, str)
    done = Signal(int, object)
    failed = Signal(int, str)
    cancelled = Signal(int)
    _submit = Signal(int, object, object)

    def __init__(self, store_factory: Callable[[], Any] = _model_store, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._ids = itertools.count(1)
        self._cancels: dict[int, threading.Event] = {}
        self._thread = QThread()
        self._thread.setObjectName("arbor-model-tasks")
        self._worker = _TaskWorker(store_factory)
        self._worker.moveToThread(self._thread)
        self._thread.finished.connect(self._worker.deleteLater)
        self._submit.connect(self._worker.run)
        # Bound slots of this GUI-thread object: Qt queues the worker's signals to this thread.
        # (A lambda here would run on the task thread and re-emit from there.)
        self._worker.progress.connect(self.progress)
        self._worker.done.connect(self._on_done)
        self._worker.failed.connect(self._on_failed)
        self._worker.cancelled.connect(self._on_cancelled)
        self._thread.start()

    # -- jobs ------------------------------------------------------------------------------------

    def list_models(self) -> int:
        return self._run(lambda store, report, cancel: store.list())

    def import_model(self, source: Path, name: str | None = None, quantize: int | None = None) -> int:
        return self._run(lambda store, report, cancel: store.import_path(
            Path(source), name=name or None, quantize=quantize, progress=report))

    def download_model(self, repo_id: str, *, filename: str | None = None, name: str | None = None,
                       quantize: int | None = None) -> int:
        def job(store, report, cancel):
            from backend.hub import download_to_store

            return download_to_store(repo_id, store, paths.downloads_dir(), name=name or None,
                                     filename=filename or None, quantize=quantize, progress=report, cancel=cancel)

        return self._run(job)

    def remove_model(self, name: str) -> int:
        return self._run(lambda store, report, cancel: store.remove(name))

    # -- control ---------------------------------------------------------------------------------

    def cancel(self, task_id: int) -> None:
        event = self._cancels.get(task_id)
        if event is not None:
            event.set()

    @property
    def busy(self) -> bool:
        return bool(self._cancels)

    def shutdown(self, deadline_s: float = 5.0) -> bool:
        if not self._thread.isRunning():
            return True
        for event in self._cancels.values():
            event.set()
        self._thread.quit()
        return self._thread.wait(QDeadlineTimer(int(deadline_s * 1000)))

    def _run(self, job: Callable[..., Any]) -> int:
        task_id = next(self._ids)
        cancel = threading.Event()
        self._cancels[task_id] = cancel
        self._submit.emit(task_id, job, cancel)
        return task_id

    @Slot(int, object)
    def _on_done(self, task_id: int, result: Any) -> None:
        self._cancels.pop(task_id, None)
        self.done.emit(task_id, result)

    @Slot(int, str)
    def _on_failed(self, task_id: int, message: str) -> None:
        self._cancels.pop(task_id, None)
        self.failed.emit(task_id, message)

    @Slot(int)
    def _on_cancelled(self, task_id: int) -> None:
        self._cancels.pop(task_id, None)
        self.cancelled.emit(task_id)

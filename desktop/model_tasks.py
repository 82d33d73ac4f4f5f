"""Model-manager jobs off the GUI thread: list, import (optionally with a draft to pair), download
from the Hub, delete, unpair a draft.

One ``ModelTaskRunner`` thread runs the jobs in order (so two imports never race for a name) while
the inference worker keeps chatting. Each job has a task id and a ``threading.Event``:
``cancel(task_id)`` stops a download at its next chunk (the part files stay so it resumes) and an
import at its next progress report (imports are atomic, nothing is left behind).

Signals per task: ``progress(task, fraction, message)``* -> ``done(task, result)`` |
``failed(task, message)`` | ``cancelled(task)``. Progress is throttled to ~20 updates a second.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

from desktop import qt_compat  # noqa: F401,I001  (before any signal is emitted; see the module)
from PySide6.QtCore import QObject, Signal, Slot

from backend.errors import ArborError
from desktop import paths
from desktop.worker_handle import Worker, WorkerHandle

PROGRESS_INTERVAL_S = 0.05

#: A job: ``job(model_store, report, cancel) -> result``, run on the task thread. ``report(
#: fraction, message)`` raises ``TaskCancelled`` once the task is cancelled; a job that waits
#: or loops should also watch ``cancel`` (a ``threading.Event``).
Job = Callable[[Any, Callable[[float, str], None], threading.Event], Any]


class TaskCancelled(ArborError):
    """Raised inside a job's progress callback once the user cancelled it."""


def _model_store():
    from backend.weights.store import ModelStore  # imports MLX: only ever on the task thread

    return ModelStore()


class _TaskWorker(Worker):
    progress = Signal(int, float, str)
    done = Signal(int, object)
    failed = Signal(int, str)
    cancelled = Signal(int)

    def __init__(self, store_factory: Callable[[], Any]) -> None:
        super().__init__()
        self._store_factory = store_factory

    @Slot(int, object, object)
    def run(self, task_id: int, job: Job, cancel: threading.Event) -> None:
        last = [0.0]

        def report(fraction: float, message: str) -> None:
            if cancel.is_set():
                raise TaskCancelled("cancelled")
            now = time.monotonic()
            if now - last[0] >= PROGRESS_INTERVAL_S or fraction >= 1.0:
                last[0] = now
                self.progress.emit(task_id, float(fraction), message)

        if cancel.is_set():
            self.end(task_id, self.cancelled)
            return
        try:
            result = job(self._store_factory(), report, cancel)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the user
            from backend.hub import DownloadCancelled

            if isinstance(exc, (TaskCancelled, DownloadCancelled)) or cancel.is_set():
                self.end(task_id, self.cancelled)
            else:
                self.fail(task_id, self.failed, exc, "model task")
            return
        self.end(task_id, self.done, result)


class ModelTaskRunner(WorkerHandle):
    """GUI-side handle; see the module docstring. ``cancel``, ``cancel_all``, ``busy``,
    ``is_pending`` and ``shutdown`` are ``desktop.worker_handle.WorkerHandle``'s."""

    progress = Signal(int, float, str)
    done = Signal(int, object)
    failed = Signal(int, str)
    cancelled = Signal(int)
    _submit = Signal(int, object, object)

    def __init__(self, store_factory: Callable[[], Any] = _model_store, parent: QObject | None = None) -> None:
        worker = _TaskWorker(store_factory)
        super().__init__(worker, "arbor-model-tasks", parent)
        self._submit.connect(worker.run)
        # Signal to signal: Qt queues each re-emission to this object's (the GUI) thread.
        for name in ("progress", "done", "failed", "cancelled"):
            getattr(worker, name).connect(getattr(self, name))

    # -- jobs ------------------------------------------------------------------------------------

    def list_models(self) -> int:
        return self.submit(lambda store, report, cancel: store.list())

    def import_model(self, source: Path, name: str | None = None, quantize: int | None = None,
                     draft: str | None = None) -> int:
        """Import ``source``; ``draft``: a stored model to pair with it as its draft."""
        return self.submit(lambda store, report, cancel: store.import_path(
            Path(source), name=name or None, quantize=quantize, progress=report, draft=draft))

    def download_model(self, repo_id: str, *, filename: str | None = None, name: str | None = None,
                       quantize: int | None = None) -> int:
        def job(store, report, cancel):
            from backend.hub import download_to_store

            return download_to_store(repo_id, store, paths.downloads_dir(), name=name or None,
                                     filename=filename or None, quantize=quantize, progress=report, cancel=cancel)

        return self.submit(job)

    def remove_model(self, name: str) -> int:
        return self.submit(lambda store, report, cancel: store.remove(name))

    def unpair_model(self, name: str) -> int:
        return self.submit(lambda store, report, cancel: store.unpair(name))

    def submit(self, job: Job) -> int:
        """Queue ``job`` behind the others; returns its task id."""
        task_id, cancel = self._open_request()
        self._submit.emit(task_id, job, cancel)
        return task_id

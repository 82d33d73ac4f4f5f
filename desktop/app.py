"""Start and stop the desktop app.

``run(model)`` is what ``arbor`` calls when a display is available: it opens the window with the
given model (a store name, Hugging Face folder or ``.gguf`` file; ``None`` means the model used
last, else the embedded default) and returns the process exit code when the window closes.

``create_app(...)`` builds the same parts without running the event loop; tests, the benchmark
and the screenshot script use it (with their own engine loader when they need one).

Shutdown: the window stops every reply and every model task is cancelled, then the inference
worker and the model-task thread together get ``SHUTDOWN_DEADLINE_S`` to finish their current
step. If either cannot (a model still loading, one long prefill chunk, a job that does not check
for cancellation), the store is closed cleanly and the process exits without waiting - never
hanging, never destroying a running thread.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

SHUTDOWN_DEADLINE_S = 5.0
EXIT_OK = 0
EXIT_STORE_ERROR = 2

log = logging.getLogger(__name__)


@dataclass
class AppParts:
    """Everything ``create_app`` built; ``shutdown`` stops it in order."""

    app: object  # QApplication
    store: object  # ChatStore
    client: object  # InferenceClient
    tasks: object  # ModelTaskRunner
    theme: object  # ThemeManager
    window: object  # MainWindow

    def shutdown(self, deadline_s: float = SHUTDOWN_DEADLINE_S) -> bool:
        """Stop replies and threads, close the store; False if a thread missed the deadline
        (it is still running: the caller must exit without destroying it, see ``run``)."""
        from PySide6.QtCore import QDeadlineTimer

        self.window.controller.stop_all()
        threads = {"inference worker": self.client, "model-task thread": self.tasks}
        for thread in threads.values():
            thread.stop()  # both are cancelled before either is waited for
        deadline = QDeadlineTimer(int(deadline_s * 1000))
        late = [name for name, thread in threads.items() if not thread.wait(deadline)]
        self.window.controller.close()
        self.store.purge_deleted()
        self.store.close()
        if late:
            log.warning("the %s did not stop within %.1f s", " and the ".join(late), deadline_s)
        return not late


def ensure_application(argv: list[str] | None = None):
    """The process's ``QApplication`` (created on first use)."""
    from PySide6.QtWidgets import QApplication

    from desktop.version import app_version

    app = QApplication.instance()
    if app is None:
        app = QApplication(argv if argv is not None else sys.argv[:1])
        app.setApplicationName("Arbor")
        app.setApplicationDisplayName("Arbor")
        app.setApplicationVersion(app_version())
        app.setOrganizationName("Arbor")
        app.setDesktopFileName("arbor")
    return app


def create_app(
    model: str | None = None,
    *,
    loader=None,
    store=None,
    theme: str | None = None,
    load_model: bool = True,
    updates_per_second: float | None = None,
) -> AppParts:
    """Build the store, worker, model-task thread, theme and main window (not yet shown)."""
    import backend  # noqa: F401  (loads the system BLAS before the worker imports mlx.core)
    from desktop import paths
    from desktop.cache_settings import stored_budgets
    from desktop.model_tasks import ModelTaskRunner
    from desktop.store import ChatStore
    from desktop.ui.main_window import MainWindow
    from desktop.ui.theme import THEME_KEY, ThemeManager
    from desktop.worker import DEFAULT_UPDATES_PER_SECOND, InferenceClient, load_engine

    app = ensure_application()
    store = store if store is not None else ChatStore(paths.database_path())
    choice = theme or store.app_setting(THEME_KEY, "system")
    theme_manager = ThemeManager(app, choice if choice in ("system", "light", "dark") else "system")
    if loader is None:
        # The prefix cache's budgets as the user last set them, read here: the store's SQLite
        # connection belongs to this thread, the loader runs on the worker's. Later changes
        # reach the loaded engine directly (CacheDialog -> client.set_cache_budgets).
        budgets = stored_budgets(store)

        def loader(ref):
            return load_engine(ref, budgets)
    client = InferenceClient(loader, updates_per_second=updates_per_second or DEFAULT_UPDATES_PER_SECOND)
    tasks = ModelTaskRunner()
    window = MainWindow(store, client, tasks, theme_manager, model_ref=model, load_model=load_model)
    return AppParts(app, store, client, tasks, theme_manager, window)


def run(model: str | None = None) -> int:
    """Open Arbor's window and run until it closes; returns the exit code."""
    logging.basicConfig(level=os.environ.get("ARBOR_LOG", "WARNING"), format="arbor: %(levelname)s %(name)s: %(message)s")
    from desktop.store import StoreError

    app = ensure_application()
    try:
        parts = create_app(model)
    except StoreError as exc:
        from PySide6.QtWidgets import QMessageBox

        QMessageBox.critical(None, "Arbor", str(exc))
        print(f"arbor: error: {exc}", file=sys.stderr)
        return EXIT_STORE_ERROR
    parts.window.show()
    code = app.exec()
    if not parts.shutdown():  # a thread is still running: leave without waiting for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code

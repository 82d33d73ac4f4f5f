"""One worker object on its own ``QThread``, and the GUI thread's handle on it.

The inference client (``desktop.worker``) and the model-task runner (``desktop.model_tasks``)
share this machinery: a thread started once and stopped once, request ids unique for the
handle's lifetime, a ``threading.Event`` per request that ``cancel`` sets at once (without
waiting for the worker's queue), ``busy`` while any request is queued or running, and a
shutdown that waits for the thread only up to a deadline.

Bookkeeping happens in one place. The worker ends every request with ``Worker.end``, which
emits ``settled(id)`` just before the request's last signal; both are queued to the GUI thread
in that order, so by the time receivers of the last signal run, the handle has already
forgotten the request (``is_pending`` is False, ``busy`` counts only the others).
"""

from __future__ import annotations

import itertools
import logging
import threading

from desktop import qt_compat  # noqa: F401,I001  (before any signal is emitted; see the module)
from PySide6.QtCore import QDeadlineTimer, QObject, QThread, Signal, SignalInstance, Slot

from backend.errors import ArborError

log = logging.getLogger(__name__)


def describe_error(exc: BaseException) -> str:
    """One line for the user: an ``ArborError``'s own message, else the type and message (a bug
    in Arbor; the traceback goes to the log). Line breaks become spaces."""
    text = str(exc) if isinstance(exc, ArborError) else f"internal error: {type(exc).__name__}: {exc}"
    return " ".join(text.split())


class Worker(QObject):
    """Base of the objects that run a handle's requests on its thread."""

    settled = Signal(int)  # request id; the request's last signal follows (emitted by ``end``)

    def end(self, request_id: int, signal: SignalInstance, *args: object) -> None:
        """Emit ``signal(request_id, *args)`` as the request's last signal."""
        self.settled.emit(request_id)
        signal.emit(request_id, *args)

    def fail(self, request_id: int, signal: SignalInstance, exc: Exception, what: str) -> None:
        """End the request with ``signal(request_id, one line)``; a failure that is not an
        ``ArborError`` is a bug, so its traceback is logged."""
        if not isinstance(exc, ArborError):
            log.error("%s %d failed", what, request_id, exc_info=exc)
        self.end(request_id, signal, describe_error(exc))


class WorkerHandle(QObject):
    """Owns ``worker`` and the thread it runs on (started here); see the module docstring.
    Subclasses declare the public signals and connect the worker's to them."""

    def __init__(self, worker: Worker, thread_name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._ids = itertools.count(1)
        self._cancels: dict[int, threading.Event] = {}
        self._thread = QThread()
        self._thread.setObjectName(thread_name)
        self._worker = worker
        worker.moveToThread(self._thread)
        self._thread.finished.connect(worker.deleteLater)
        # A bound slot of this GUI-thread object: Qt queues the call to this thread. (A lambda
        # here would run on the worker thread.)
        worker.settled.connect(self._settle)
        self._thread.start()

    # -- requests --------------------------------------------------------------------------------

    def _open_request(self) -> tuple[int, threading.Event]:
        """A new request id and its cancel event (pending until the worker ends it)."""
        request_id = next(self._ids)
        cancel = threading.Event()
        self._cancels[request_id] = cancel
        return request_id, cancel

    @Slot(int)
    def _settle(self, request_id: int) -> None:
        self._cancels.pop(request_id, None)

    def cancel(self, request_id: int) -> None:
        """Stop a request now (running or queued). Unknown or finished ids are ignored."""
        event = self._cancels.get(request_id)
        if event is not None:
            event.set()

    def cancel_all(self) -> None:
        for event in self._cancels.values():
            event.set()

    def is_pending(self, request_id: int) -> bool:
        return request_id in self._cancels

    @property
    def busy(self) -> bool:
        """True while any request is queued or running."""
        return bool(self._cancels)

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the thread is still running (False once it stopped)."""
        return self._thread.isRunning()

    def stop(self) -> None:
        """Cancel every request and ask the thread to end after the one it is running."""
        self.cancel_all()
        self._thread.quit()

    def wait(self, deadline: QDeadlineTimer) -> bool:
        """Wait until the thread has ended or ``deadline`` passes; True if it ended."""
        stopped = self._thread.wait(deadline)
        if stopped:
            self._cancels.clear()  # ended requests whose last signals will never be delivered
        return stopped

    def shutdown(self, deadline_s: float = 5.0) -> bool:
        """``stop``, then ``wait`` at most ``deadline_s``; False if the thread is still running
        (a model load or one prefill chunk cannot be interrupted)."""
        self.stop()
        return self.wait(QDeadlineTimer(int(deadline_s * 1000)))

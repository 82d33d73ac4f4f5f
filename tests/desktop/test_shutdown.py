"""Closing the app while a model task runs: the task is cancelled and waited for within the
shutdown deadline, and a task that cannot stop in time is reported, never silently left running.

The jobs are plain functions run by the real ``ModelTaskRunner`` of the real app; each blocks on
a ``threading.Event`` (cancellation, or a release the test controls), so nothing depends on how
fast this machine is.
"""

from __future__ import annotations

import logging
import threading

import pytest
from PySide6.QtCore import QDeadlineTimer

from desktop.model_tasks import ModelTaskRunner
from tests.desktop.app_parts import app  # noqa: F401  (fixture)


@pytest.fixture
def cancels():
    """Every cancel event a test's jobs received: set after the test, so a job that a broken
    shutdown never cancelled still ends and its thread can be joined."""
    seen: list[threading.Event] = []
    yield seen
    for event in seen:
        event.set()


def blocking_job(started: threading.Event, cancels: list[threading.Event], ended: threading.Event):
    """A job (think: a long import) that runs until it is cancelled."""

    def job(store, report, cancel):
        cancels.append(cancel)
        started.set()
        cancel.wait()
        ended.set()
        report(0.5, "still importing")  # raises TaskCancelled: the task ends as cancelled

    return job


def test_shutdown_cancels_a_running_model_task_and_waits_for_it(qtbot, app, tmp_path, cancels):
    parts = app(tmp_path / "chats.sqlite3")
    started, ended = threading.Event(), threading.Event()
    task = parts.tasks.submit(blocking_job(started, cancels, ended))
    qtbot.waitUntil(started.is_set, timeout=10000)
    assert parts.tasks.is_pending(task) and parts.tasks.busy
    parts.window.close()
    assert parts.shutdown(5.0)
    assert ended.is_set()  # the job saw the cancellation and returned
    assert not parts.tasks.running and not parts.client.running
    assert parts.store._db is None


def test_a_task_that_misses_the_deadline_is_reported_and_the_store_still_closes(qtbot, app, tmp_path, caplog):
    parts = app(tmp_path / "chats.sqlite3")
    started, release = threading.Event(), threading.Event()

    def stuck(store, report, cancel):  # one step that cannot be interrupted
        started.set()
        release.wait()

    parts.tasks.submit(stuck)
    qtbot.waitUntil(started.is_set, timeout=10000)
    parts.window.close()
    try:
        with caplog.at_level(logging.WARNING, logger="desktop.app"):
            assert parts.shutdown(0.5) is False
        assert "model-task thread did not stop" in caplog.text
        assert parts.tasks.running  # still running: `run` exits the process without destroying it
        assert not parts.client.running and parts.store._db is None
    finally:
        release.set()
        assert parts.tasks.wait(QDeadlineTimer(10000))


def test_a_task_is_forgotten_before_its_last_signal_reaches_receivers(qtbot, cancels):
    """The shared handle's bookkeeping: when ``done`` / ``cancelled`` arrive, the task is no
    longer pending and ``busy`` counts only the others."""
    runner = ModelTaskRunner(store_factory=lambda: None)
    seen: list[tuple[str, int, bool, bool]] = []
    runner.done.connect(lambda task, _result: seen.append(("done", task, runner.is_pending(task), runner.busy)))
    runner.cancelled.connect(lambda task: seen.append(("cancelled", task, runner.is_pending(task), runner.busy)))
    started, ended = threading.Event(), threading.Event()
    try:
        first = runner.submit(lambda store, report, cancel: "result")
        second = runner.submit(blocking_job(started, cancels, ended))
        qtbot.waitUntil(started.is_set, timeout=10000)
        qtbot.waitUntil(lambda: len(seen) == 1, timeout=10000)
        with qtbot.waitSignal(runner.cancelled, timeout=10000):
            runner.cancel(second)
        assert seen == [("done", first, False, True), ("cancelled", second, False, False)]
    finally:
        assert runner.shutdown(5.0)

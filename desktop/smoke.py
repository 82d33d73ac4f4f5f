"""``arbor app --smoke``: prove the real app works here without a person, and time it.

It builds the real window (``desktop.app.create_app``: the user's store, the real engine
loader, the model the app would load), shows it and then, like a user:

1. waits until the window is usable: shown, painted once, and the event loop turning again;
2. waits for the model to load on the worker thread;
3. opens a new chat with settings of its own (greedy, ``SMOKE_MAX_TOKENS``: the same answer
   every time), types ``SMOKE_PROMPT`` into the composer and clicks Send, waits for the first
   streamed text and the end of the reply;
4. closes the window and shuts down as ``desktop.app.run`` does.

It prints one JSON object on stdout (timings in seconds; ``*_since_process_start`` count from
the process's start as the kernel recorded it, so they include the interpreter's own start-up):
what the data dir held before this run (whether the database existed, how many conversations,
which imported models), the reply and its statistics, which BLAS and whether the native kernels
were in use (asked on the worker thread, where MLX lives), and whether this is a frozen bundle.
Exit status 0, or 1 with one ``arbor: error:`` line when a step fails or ``timeout_s`` passes.
Works on any Qt platform, ``QT_QPA_PLATFORM=offscreen`` included: the bundle's test opens its
window this way.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

SMOKE_PROMPT = "What is the capital of France?"
SMOKE_MAX_TOKENS = 64
DEFAULT_TIMEOUT_S = 600.0


class SmokeFailure(RuntimeError):
    """A step did not happen (the message names it)."""


def seconds_since_process_start() -> float | None:
    """How long this process has run, from the kernel's record of its start (Linux), else None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def run_smoke(model: str | None = None, prompt: str = SMOKE_PROMPT,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """See the module docstring; returns the exit status."""
    try:
        report = SmokeRun(timeout_s).run(model, prompt)
    except SmokeFailure as exc:
        print(f"arbor: error: smoke run failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report), flush=True)
    return 0


def _native_parts(_engine: Any, _cancel: Any) -> dict[str, Any]:
    """Runs on the worker thread: which BLAS MLX uses and whether the native kernels load."""
    from backend import blas, kernels

    return {"blas": blas.active_blas, "kernels": kernels.available(),
            "kernels_reason": kernels.unavailable_reason()}


def _stored_models() -> list[str]:
    from backend.paths import models_dir

    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


class SmokeRun:
    """One smoke run: the app, the moments each step was reached, and a deadline for all."""

    def __init__(self, timeout_s: float) -> None:
        from desktop.app import ensure_application

        self.started = time.monotonic()
        self.python_ready = seconds_since_process_start()
        self.timeout_s = timeout_s
        self.deadline = self.started + timeout_s
        self.app = ensure_application()
        self.events: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.events.setdefault(name, time.monotonic())

    def wait(self, what: str, done: Callable[[], bool]) -> None:
        """Run the event loop until ``done()``; SmokeFailure past the deadline."""
        from PySide6.QtCore import QEventLoop

        while not done():
            if time.monotonic() > self.deadline:
                raise SmokeFailure(f"timed out after {self.timeout_s:.0f} s waiting for {what}")
            self.app.processEvents(QEventLoop.ProcessEventsFlag.WaitForMoreEvents, 100)

    def run(self, model: str | None, prompt: str) -> dict[str, Any]:
        from desktop import paths
        from desktop.app import create_app

        database_existed = paths.database_path().is_file()
        models_before = _stored_models()
        parts = create_app(model)
        try:
            report = self._drive(parts, prompt)
        finally:  # 4. close and shut down, also after a failed step
            parts.window.close()
            clean = parts.shutdown()
            if not clean:  # as desktop.app.run: never destroy a running thread
                print("arbor: error: a worker thread missed the shutdown deadline", file=sys.stderr)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        return {"frozen": bool(getattr(sys, "frozen", False)), "data_dir": str(paths.data_dir()),
                "database_existed": database_existed, "models_before": models_before, **report}

    def _drive(self, parts: Any, prompt: str) -> dict[str, Any]:
        """Steps 1-3 of the module docstring on the built app (``run`` does step 4)."""
        from PySide6.QtCore import QEvent, QObject, QTimer
        from PySide6.QtWidgets import QWidget

        window, controller, store = parts.window, parts.window.controller, parts.store
        conversations_before = store.count_conversations()
        mark = self.mark
        failures: list[str] = []  # connected before the event loop runs: none is missed
        controller.model_failed.connect(failures.append)

        class FirstPaint(QObject):
            def eventFilter(self, watched, event):  # noqa: N802 - Qt override
                if (event.type() == QEvent.Type.Paint and isinstance(watched, QWidget)
                        and watched.window() is window):
                    mark("painted")
                    QTimer.singleShot(0, lambda: mark("usable"))  # the paint done, loop turning
                return False

        # 1. usable window
        first_paint = FirstPaint()
        self.app.installEventFilter(first_paint)
        window.show()
        self.wait("the window to be painted", lambda: "usable" in self.events)
        usable_since_start = seconds_since_process_start()
        self.app.removeEventFilter(first_paint)
        if not window.composer.input.isEnabled():
            raise SmokeFailure("the message input is disabled in a freshly opened window")

        # 2. model loaded (it may have loaded before this point)
        self.wait("the model to load", lambda: controller.model_info is not None or bool(failures))
        mark("model_loaded")
        if failures:
            raise SmokeFailure(f"the model did not load: {failures[0]}")
        native: dict[str, Any] = {}
        task = parts.client.run_task(_native_parts)
        parts.client.task_done.connect(lambda rid, result: native.update(result) if rid == task else None)
        self.wait("the worker's report on BLAS and kernels", lambda: bool(native))

        # 3. one reply in a chat of its own, typed and sent as a user would
        from desktop.chat_settings import ChatSettings

        window.new_chat()
        window.apply_chat_settings(ChatSettings(temperature=0.0, max_tokens=SMOKE_MAX_TOKENS))
        reply: dict[str, int] = {}
        controller.reply_updated.connect(
            lambda _cid, mid, text: (mark("first_text"), reply.setdefault("id", mid)) if text else None)
        controller.reply_ended.connect(lambda _cid, mid: (mark("reply_ended"), reply.setdefault("id", mid)))
        window.composer.input.setPlainText(prompt)
        mark("sent")
        window.composer.send_button.click()
        self.wait("the reply", lambda: "reply_ended" in self.events)
        message = store.message(reply["id"])
        if message.status != "complete" or not message.content.strip():
            raise SmokeFailure(f"the reply ended as {message.status!r} with text {message.content!r}")
        if "first_text" not in self.events:
            raise SmokeFailure("the reply was never streamed into the window")


        def since_start(name: str) -> float:
            return round(self.events[name] - self.started, 4)

        return {
            "conversations_before": conversations_before,
            "timings_s": {
                "python_ready_since_process_start": _rounded(self.python_ready),
                "usable_since_process_start": _rounded(usable_since_start),
                "usable": since_start("usable"),
                "model_loaded": since_start("model_loaded"),
                "first_token_after_send": round(self.events["first_text"] - self.events["sent"], 4),
                "reply_after_send": round(self.events["reply_ended"] - self.events["sent"], 4),
            },
            "reply": message.content,
            "reply_stats": message.stats,
            **native,
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)

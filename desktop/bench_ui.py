"""GUI responsiveness benchmark: the event loop's stalls while chats load, filter and stream.

    python -m desktop.bench_ui [--conversations 1000] [--model REF] [--tokens 256] [--json]

What it measures (a script, not a test: timings on shared machines are noisy):

* **sidebar ready** - from building the window over a store of N conversations (each a few
  messages with Markdown and code) to the first paint of the sidebar's rows.
* **stalls** - a 1 ms ``QTimer`` probe runs throughout; a stall is how late each tick fires
  (gap minus interval). Reported as p50 / p99 / max per phase:
    - ``browse``: scroll the whole sidebar (lazy pages), open 30 conversations;
    - ``filter``: type a query into the search box one key at a time (as a user does), then clear;
    - ``stream (replay)``: a scripted engine streams a long Markdown reply (prose, code, a table)
      at 300 tokens/s through the real worker, controller, store checkpoints and chat view;
    - ``stream (model)``: the real engine (``--model``, default: the embedded default model)
      answers a prompt asking for code and a table.

Targets (issue 4): p99 stall < 16 ms, sidebar ready < 200 ms at 1,000 conversations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

REPLAY_TEXT = """Sure — here is a small, complete example.

## Reading a CSV file

Python's standard library is enough for most files:

```python
import csv
from pathlib import Path


def read_rows(path: Path) -> list[dict[str, str]]:
    \"\"\"Every row of a CSV file as a dict keyed by the header.\"\"\"
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


if __name__ == "__main__":
    for row in read_rows(Path("fruit.csv")):
        print(row["name"], row["colour"])
```

The `DictReader` uses the first line as the header. Things to watch for:

1. **Encoding** — pass `encoding="utf-8"` explicitly; the platform default varies.
2. **Newlines** — `newline=""` lets the csv module handle `\\r\\n` itself.
3. **Large files** — iterate instead of building a list when memory matters.

| Approach | Memory | Speed | Notes |
|----------|--------|-------|-------|
| `csv.DictReader` | low | medium | standard library |
| `pandas.read_csv` | high | fast | types inferred |
| `polars.read_csv` | medium | fastest | Arrow columns |

For very large inputs, stream the rows and aggregate as you go. *Profile* before optimizing:
most of the time goes to parsing, not I/O. If you need types, convert each field right after
reading it so that errors point at the offending line.
"""

CONVERSATION_TURNS = [
    ("user", "How do I reverse a list in Python?"),
    ("assistant", "Use slicing or `reversed`:\n\n```python\nitems = [1, 2, 3]\nprint(items[::-1])\n"
                  "print(list(reversed(items)))\n```\n\nSlicing copies; `reversed` is lazy."),
    ("user", "And in place?"),
    ("assistant", "Call `items.reverse()`. It returns `None` and changes the list itself.\n\n"
                  "| Way | Copies | Returns |\n|---|---|---|\n| `[::-1]` | yes | list |\n| `reverse()` | no | None |"),
]
TOPICS = ["lists", "dicts", "async IO", "regex", "SQL joins", "Rust lifetimes", "CSS grid", "git rebase",
          "Docker layers", "numpy broadcasting", "HTTP caching", "unit tests", "type hints", "bash loops"]


# ---------------------------------------------------------------------------------------------
# measurement helpers


class StallProbe:
    """A 1 ms timer on the GUI thread; every tick's lateness is one sample."""

    def __init__(self) -> None:
        from PySide6.QtCore import QTimer

        self._timer = QTimer()
        self._timer.setTimerType(self._timer.timerType().PreciseTimer)
        self._timer.setInterval(1)
        self._timer.timeout.connect(self._tick)
        self._last = 0.0
        self.samples: list[float] = []

    def start(self) -> None:
        self.samples = []
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> list[float]:
        self._timer.stop()
        return self.samples

    def _tick(self) -> None:
        now = time.perf_counter()
        self.samples.append(max(0.0, (now - self._last) * 1000.0 - 1.0))
        self._last = now


def summarize(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "ticks": 0}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50_ms": round(statistics.median(ordered), 2), "p99_ms": round(p99, 2),
            "max_ms": round(ordered[-1], 2), "ticks": len(ordered)}


def wait_ms(ms: int) -> None:
    """Run the event loop (idle, not spinning) for ``ms`` milliseconds."""
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def wait_until(condition, timeout_s: float, step_ms: int = 5) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        wait_ms(step_ms)
    return True


class ReplayEngine:
    """A scripted engine for the worker: streams ``text`` in ~4-character tokens at ``rate``
    tokens per second, honouring cancellation (it exercises the real GUI path, not a model).
    The rest of the worker's ``ChatEngine`` surface answers as an engine without a prefix cache
    would: nothing to prefetch, empty statistics, every chat fits (whitespace-separated words
    stand for tokens)."""

    def __init__(self, text: str, rate: float) -> None:
        from backend.api import ModelInfo

        self.text = text
        self.rate = rate
        self.info = ModelInfo("replay", "replay", "float32", None, 8192, 0)
        self._replies: list = []  # (its events, its stream)

    def fit(self, request, fresh: bool = False):
        from backend.context_policy import ContextFit

        messages = list(request.messages or [])
        words = sum(len(str(m.get("content", "")).split()) for m in messages)
        return ContextFit(messages, list(range(words)), 0, words, self.info.context_length)

    def prepare(self) -> None:
        pass  # no drafter

    def prefetch(self, messages=None, prompt_ids=None, cancel=None) -> int:
        return 0

    def cache_stats(self):
        from backend.api import CacheStats, TierStats

        empty = TierStats(0, 0, 0, 0, 0)
        return CacheStats({"device": empty, "host": empty, "disk": empty}, 0, 0, 0,
                          disk_mode="off", disk_note="the replay engine keeps no cache")

    def set_cache_budgets(self, budgets) -> None:
        pass

    def clear_cache(self) -> None:
        pass

    def close(self) -> None:
        pass

    def submit(self, request, cancel: threading.Event | None = None):
        from backend.scheduler import Stream

        stream = Stream(waiting=False)
        self._replies.append((self._events(cancel), stream))
        return stream

    def step(self) -> bool:
        """Each reply's next event (replies advance together, as in a batched step)."""
        for entry in list(self._replies):
            events, stream = entry
            event = next(events, None)
            if event is None:
                stream.done = True
                self._replies.remove(entry)
            else:
                stream.events.append(event)
        return bool(self._replies)

    def stop(self, stream) -> None:
        self._replies = [entry for entry in self._replies if entry[1] is not stream]
        stream.done = True

    def _events(self, cancel: threading.Event | None) -> Iterator:
        from backend.api import DoneEvent, TokenEvent

        pieces = [self.text[i:i + 4] for i in range(0, len(self.text), 4)]
        start = time.perf_counter()
        for index, piece in enumerate(pieces):
            if cancel is not None and cancel.is_set():
                break
            delay = start + (index + 1) / self.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            yield TokenEvent(piece, index)
        elapsed = time.perf_counter() - start
        yield DoneEvent("".join(pieces[:index + 1]), list(range(index + 1)), "stop", 10, 0, index + 1,
                        1.0 / self.rate, 0.0, (index + 1) / max(elapsed, 1e-9))

# ---------------------------------------------------------------------------------------------
# the benchmark


def seed_store(store, count: int) -> None:
    conversations = []
    for index in range(count):
        topic = TOPICS[index % len(TOPICS)]
        turns = [(role, text.replace("list", topic) if role == "user" else text) for role, text in CONVERSATION_TURNS]
        conversations.append((f"{topic.capitalize()} question #{index + 1}", turns))
    store.insert_many(conversations)


def run(conversations: int, model: str | None, tokens: int, skip_model: bool) -> dict:
    from PySide6.QtCore import QEvent, QObject
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication

    from desktop.app import create_app, ensure_application
    from desktop.chat_controller import AUTO_TITLE_KEY
    from desktop.chat_settings import ChatSettings
    from desktop.store import ChatStore
    from desktop.worker import load_engine

    app = ensure_application()
    results: dict = {"conversations": conversations}
    workdir = Path(tempfile.mkdtemp(prefix="arbor-bench-ui-"))
    store = ChatStore(workdir / "bench.sqlite3")  # a throwaway chat database; models come from the store
    seed_store(store, conversations)
    store.set_default_settings(ChatSettings(temperature=0.0, max_tokens=tokens))
    store.set_app_setting(AUTO_TITLE_KEY, False)  # keep the worker free for the measured replies

    replay = ReplayEngine(REPLAY_TEXT * 3, rate=300.0)

    def loader(ref):
        return replay if ref == "replay" else load_engine(ref)

    # 1. Sidebar ready: window construction -> first painted rows.
    painted: list[float] = []

    class PaintWatch(QObject):
        def eventFilter(self, watched, event) -> bool:  # noqa: N802
            if event.type() == QEvent.Type.Paint and not painted:
                painted.append(time.perf_counter())
            return False

    t0 = time.perf_counter()
    parts = create_app("replay", loader=loader, store=store, theme="light")
    window = parts.window
    watch = PaintWatch()
    window.sidebar.list_view.viewport().installEventFilter(watch)
    window.show()
    wait_until(lambda: bool(painted), 10)
    results["sidebar_ready_ms"] = round((painted[0] - t0) * 1000.0, 1) if painted else None
    results["sidebar_rows_first_page"] = window.conversations.rowCount()
    wait_until(lambda: window.controller.model_info is not None, 30)

    probe = StallProbe()

    # 2. Browse: scroll the sidebar to the end (every page), open conversations.
    probe.start()
    view = window.sidebar.list_view
    while window.conversations.canFetchMore():
        view.verticalScrollBar().setValue(view.verticalScrollBar().maximum())
        wait_ms(30)
    ids = window.conversations.conversation_ids()
    opened = []
    for conversation_id in ids[:: max(1, len(ids) // 30)][:30]:
        start = time.perf_counter()
        window.open_conversation(conversation_id)
        opened.append((time.perf_counter() - start) * 1000.0)
        wait_ms(40)
    results["browse"] = summarize(probe.stop())
    results["browse"]["loaded"] = window.conversations.loaded
    results["open_conversation_ms_p50"] = round(statistics.median(opened), 1) if opened else None

    # 3. Filter: type a query key by key, as a user would, then clear it.
    window.sidebar.focus_search()
    probe.start()
    search_times = []
    for query in ("rust lifetimes", "reverse", "zzz-no-match"):
        for char in query:
            QTest.keyClick(window.sidebar.search, char)
            wait_ms(90)
        start = time.perf_counter()
        window.run_search(window.sidebar.search.text())
        search_times.append((time.perf_counter() - start) * 1000.0)
        wait_ms(200)
        window.sidebar.search.clear()
        wait_ms(100)
    results["filter"] = summarize(probe.stop())
    results["search_query_ms_max"] = round(max(search_times), 1)

    # 4. Stream (replay): a long Markdown reply at 300 tokens/s through the real GUI path.
    window.new_chat()
    probe.start()
    window.send("Show me how to read a CSV file")
    wait_until(lambda: not window.controller.busy, 120)
    samples = probe.stop()
    results["stream_replay"] = summarize(samples)
    results["stream_replay"]["chars"] = len(window.store.path(window.current_id)[-1].message.content)

    # 5. Stream (model): the real engine.
    if not skip_model:
        window.load_model(model)
        loaded = wait_until(lambda: window.controller.model_info is not None
                            and window.controller.model_info.name != "replay", 600)
        if loaded:
            window.new_chat()
            probe.start()
            window.send("Write a Python function that adds two numbers, then a Markdown table of three fruits "
                        "and their colours.")
            wait_until(lambda: not window.controller.busy, 900)
            samples = probe.stop()
            reply = window.store.path(window.current_id)[-1].message
            results["stream_model"] = summarize(samples)
            results["stream_model"].update(model=window.controller.model_info.name,
                                           tokens=(reply.stats or {}).get("generated_tokens"),
                                           decode_tps=(reply.stats or {}).get("decode_tps"))
        else:
            results["stream_model"] = {"error": window.status_label.text()}
    window.close()
    parts.shutdown(10.0)
    app.processEvents()
    QApplication.processEvents()
    return results


def format_results(results: dict) -> str:
    lines = [f"Arbor UI responsiveness ({results['conversations']} stored conversations)",
             f"  sidebar ready: {results['sidebar_ready_ms']} ms (first page: {results['sidebar_rows_first_page']} rows)",
             f"  open a conversation: {results['open_conversation_ms_p50']} ms (median)",
             f"  search query: {results['search_query_ms_max']} ms (slowest)"]
    for key, label in (("browse", "browse (scroll all, open 30)"), ("filter", "filter (type queries)"),
                       ("stream_replay", "stream (replay, 300 tok/s)"), ("stream_model", "stream (model)")):
        phase = results.get(key)
        if not phase:
            continue
        if "error" in phase:
            lines.append(f"  {label}: skipped ({phase['error']})")
            continue
        extra = ""
        if key == "stream_model":
            extra = f"  [{phase.get('model')}, {phase.get('tokens')} tokens at {phase.get('decode_tps')} tok/s]"
        lines.append(f"  {label:32s} stall p50 {phase['p50_ms']:6.2f} ms  p99 {phase['p99_ms']:6.2f} ms  "
                     f"max {phase['max_ms']:7.2f} ms  ({phase['ticks']} ticks){extra}")
    return "\n".join(lines)


def _quiet_offscreen_warnings() -> None:
    """The offscreen platform warns once per top-level resize that it cannot propagate size
    hints; that says nothing about the figures, so keep it out of the report."""
    from PySide6.QtCore import qInstallMessageHandler

    import desktop.qt_compat  # noqa: F401  (the handler returns None into Qt: needs the guard)

    def handler(_kind, _context, message: str) -> None:
        if "propagateSizeHints" not in message:
            print(message, file=sys.stderr)

    qInstallMessageHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arbor bench ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--model", default=None, help="model for the real-engine phase (default: the embedded one)")
    parser.add_argument("--tokens", type=int, default=256, help="max tokens of the real-engine reply")
    parser.add_argument("--skip-model", action="store_true", help="only the replay phases")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    import backend  # noqa: F401  (system BLAS before mlx)

    _quiet_offscreen_warnings()
    results = run(args.conversations, args.model, args.tokens, args.skip_model)
    print(json.dumps(results) if args.json else format_results(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

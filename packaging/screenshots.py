"""Take Arbor's screenshots under Xvfb: ``python packaging/screenshots.py [--out docs/screenshots]``.

Without a display the script re-runs itself under ``xvfb-run`` (on Debian/Ubuntu: ``apt-get
install xvfb libxcb-cursor0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0
libxcb-render-util0 libxcb-shape0 libxcb-xinerama0 libxcb-xkb1 libxkbcommon-x11-0 libegl1``), so the window is drawn by the real X11 (xcb) platform plugin, then grabbed from
the X screen. Everything happens in a throwaway data dir: a few conversations are created (one of
them a scripted showcase reply with reasoning, code and a table, marked as such in its text), and
one reply is generated live by the embedded default model, with its real statistics.

Output (PNG):
    main-700.png       the showcase conversation with a live follow-up reply (its stats line,
    main-1180.png      actions and branch arrows) at 700, 1180 (the default) and 1600 px wide:
    main-1600.png      nothing in the chat column is cut off at any of them
    main-light.png     the window in the light theme on the showcase conversation
    main-dark.png      the dark theme on the live reply from the default model
    search.png         full-text search results in the sidebar
    model-manager.png  the model manager listing the installed models
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHOWCASE_REPLY = """<think>The user wants to read a CSV file and see the options side by side. Show the
standard-library way first, then compare libraries in a table.</think>
*(Scripted showcase reply for the screenshot.)* The standard library's `csv` module is enough for
most files:

```python
import csv
from pathlib import Path


def read_rows(path: Path) -> list[dict[str, str]]:
    \"\"\"Every row of a CSV file, keyed by the header line.\"\"\"
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


for row in read_rows(Path("fruit.csv")):
    print(row["name"], row["colour"])
```

| Library | Memory | Speed | Types |
|---------|--------|-------|-------|
| `csv` (stdlib) | low | medium | strings |
| `pandas` | high | fast | inferred |
| `polars` | medium | fastest | Arrow |

Pass `newline=""` so the module handles `\\r\\n` itself, and name the encoding explicitly.
"""

OLDER_CHATS = [
    # (title, days ago, pinned, user text, assistant text)
    ("Trip checklist for Lisbon", 0.2, True, "What should I pack for 4 days in Lisbon in May?",
     "Light layers, comfortable shoes for the hills, a rain jacket and sunscreen."),
    ("Regex for ISO dates", 0.5, False, "A regex for ISO 8601 dates?", "`^\\d{4}-\\d{2}-\\d{2}$` matches the date part."),
    ("Explain Rust lifetimes", 1.2, False, "Explain Rust lifetimes simply.", "A lifetime names how long a borrow is valid."),
    ("SQL window functions", 3.0, False, "When do I use window functions?", "When each row needs an aggregate over its neighbours."),
    ("Bash: loop over files", 5.0, False, "Loop over files with spaces?", "Quote the variable: `for f in *; do echo \"$f\"; done`."),
    ("Sourdough hydration", 12.0, False, "What hydration for a first sourdough?", "Start around 70% and adjust."),
    ("Git rebase vs merge", 40.0, False, "Rebase or merge?", "Rebase local work, merge shared branches."),
]


def reexec_under_xvfb(argv: list[str]) -> int:
    if shutil.which("xvfb-run") is None:
        print("screenshots: no display and no xvfb-run (apt-get install xvfb libxcb-cursor0)", file=sys.stderr)
        return 2
    env = {**os.environ, "ARBOR_SCREENSHOT_CHILD": "1", "QT_QPA_PLATFORM": "xcb"}
    command = ["xvfb-run", "-a", "-s", "-screen 0 1700x1100x24", sys.executable, __file__, *argv]
    return subprocess.call(command, env=env)


def seed(database: Path) -> int:
    """Create the demo conversations; returns the showcase conversation's id."""
    from desktop.store import ChatStore

    now = time.time()
    for title, days, pinned, question, answer in reversed(OLDER_CHATS):
        stamp = now - days * 86400
        store = ChatStore(database, clock=lambda stamp=stamp: stamp)
        chat = store.create_conversation(title)
        user = store.add_message(chat.id, None, "user", question)
        store.add_message(chat.id, user.id, "assistant", answer)
        store.set_pinned(chat.id, pinned)
        store.close()
    store = ChatStore(database)
    chat = store.create_conversation("Reading CSV files in Python")
    user = store.add_message(chat.id, None, "user", "How do I read a CSV file in Python? Compare the usual options.")
    store.add_message(chat.id, user.id, "assistant", SHOWCASE_REPLY)
    store.close()
    return chat.id


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="Take Arbor's screenshots under Xvfb.")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    parser.add_argument("--model", default=None, help="model for the live reply (default: the embedded one)")
    args = parser.parse_args(argv)
    if not os.environ.get("DISPLAY") and not os.environ.get("ARBOR_SCREENSHOT_CHILD"):
        return reexec_under_xvfb(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "xcb")
    home = Path(tempfile.mkdtemp(prefix="arbor-screenshots-"))
    os.environ["ARBOR_HOME"] = str(home)
    args.out.mkdir(parents=True, exist_ok=True)

    import backend  # noqa: F401  (system BLAS before mlx)
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtGui import QGuiApplication

    from desktop import paths
    from desktop.app import create_app
    from desktop.chat_controller import AUTO_TITLE_KEY
    from desktop.chat_settings import ChatSettings
    from desktop.store import ChatStore

    showcase = seed(paths.database_path())
    store = ChatStore(paths.database_path())
    store.set_app_setting(AUTO_TITLE_KEY, False)
    store.set_default_settings(ChatSettings(temperature=0.0, max_tokens=220))
    store.set_app_setting("last_conversation", showcase)
    parts = create_app(args.model, store=store, theme="light")
    window = parts.window

    def wait(ms: int) -> None:
        loop = QEventLoop()
        QTimer.singleShot(ms, loop.quit)
        loop.exec()

    def wait_until(condition, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            wait(50)
        return condition()

    def shoot(widget, name: str) -> None:
        wait(400)
        screen = QGuiApplication.primaryScreen()
        pixmap = screen.grabWindow(widget.winId())  # what the X server shows
        if pixmap.isNull() or pixmap.width() < 50:
            pixmap = widget.grab()
        path = args.out / name
        pixmap.save(str(path))
        print(f"screenshots: {path} ({pixmap.width()}x{pixmap.height()})")

    window.resize(1360, 860)
    window.show()
    window.move(0, 0)
    if not wait_until(lambda: window.controller.model_info is not None, 600):
        print(f"screenshots: the model did not load: {window.status_label.text()}", file=sys.stderr)
    window.open_conversation(showcase)
    for widget in window.chat_view.message_widgets():
        if widget.reasoning_toggle is not None:
            widget.reasoning_toggle.setChecked(True)
    shoot(window, "main-light.png")

    # A live follow-up in the showcase chat, regenerated once (branch arrows), at three widths.
    window.send("Which of these would you pick for a 2 GB file, and why?")
    wait_until(lambda: not window.controller.busy, 900)
    window.regenerate_last()
    wait_until(lambda: not window.controller.busy, 900)
    for width, height in ((700, 560), (1180, 780), (1600, 1000)):
        window.resize(width, height)
        wait_until(lambda: window.width() == width, 5)
        window.chat_view.scroll_to_bottom()
        shoot(window, f"main-{width}.png")

    # A live reply from the model, in the dark theme.
    window.set_theme("dark")
    window.new_chat()
    window.send("Explain what a Python list comprehension is, with a short example.")
    wait_until(lambda: not window.controller.busy, 900)
    window.rename_conversation(window.current_id, "List comprehensions")
    shoot(window, "main-dark.png")

    window.set_theme("light")
    window.sidebar.search.setText("rust")
    wait_until(lambda: window.search_results.rowCount() > 0, 5)
    shoot(window, "search.png")
    window.sidebar.search.clear()

    manager = window.open_model_manager()
    manager.resize(820, 460)
    wait_until(lambda: manager.table_model.rowCount() > 0, 60)
    manager.table.selectRow(0)
    shoot(manager, "model-manager.png")
    manager.close()

    window.close()
    parts.shutdown(10.0)
    shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

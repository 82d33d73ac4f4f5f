"""Arbor's desktop app (PySide6). Never imports ``mlx``; the engine runs on one worker thread.

Module map:
    app.py            ``run(model) -> int``: build the window, the worker, the store; event loop
    paths.py          the data dir (decided by ``backend.paths``: ``ARBOR_HOME`` or platformdirs)
    chat_settings.py  per-chat system prompt and sampling, app-wide defaults
    store/            SQLite (WAL) conversations: message tree, settings, FTS5 search, migrations
    transfer.py       export/import (JSON with the whole tree; Markdown of the current path)
    worker.py         the inference worker (QObject on a QThread) and its GUI-side client
    model_tasks.py    model-manager jobs (import, Hub download, delete) on their own thread
    worker_handle.py  what both threads share: request ids, cancellation, shutdown with a deadline
    titles.py         automatic conversation titles
    bench_ui.py       event-loop responsiveness benchmark
    ui/               widgets and item models
"""

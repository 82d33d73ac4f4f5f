"""``arbor serve``: Arbor's local OpenAI-compatible HTTP server (FastAPI on uvicorn, no Qt).

    engine_thread.py  EngineThread: the one thread that owns the engine; jobs in arrival order,
                      a cancel event each, counters for /health
    schemas.py        request bodies (pydantic, strict types, OpenAI's ranges)
    responses.py      OpenAI response bodies and stream chunks from engine events
    app.py            create_app: routes, errors in OpenAI's shape, API key and body-size
                      guards, disconnect -> cancel
    run.py            ArborServer / serve: the loopback rule, binding, uvicorn, orderly stop

Scope: one loaded model, one generation at a time (the rest wait in order), text only.
Not in scope: batching several requests into one forward pass, tools, images, embeddings.
"""

from backend.server.app import MAX_BODY_BYTES, create_app
from backend.server.engine_thread import EngineThread
from backend.server.run import ArborServer, ServeError, bind, check_exposure, serve

__all__ = ["MAX_BODY_BYTES", "ArborServer", "EngineThread", "ServeError", "bind",
           "check_exposure", "create_app", "serve"]

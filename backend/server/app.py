"""The ASGI app: OpenAI-compatible routes over one ``EngineThread``.

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions`` (streamed as server-sent events with ``"stream": true``), and Arbor's
own ``GET /health`` (queue counters, never behind a key) and ``GET /v1/arbor/cache`` (the
prefix cache's statistics, read between generations).

Every error is OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with one
line of message: 400 for a body that is not JSON, has wrong types or values out of range, or a
prompt the model cannot take (``code: context_length_exceeded``); 401 without the right key;
404 for an unknown route or model; 413 for a body over ``max_body_bytes`` (refused before it is
parsed); 500 for a bug; 503 when the server shuts down under a request. A stream that fails
after it began ends with one ``data: {"error": ...}`` event instead of ``[DONE]``.

A generation waits in the engine thread's queue; when its client disconnects (while it waits,
during the prefill or mid-stream) its cancel event is set and the engine stops it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import asdict
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from backend.api import DoneEvent, GenerateRequest, TokenEvent
from backend.errors import ArborError, ContextLengthError, InvalidRequestError
from backend.server.engine_thread import Cancelled, EngineThread
from backend.server.responses import ChatFormat, CompletionFormat, TokenLogprob, sse
from backend.server.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("arbor.server")

MAX_BODY_BYTES = 4 << 20
OPEN_PATHS = ("/health",)  # answered without the API key: liveness checks


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": " ".join(message.split()), "type": type_,
                               "param": param, "code": code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def engine_error(exc: BaseException, prompt_param: str | None = None) -> APIError:
    """What the engine thread delivered instead of events, as an error response."""
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, ArborError):
        return APIError(400, str(exc))
    if isinstance(exc, Cancelled):
        return APIError(503, "the server is shutting down", "server_error")
    return APIError(500, f"internal error: {exc}", "server_error")


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as one line naming the field."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {reason}".rstrip(": "))
    loc = first["loc"][1:] if first["loc"][:1] == ("body",) else first["loc"]
    param, branch = _param_name(loc)
    if first["type"] == "missing":
        message = "is required"
    elif branch is not None:  # a value that fits none of a union's types
        message = _UNION_HINTS.get(branch, "has the wrong type")
    else:
        message = first["msg"].removeprefix("Value error, ")
    if param is None:
        return APIError(400, "the request body must be a JSON object")
    return APIError(400, f"{param}: {message}", param=param)


# Fields whose type is a union: pydantic reports one error per member, this says it once.
_UNION_HINTS = {
    "stop": "must be a string or a list of up to 16 non-empty strings",
    "content": "must be a string, a list of text parts or null",
    "prompt": "must be a string or a list of token ids (or a list holding one of these)",
}


def _param_name(loc: tuple) -> tuple[str | None, str | None]:
    """``("messages", 0, "role")`` -> ``messages[0].role``. A path that goes on into one member
    of a union (pydantic tags it with the member's type, e.g. ``list[int]``) ends at the union
    field, which is returned second."""
    name = ""
    for i, part in enumerate(loc):
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else part)
        if part in _UNION_HINTS and i + 1 < len(loc) and isinstance(loc[i + 1], str):
            return name, part
    return name or None, None


class _RequireKey:
    """401 for any request but ``OPEN_PATHS`` without ``Authorization: Bearer <key>``; checked
    before the body is read."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer "
                                 "<key>' with the key the server was started with",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _LimitBody:
    """Reads the whole body before the app sees it and answers 413 as soon as it is larger
    than ``limit`` bytes (at once when Content-Length says so), so nothing parses it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"the request body is larger than {self.limit} bytes",
                             code="request_too_large")
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await too_large.response()(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before it finished sending
            body += message.get("body", b"")
            if len(body) > self.limit:
                await too_large.response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # then only http.disconnect comes
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class _Events:
    """One job's results on the event loop, put there from the engine thread."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:  # runs on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self) -> Any:
        return await self._queue.get()


async def _cancel_on_disconnect(request: Request, cancel) -> None:
    """Set ``cancel`` when the client goes away (the body has been read: ``receive`` now
    returns only when the connection closes or the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()


def create_app(engine: EngineThread, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's ASGI app over a started ``EngineThread``."""
    info = engine.info
    assert info is not None, "start the engine thread first"
    created = int(time.time())
    app = FastAPI(title="Arbor", summary="OpenAI-compatible API of a local model",
                  docs_url=None, redoc_url=None)
    app.add_middleware(_LimitBody, limit=max_body_bytes)
    if api_key:
        app.add_middleware(_RequireKey, key=api_key)  # added last: runs first

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message, code = str(exc.detail), None
        if exc.status_code == 404:
            message, code = f"{request.url.path} is not an endpoint of this server", "not_found"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, message, type_, code=code).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return engine_error(exc).response()

    def model_card() -> dict:
        return {"id": info.name, "object": "model", "created": created, "owned_by": "arbor",
                "context_length": info.context_length, "architecture": info.architecture,
                "dtype": info.dtype, "quantization": info.quantization}

    def check_model(model: str) -> None:
        if model != info.name:
            raise APIError(404, f"model {model!r} is not served here; this server serves "
                           f"{info.name!r}", param="model", code="model_not_found")

    def logprob_of(event: TokenEvent) -> list[TokenLogprob]:
        if event.logprob is None or event.token_id < 0:
            return []
        return [TokenLogprob(engine.token_text(event.token_id), event.logprob)]

    async def collect(first: Any, events: _Events, fmt, prompt_param: str) -> dict:
        logprobs: list[TokenLogprob] = []
        item = first
        while not isinstance(item, DoneEvent):
            if isinstance(item, BaseException):
                raise engine_error(item, prompt_param)
            logprobs += logprob_of(item)
            item = await events.get()
        if item.finish_reason == "cancelled":
            raise engine_error(Cancelled())
        return fmt.response(item.text, logprobs, item)

    async def stream(first: Any, events: _Events, fmt, job, watcher) -> AsyncIterator[bytes]:
        try:
            head = fmt.first_chunk()
            if head is not None:
                yield sse(head)
            item = first
            while True:
                if isinstance(item, DoneEvent) and item.finish_reason == "cancelled":
                    item = Cancelled()
                if isinstance(item, BaseException):
                    yield sse(engine_error(item).body)
                    return
                if isinstance(item, DoneEvent):
                    yield sse(fmt.final_chunk(item.finish_reason))
                    if fmt.include_usage:
                        yield sse(fmt.usage_chunk(item))
                    yield sse("[DONE]")
                    return
                logprobs = logprob_of(item)
                if item.text or logprobs:
                    yield sse(fmt.chunk(item.text, logprobs))
                item = await events.get()
        finally:  # also when the response is cancelled because the client went away
            watcher.cancel()
            job.cancel.set()

    async def generate(request: Request, generate_request: GenerateRequest, fmt,
                       streaming: bool, prompt_param: str):
        events = _Events()
        job = engine.generate(generate_request, events.put)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job.cancel))
        streamed = False
        try:
            # Wait for the first event before answering, so a request the engine refuses gets
            # its error status even when it asked for a stream.
            first = await events.get()
            if isinstance(first, BaseException):
                raise engine_error(first, prompt_param)
            if streaming:
                streamed = True
                return StreamingResponse(stream(first, events, fmt, job, watcher),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return JSONResponse(await collect(first, events, fmt, prompt_param))
        finally:
            if not streamed:  # the stream's own ``finally`` does this when it ends
                watcher.cancel()
                job.cancel.set()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": info.name, "queue": asdict(engine.counts())}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        check_model(model)
        return model_card()

    @app.get("/v1/arbor/cache")
    async def cache_stats() -> dict:
        events = _Events()
        engine.call(lambda e: e.cache_stats(), events.put)
        stats = await events.get()
        if isinstance(stats, BaseException):
            raise engine_error(stats)
        return asdict(stats)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        fmt = ChatFormat(info.name, body.include_usage, bool(body.logprobs))
        return await generate(request, body.generate_request(info.context_length), fmt,
                              bool(body.stream), "messages")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        fmt = CompletionFormat(info.name, body.include_usage, body.logprobs is not None)
        request_ = body.generate_request(info.context_length, engine.encode)
        return await generate(request, request_, fmt, bool(body.stream), "prompt")

    return app

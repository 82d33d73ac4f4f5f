"""`arbor serve`'s HTTP API on a real server (uvicorn on loopback) over the tiny real model,
talked to with the official ``openai`` client and with raw HTTP: responses and streams in
OpenAI's shapes, cached tokens, errors (4xx/5xx, and the server keeps serving), disconnects
that cancel, the one engine thread's queue, the API key, shutdown."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from backend.api import TokenEvent
from backend.engine import Engine
from backend.memory.budgets import CacheConfig
from backend.tokenizer import Tokenizer
from tests.fixtures.server import (
    GatedEngine,
    RelayEngine,
    connection,
    get_json,
    request,
    running_server,
    wait_until,
)

HELLO = [{"role": "user", "content": "hello there"}]
MODEL = "<the served model>"  # replaced by the served model's name before a request is sent
SMALL_BODY_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


def loader(folder, gated: bool = False, allowance: int | None = None, cache=None):
    def load():
        engine = Engine.load(str(folder), cache=cache)
        return GatedEngine(engine, allowance) if gated else engine
    return load


@pytest.fixture(scope="module")
def shared(folder, tmp_path_factory):
    """One server for the tests that leave no state that matters (its own disk tier)."""
    cache = CacheConfig.default(directory=tmp_path_factory.mktemp("server-cache"))
    with running_server(loader(folder, cache=cache), max_body_bytes=SMALL_BODY_LIMIT) as srv:
        yield srv


@pytest.fixture
def gated(folder):
    """A fresh server whose engine holds every token until the test opens the gate."""
    with running_server(loader(folder, gated=True, allowance=0)) as srv:
        yield srv


def ended(srv) -> dict:
    """The queue's counts but for the batch's live figures (active, prefilling)."""
    return {k: v for k, v in srv.queue().items() if k not in ("active", "prefilling")}


def chat(srv, messages=HELLO, **options):
    options.setdefault("max_tokens", 6)
    options.setdefault("temperature", 0)
    return srv.client().chat.completions.create(model=srv.model, messages=messages, **options)


# -- shapes ---------------------------------------------------------------------------------
def test_models_lists_the_loaded_model(shared):
    client = shared.client()
    assert [m.id for m in client.models.list().data] == [shared.model]
    assert client.models.retrieve(shared.model).owned_by == "arbor"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_completion_counts_tokens_like_the_chat_template(shared, folder):
    reply = chat(shared, max_tokens=6, extra_body={"ignore_eos": True})
    template_ids = Tokenizer.from_folder(folder).apply_chat_template(HELLO)
    assert reply.object == "chat.completion" and reply.model == shared.model
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    usage = reply.usage
    assert usage.prompt_tokens == len(template_ids)
    assert usage.completion_tokens == 6
    assert usage.total_tokens == usage.prompt_tokens + 6
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_a_long_chat_is_trimmed_only_when_the_request_asks_for_a_policy(shared):
    """OpenAI clients expect a 400 for a prompt longer than the context; ``context_overflow``
    (an Arbor extension) leaves old turns out instead, keeping the system prompt."""
    long = [{"role": "system", "content": "Be brief."}]
    for turn in range(30):
        long += [{"role": "user", "content": f"question {turn}: how are things going?"},
                 {"role": "assistant", "content": f"answer {turn}: fine, thank you."}]
    long.append({"role": "user", "content": "and now?"})
    with pytest.raises(openai.BadRequestError, match="context"):
        chat(shared, messages=long)
    reply = chat(shared, messages=long, extra_body={"context_overflow": "drop_old_turns"})
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens < 512
    with pytest.raises(openai.BadRequestError, match="context_overflow"):
        chat(shared, messages=long, extra_body={"context_overflow": "forget"})


def test_a_streamed_chat_says_what_the_unstreamed_one_says(shared):
    options = dict(max_tokens=8, extra_body={"ignore_eos": True})
    whole = chat(shared, **options)
    chunks = list(chat(shared, stream=True, stream_options={"include_usage": True}, **options))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_from_token_ids_and_text_with_logprobs(shared):
    client = shared.client()
    ids = [5, 17, 42, 99, 3]
    whole = client.completions.create(model=shared.model, prompt=ids, max_tokens=5,
                                      temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 5
    assert len(choice.logprobs.token_logprobs) == 5
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    streamed = client.completions.create(model=shared.model, prompt=ids, max_tokens=5,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    text = client.completions.create(model=shared.model, prompt="abc", max_tokens=2)
    assert text.usage.prompt_tokens >= 1 and text.choices[0].finish_reason in ("stop", "length")


def test_chat_logprobs_are_the_sampled_tokens(shared):
    reply = chat(shared, logprobs=True, max_tokens=4, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 4 and all(t.logprob <= 0 and t.top_logprobs == [] for t in content)


def test_the_stream_on_the_wire_is_server_sent_events_ending_in_done(shared):
    status, headers, body = send(shared, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": HELLO, "max_tokens": 3, "stream": True,
        "ignore_eos": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert len({p["id"] for p in payloads}) == 1


def test_the_server_runs_on_the_c_parser_and_event_loop(shared):
    """httptools and uvloop (``run.fast_transport``): the pure-Python ones cost the model's
    steps CPU time with many streams open."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    uvicorn_server = shared.server._server
    wait_until(lambda: uvicorn_server.started, "uvicorn to start")
    assert uvicorn_server.config.http is HttpToolsProtocol
    loop = uvicorn_server.servers[0].get_loop()
    assert type(loop).__module__.startswith("uvloop"), type(loop)


def test_extra_fields_and_nulls_are_accepted(shared):
    status, _, body = send(shared, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "developer", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text",
                                                                     "text": "hi"}]}],
        "max_tokens": 2, "temperature": None, "user": "someone", "metadata": {"a": "b"},
        "tools": [], "response_format": {"type": "text"}, "n": 1})
    assert status == 200, body


# -- the prefix cache ------------------------------------------------------------------------
def test_cached_tokens_on_a_repeated_and_a_continued_conversation(folder):
    with running_server(loader(folder)) as srv:
        first = chat(srv, max_tokens=4)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = chat(srv, max_tokens=4)
        # the same prompt: everything but the last token, which must run to give logits
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        follow_up = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                             {"role": "user", "content": "and now?"}]
        chunks = list(chat(srv, messages=follow_up, stream=True,
                           stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert first.usage.prompt_tokens <= usage.prompt_tokens_details.cached_tokens \
            < usage.prompt_tokens
        stats = get_json(srv.url, "/v1/arbor/cache")
        assert set(stats["tiers"]) == {"device", "host", "disk"} and stats["nodes"] > 0
        assert stats["live_hits"] >= again.usage.prompt_tokens_details.cached_tokens


# -- bad requests -----------------------------------------------------------------------------
def body(**fields) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields}


def send(srv, method: str, path: str, payload=None, headers: dict | None = None):
    if isinstance(payload, dict) and payload.get("model") == MODEL:
        payload = {**payload, "model": srv.model}
    return request(srv.url, method, path, payload, headers)


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# (path, body, status, param, code, words in the message)
BAD_REQUESTS = {
    "broken JSON": (CHAT, b'{"model": "x", "messages": [', 400, None, None, "not valid JSON"),
    "not an object": (CHAT, b"[1, 2]", 400, None, None, "JSON object"),
    "no messages": (CHAT, {"model": MODEL}, 400, "messages", None, "required"),
    "empty messages": (CHAT, body(messages=[]), 400, "messages", None, "at least 1"),
    "string temperature": (CHAT, body(temperature="hot"), 400, "temperature", None, "number"),
    "temperature too high": (CHAT, body(temperature=2.5), 400, "temperature", None, "2"),
    "top_p zero": (CHAT, body(top_p=0), 400, "top_p", None, "greater than 0"),
    "max_tokens zero": (CHAT, body(max_tokens=0), 400, "max_tokens", None, "1"),
    "boolean max_tokens": (CHAT, body(max_tokens=True), 400, "max_tokens", None, "integer"),
    "n > 1": (CHAT, body(n=2), 400, "n", None, "n=1"),
    "stop a number": (CHAT, body(stop=5), 400, "stop", None, "string"),
    "unknown role": (CHAT, body(messages=[{"role": "wizard", "content": "x"}]), 400,
                     "messages[0].role", None, "user"),
    "image part": (CHAT, body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages[0].content",
        None, "image_url"),
    "top logprobs": (CHAT, body(logprobs=True, top_logprobs=3), 400, "top_logprobs", None,
                     "not supported"),
    "user message without content": (CHAT, body(messages=[{"role": "user"}]), 400,
                                     "messages[0]", None, "needs content"),
    "max_tokens beyond the context": (CHAT, body(max_tokens=100000), 400, "max_tokens", None,
                                      "512"),
    "unknown model": (CHAT, body(model="gpt-4"), 404, "model", "model_not_found", "gpt-4"),
    "prompt too long": (CHAT, body(messages=[{"role": "user", "content": "word " * 300}]), 400,
                        "messages", "context_length_exceeded", "512"),
    "streamed prompt too long": (CHAT, body(stream=True, messages=[
        {"role": "user", "content": "word " * 300}]), 400, "messages",
        "context_length_exceeded", "512"),
    "ids too long": (COMPLETIONS, {"model": MODEL, "prompt": [5] * 600}, 400, "prompt",
                     "context_length_exceeded", "600"),
    "id out of vocabulary": (COMPLETIONS, {"model": MODEL, "prompt": [5, 100000]}, 400, None,
                             None, "100000"),
    "batch of two prompts": (COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, 400,
                             "prompt", None, "token ids"),
    "echo": (COMPLETIONS, {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo", None,
             "not supported"),
    "body over the limit": (CHAT, body(messages=[{"role": "user", "content": "x" *
                                                  SMALL_BODY_LIMIT}]),
                            413, None, "request_too_large", str(SMALL_BODY_LIMIT)),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_a_bad_request_gets_its_error_and_the_server_keeps_serving(shared, case):
    path, payload, status, param, code, words = BAD_REQUESTS[case]
    got, headers, raw = send(shared, "POST", path, payload)
    assert got == status, raw
    assert headers["content-type"] == "application/json"
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code)
    assert words in error["message"] and "\n" not in error["message"]
    assert chat(shared, max_tokens=1).choices[0].finish_reason in ("stop", "length")


def test_a_body_announced_over_the_limit_is_refused_before_it_is_read(shared):
    conn = connection(shared.url)  # says 1 GB, sends a few bytes: only the header can tell
    try:
        conn.putrequest("POST", CHAT)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(10**9))
        conn.endheaders(b'{"model": ')
        response = conn.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()


def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives(shared):
    piece = b" " * 8192
    conn = connection(shared.url)
    try:
        conn.request("POST", CHAT, body=iter([b'{"model": "x", "pad": "'] + [piece] * 16),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()
    assert chat(shared, max_tokens=1).choices


def test_unknown_routes_and_methods_in_the_same_shape(shared):
    status, _, raw = request(shared.url, "GET", "/v1/embeddings")
    assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
    status, _, raw = request(shared.url, "GET", CHAT)
    assert status == 405 and "GET" in json.loads(raw)["error"]["message"]


class FailingEngine(RelayEngine):
    """A real engine that breaks on the prompts "explode" (before any token) and "explode
    later" (after the first token), like a bug in the engine would."""

    def submit(self, request, cancel=None):
        if request.messages and request.messages[-1]["content"] == "explode":
            raise RuntimeError("kernel\nexploded")
        return super().submit(request, cancel)

    def relay(self, request, event, cancel) -> None:
        content = request.messages[-1]["content"] if request.messages else ""
        if content == "explode later" and isinstance(event, TokenEvent) \
                and self._passed(request):
            raise RuntimeError("exploded mid-stream")

    def _passed(self, request) -> bool:
        """True from the second token of ``request`` on."""
        seen = self.__dict__.setdefault("_seen", {})
        seen[id(request)] = seen.get(id(request), 0) + 1
        return seen[id(request)] > 1


def test_an_internal_error_is_a_500_line_and_the_server_keeps_serving(folder):
    with running_server(lambda: FailingEngine(Engine.load(str(folder)))) as srv:
        with pytest.raises(openai.InternalServerError) as info:
            chat(srv, messages=[{"role": "user", "content": "explode"}])
        error = info.value.body
        assert info.value.status_code == 500 and error["type"] == "server_error"
        assert error["message"] == "internal error: RuntimeError: kernel exploded"
        stream = chat(srv, messages=[{"role": "user", "content": "explode later"}],
                      max_tokens=5, stream=True, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="exploded mid-stream"):
            list(stream)
        assert chat(srv).choices[0].finish_reason in ("stop", "length")
        wait_until(lambda: ended(srv) == dict(waiting=0, running=False, completed=1,
                                               cancelled=0, rejected=0, failed=2),
                   "two failures and one reply are counted")


# -- cancellation and the queue ---------------------------------------------------------------
def test_a_client_that_leaves_mid_stream_cancels_its_generation(folder):
    with running_server(loader(folder, gated=True, allowance=1)) as srv:
        gate: GatedEngine = srv.engine
        with chat(srv, max_tokens=200, stream=True, extra_body={"ignore_eos": True}) as stream:
            first = next(iter(stream))
            assert first.choices[0].delta.role == "assistant"
            wait_until(gate.held, "the second token waits at the gate")
        # leaving the block closed the connection with the generation held mid-stream
        wait_until(lambda: srv.queue()["cancelled"] == 1, "the server cancels the generation")
        assert gate.done[-1].finish_reason == "cancelled"
        assert gate.done[-1].generated_tokens < 200
        gate.open()
        assert chat(srv).choices[0].finish_reason in ("stop", "length")
        wait_until(lambda: ended(srv) == dict(waiting=0, running=False, completed=1,
                                               cancelled=1, rejected=0, failed=0),
                   "one cancelled and one reply are counted")


def test_a_client_that_leaves_while_queued_is_never_started(gated):
    gate: GatedEngine = gated.engine
    holder = threading.Thread(target=chat, args=(gated,))
    holder.start()
    wait_until(gate.held, "the first request holds the engine")
    conn = connection(gated.url)  # a second, non-streaming request that waits in the queue
    queued = body(model=gated.model, messages=[{"role": "user", "content": "queued"}])
    conn.request("POST", CHAT, body=json.dumps(queued),
                 headers={"Content-Type": "application/json"})
    wait_until(lambda: gated.queue()["waiting"] == 1, "the second request is queued")
    conn.close()  # ... and its client leaves before the engine gets to it
    wait_until(lambda: gated.queue()["waiting"] == 0, "the queued job is cancelled")
    assert gate.held()  # still behind the first request
    gate.open()
    holder.join()
    wait_until(lambda: gated.queue()["cancelled"] == 1, "the skipped job is counted")
    assert [r.messages[-1]["content"] for r in gate.requests] == ["hello there"]
    wait_until(lambda: gated.queue()["completed"] == 1, "the first one is counted")


def test_concurrent_clients_are_all_served_one_at_a_time_in_order(gated):
    gate: GatedEngine = gated.engine
    replies: dict[int, object] = {}

    def ask(i: int) -> None:
        replies[i] = chat(gated, messages=[{"role": "user", "content": f"client {i}"}],
                          max_tokens=3, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    threads[0].start()
    wait_until(gate.held, "client 0 holds the engine")
    for i in range(1, 4):  # each one queued before the next, so the order is known
        threads[i].start()
        wait_until(lambda: gated.queue()["waiting"] == i, f"client {i} waits in the queue")
    gate.open()
    for thread in threads:
        thread.join()
    assert [r.messages[-1]["content"] for r in gate.requests] == [f"client {i}"
                                                                   for i in range(4)]
    assert gate.most_active == 1
    assert all(replies[i].usage.completion_tokens == 3 for i in range(4))
    # counted once the engine finished the job (after the reply: new states go to disk)
    wait_until(lambda: gated.queue()["completed"] == 4, "all four are counted")


def test_shutdown_ends_an_open_stream_with_an_error_event(folder):
    with running_server(loader(folder, gated=True, allowance=1)) as srv:
        gate: GatedEngine = srv.engine
        stream = chat(srv, max_tokens=50, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        wait_until(gate.held, "the stream is held mid-way")
        srv.server.stop()
        with pytest.raises(openai.APIError, match="shutting down"):
            list(chunks)
    assert gate.done[-1].finish_reason == "cancelled"


# -- the API key ------------------------------------------------------------------------------
def test_with_a_key_requests_without_it_get_401(folder):
    with running_server(loader(folder), api_key="sesame") as srv:
        for wrong in ("none", "sesame2"):
            with pytest.raises(openai.AuthenticationError) as info:
                srv.client(api_key=wrong).models.list()
            assert info.value.body["code"] == "invalid_api_key"
        status, headers, _ = send(srv, "POST", CHAT, body())
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert chat_with_key(srv, "sesame").choices[0].finish_reason in ("stop", "length")
        assert get_json(srv.url, "/health")["status"] == "ok"  # liveness needs no key


def chat_with_key(srv, key: str):
    return srv.client(api_key=key).chat.completions.create(model=srv.model, messages=HELLO,
                                                           max_tokens=2)


def test_a_body_is_not_read_without_the_key(folder):
    with running_server(loader(folder), api_key="sesame", max_body_bytes=16) as srv:
        status, _, raw = send(srv, "POST", CHAT, body())  # over the limit, no key
        assert status == 401, raw
        conn = connection(srv.url)
        try:
            conn.request("POST", CHAT, body=json.dumps(body(model=srv.model)),
                         headers={"Authorization": "Bearer sesame"})
            assert conn.getresponse().status == 413
        finally:
            conn.close()

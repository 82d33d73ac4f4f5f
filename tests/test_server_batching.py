"""`arbor serve` with many clients at once: their requests generate together (continuous
batching), every completed reply equals the reply the request gets alone, clients that leave
mid-stream or while queued end only their own request, `/health` shows the batch, and many
requests in batches leave the engine's memory where it was.

The server's engine runs forwards of at most 16 tokens (row-invariant), so a reply does not
depend on which prefix-cache state it resumed from: the solo reference is a fresh engine.
"""

from __future__ import annotations

import json
import queue
import threading

import pytest

from backend.api import DoneEvent, GenerateRequest
from backend.engine import Engine
from backend.memory.budgets import CacheBudgets, CacheConfig
from tests.fixtures.server import WAIT_S, connection, get_json, running_server, wait_until

EXACT_CHUNK = 16
SYSTEM = "You answer in one short line. " * 3


def messages(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def solo(folder):
    engine = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                         prefill_chunk=EXACT_CHUNK)
    made: dict[tuple, str] = {}

    def reply(i: int, max_tokens: int, seed: int | None) -> str:
        key = (i, max_tokens, seed)
        if key not in made:
            from backend.api import SamplingParams

            sampling = SamplingParams() if seed is None else SamplingParams(
                temperature=0.8, seed=seed)
            request = GenerateRequest(messages=messages(i), max_tokens=max_tokens,
                                      sampling=sampling, ignore_eos=True)
            made[key] = next(e for e in engine.generate(request)
                             if isinstance(e, DoneEvent)).text
        return made[key]
    return reply


def batching_server(folder, max_batch: int = 8, cache: CacheConfig | None = None):
    cache = cache or CacheConfig.memory_only()
    return running_server(lambda: Engine.load(str(folder), cache=cache,
                                              prefill_chunk=EXACT_CHUNK, max_batch=max_batch))


def test_sixteen_clients_get_their_solo_replies(folder, solo):
    with batching_server(folder) as srv:
        client = srv.client()
        results: dict[int, str] = {}
        errors: list[BaseException] = []
        left_mid_stream = threading.Event()

        def ask(i: int) -> None:
            seed = None if i % 2 else 1000 + i
            options = dict(model=srv.model, messages=messages(i), max_tokens=12,
                           temperature=0 if seed is None else 0.8, seed=seed,
                           extra_body={"ignore_eos": True})
            try:
                if i == 5:  # leaves after two chunks
                    with client.chat.completions.create(stream=True, **options) as stream:
                        for n, _ in enumerate(stream):
                            if n == 2:
                                break
                    left_mid_stream.set()
                    return
                if i % 3 == 0:
                    text = "".join(c.choices[0].delta.content or "" for c in
                                   client.chat.completions.create(stream=True, **options)
                                   if c.choices)
                else:
                    text = client.chat.completions.create(**options).choices[0].message.content
                results[i] = text
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not errors, errors
        assert left_mid_stream.is_set()
        for i, text in results.items():
            seed = None if i % 2 else 1000 + i
            assert text == solo(i, 12, seed), f"client {i}"
        assert len(results) == 15
        wait_until(lambda: srv.queue()["cancelled"] == 1, "the client that left is counted")
        health = get_json(srv.url, "/health")["queue"]
        assert health["active"] == 0 and health["waiting"] == 0
        assert health["completed"] == 15


def test_health_shows_the_batch_and_a_queued_client_that_leaves(folder, solo):
    """With room for two, the third waits; it leaves before its turn and only it ends."""
    with batching_server(folder, max_batch=2) as srv:
        seen_active = []
        streams = []
        for i in range(2):  # long replies hold their places in the batch
            conn = connection(srv.url)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(
                model=srv.model, messages=messages(i), max_tokens=400, stream=True,
                ignore_eos=True)), headers={"Content-Type": "application/json"})
            streams.append(conn)
        wait_until(lambda: srv.queue()["active"] == 2, "two requests generate together")
        seen_active.append(srv.queue()["active"])
        waiter = connection(srv.url)
        waiter.request("POST", "/v1/chat/completions", body=json.dumps(dict(
            model=srv.model, messages=messages(7), max_tokens=4)),
            headers={"Content-Type": "application/json"})
        wait_until(lambda: srv.queue()["waiting"] == 1, "the third waits for a place")
        waiter.close()  # ... and leaves
        wait_until(lambda: srv.queue()["waiting"] == 0, "the queued request is dropped")
        for conn in streams:
            conn.close()  # the two long ones leave too
        wait_until(lambda: srv.queue()["active"] == 0, "the batch empties")
        reply = srv.client().chat.completions.create(model=srv.model, messages=messages(3),
                                                     max_tokens=6, temperature=0,
                                                     extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == solo(3, 6, None)  # still serving
        assert srv.queue()["cancelled"] == 3


def test_many_requests_in_batches_keep_memory_flat(folder):
    """1,000 short requests, sixteen at a time: the engine's active MLX memory after them is
    what it was after the first hundred (lanes and their caches are reused, the prefix cache
    keeps to its budget, nothing leaks)."""
    budget = CacheBudgets(device_bytes=256 << 10, host_bytes=0, disk_bytes=0)
    with batching_server(folder, cache=CacheConfig(budget, None)) as srv:
        client = srv.client()

        def active_memory() -> int:
            got: queue.Queue = queue.Queue()
            srv.engine_thread.call(lambda engine: __import__("mlx.core").core
                                   .get_active_memory(), got.put)
            return got.get(timeout=WAIT_S)

        def batch(start: int) -> None:
            threads = [threading.Thread(target=lambda i=i: client.completions.create(
                model=srv.model, prompt=f"request {i} " * (1 + i % 5), max_tokens=2,
                temperature=0)) for i in range(start, start + 16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT_S)

        for start in range(0, 112, 16):
            batch(start)
        before = active_memory()
        for start in range(112, 1000, 16):
            batch(start)
        after = active_memory()
        assert srv.queue()["completed"] >= 1000 - 8
        assert after <= before + (256 << 10), (before, after)


def test_a_disconnected_stream_ends_only_its_request(folder, solo):
    with batching_server(folder) as srv:
        results = {}

        def ask(i):
            results[i] = srv.client().chat.completions.create(
                model=srv.model, messages=messages(i), max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].message.content

        keeper = threading.Thread(target=ask, args=(1,))
        conn = connection(srv.url)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(
            model=srv.model, messages=messages(2), max_tokens=300, stream=True,
            ignore_eos=True)), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        keeper.start()
        response.read(64)  # a few chunks in
        conn.close()
        keeper.join(WAIT_S)
        assert results[1] == solo(1, 30, None)
        wait_until(lambda: srv.queue()["cancelled"] == 1, "the stream that left is cancelled")



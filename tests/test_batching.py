"""Continuous batching: every reply equals, bit for bit (token ids and log-probabilities), the
reply the same request gets alone, whatever else shares its steps: how many rows, arrivals,
cancellations, drafts, sampling with seeds, stop strings, restored prefixes.

Real tiny models of each cache kind. Forwards of at most 16 tokens (``prefill_chunk=16``) are
row-invariant, so a reply does not depend on which prefix-cache state it resumed from either:
the solo reference is a fresh engine that stores nothing.
"""

from __future__ import annotations

import random
import threading

import pytest

from backend.api import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from backend.engine import Engine
from backend.errors import InvalidRequestError
from backend.memory.budgets import CacheBudgets, CacheConfig

KINDS = ("llama", "gemma3", "qwen3_next", "qwen3_moe", "qwen3_5", "gemma4", "glm4_moe_lite")
EXACT_CHUNK = 16
SYSTEM = list(range(40, 70))


def requests_for(vocab: int, seed: int) -> list[GenerateRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(7):
        prompt = (SYSTEM if i % 2 else []) + [rng.randrange(3, vocab - 1)
                                            for _ in range(rng.randrange(2, 40))]
        sampling = (SamplingParams() if i % 3 == 0 else
                    SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i))
        out.append(GenerateRequest(prompt_ids=prompt, max_tokens=rng.randrange(3, 14),
                                   sampling=sampling, logprobs=True,
                                   draft=("lookup", "none")[i % 2], ignore_eos=i % 4 == 0))
    return out


def events_reply(events) -> tuple[list[int], list[float], str]:
    ids = [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]
    lps = [e.logprob for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]
    done = [e for e in events if isinstance(e, DoneEvent)]
    return ids, lps, done[0].finish_reason if done else ""


def solo_replies(folder, requests, prefill_chunk: int = EXACT_CHUNK) -> list[tuple]:
    engine = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                         prefill_chunk=prefill_chunk)
    return [events_reply(list(engine.generate(r))) for r in requests]


@pytest.mark.parametrize("kind", KINDS)
def test_replies_in_a_batch_equal_their_solo_replies(kind, tiny_model_dir):
    folder = tiny_model_dir(kind)
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK,
                         max_batch=4)
    requests = requests_for(engine.model.args.vocab_size, seed=1)
    expected = solo_replies(folder, requests)
    cancels = {3: threading.Event()}
    streams, events, arrival = {}, {}, [0, 0, 0, 2, 5, 5, 9]  # step at which each arrives
    step = 0
    most_running = 0
    while len(streams) < len(requests) or engine.scheduler.busy:
        for i, at in enumerate(arrival):
            if at == step:
                streams[i] = engine.submit(requests[i], cancels.get(i))
                events[i] = []
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
        for i, stream in streams.items():
            while stream.events:
                events[i].append(stream.events.popleft())
            assert stream.error is None, stream.error
        if len([e for e in events.get(3, []) if isinstance(e, TokenEvent)]) == 2:
            cancels[3].set()  # leaves in the middle; the others go on
        step += 1
    assert most_running == 4, "the batch never filled"
    for i, (ids, lps, finish) in enumerate(events_reply(events[i]) for i in range(len(requests))):
        want_ids, want_lps, want_finish = expected[i]
        if i == 3:
            assert finish == "cancelled" and ids == want_ids[:len(ids)], i
            continue
        assert (ids, lps, finish) == (want_ids, want_lps, want_finish), f"request {i}"
    engine.prefix.check_invariants()
    assert not engine.prefix.running


def test_requests_submitted_from_other_threads_run_on_the_stepping_one(tiny_model_dir):
    """MLX's streams belong to a thread: any thread may submit, one thread steps; another
    thread that tries to step is told which one runs the engine."""
    folder = tiny_model_dir("llama")
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK,
                         max_batch=2)
    requests = requests_for(engine.model.args.vocab_size, seed=2)[:2]
    expected = solo_replies(folder, requests)
    submitted, refused = {}, []

    def submit_and_try_to_step():
        submitted[1] = engine.submit(requests[1])
        try:
            engine.step()
        except InvalidRequestError as exc:
            refused.append(str(exc))

    first = engine.generate(requests[0])
    events = [next(first)]  # this thread steps from now on
    worker = threading.Thread(target=submit_and_try_to_step, name="other")
    worker.start()
    worker.join(60)
    events += list(first)
    assert events_reply(events) == expected[0]
    assert refused and "MainThread" in refused[0]
    other = []
    while engine.step() or submitted[1].events:
        while submitted[1].events:
            other.append(submitted[1].events.popleft())
    assert events_reply(other) == expected[1]


def test_a_caller_that_stops_reading_ends_only_its_request(tiny_model_dir):
    folder = tiny_model_dir("llama")
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK,
                         max_batch=2)
    requests = requests_for(engine.model.args.vocab_size, seed=3)[:2]
    expected = solo_replies(folder, requests)
    other = engine.submit(requests[1])
    first = engine.generate(requests[0])
    next(first)
    first.close()  # the caller left after one token
    events = []
    while engine.step() or other.events:
        while other.events:
            events.append(other.events.popleft())
    assert events_reply(events) == expected[1]
    assert not engine.prefix.running


@pytest.mark.parametrize("room_for", [1, 2])
def test_a_request_waits_while_its_caches_would_not_fit_beside_the_running_ones(
        room_for, tiny_model_dir):
    """Admission counts memory: each running request reserves the live-cache bytes its prompt
    and max_tokens can grow to; one that would take the device budget past that waits in the
    queue (it neither fails nor evicts a live path) and runs when room is made."""
    folder = tiny_model_dir("llama")
    requests = [GenerateRequest(prompt_ids=list(range(10 + i, 30 + i)), max_tokens=6,
                                ignore_eos=True) for i in range(3)]
    expected = solo_replies(folder, requests)
    probe = Engine.load(str(folder), cache=CacheConfig.memory_only(), max_batch=3)
    reserve = probe.bytes_per_token * (20 + 6)
    budget = CacheBudgets(reserve * room_for + reserve // 2, 1 << 30, 0)
    engine = Engine.load(str(folder), cache=CacheConfig(budget, None), max_batch=3)
    streams = [engine.submit(r) for r in requests]
    events: list[list] = [[] for _ in requests]
    most_running = 0
    while engine.step():
        most_running = max(most_running, len(engine.scheduler.running))
        for stream, out in zip(streams, events):
            while stream.events:
                out.append(stream.events.popleft())
    for stream, out in zip(streams, events):
        out.extend(stream.events)
        assert stream.error is None
    assert most_running == room_for
    assert [events_reply(e) for e in events] == expected


def test_a_queued_request_has_its_stored_prefix_read_from_disk_while_it_waits(
        tiny_model_dir, tmp_path):
    """A request waiting for a place in the batch gets the files of its stored prefix read on
    the read-ahead thread while the running request decodes; its restore takes those reads, and
    its reply is the same as without them."""
    folder = str(tiny_model_dir("llama"))
    stored = GenerateRequest(prompt_ids=list(range(10, 70)), max_tokens=3, ignore_eos=True)
    resumed = GenerateRequest(prompt_ids=list(range(10, 70)) + [5, 6, 7], max_tokens=5,
                              ignore_eos=True, logprobs=True)
    running = GenerateRequest(prompt_ids=[3, 4, 5], max_tokens=12, ignore_eos=True)
    on_disk = CacheConfig(CacheBudgets(0, 0, 64 << 20), tmp_path / "cache", capture_interval=16)
    first = Engine.load(folder, cache=on_disk, prefill_chunk=EXACT_CHUNK)
    list(first.generate(stored))
    first.close()

    engine = Engine.load(folder, cache=on_disk, prefill_chunk=EXACT_CHUNK, max_batch=1)
    busy, queued = engine.submit(running), engine.submit(resumed)
    engine.step()  # the first request runs, the second waits ...
    assert queued.waiting and engine.prefix.read_ahead.started > 0  # ... its files being read
    replies: list = []
    while engine.step():
        busy.events.clear()
        while queued.events:
            replies.append(queued.events.popleft())
    replies += queued.events
    assert engine.prefix.read_ahead.taken > 0
    done = [e for e in replies if isinstance(e, DoneEvent)][0]
    assert done.cached_by_tier["disk"] > 0

    cold = Engine.load(folder, cache=on_disk, prefill_chunk=EXACT_CHUNK)
    assert events_reply(replies) == events_reply(list(cold.generate(resumed)))


@pytest.mark.parametrize("exact", [True, False])
def test_a_long_prompt_arriving_mid_stream_is_fed_between_the_others_tokens(
        exact, tiny_model_dir, monkeypatch):
    """With exact prefill (chunks of at most ``MAX_KERNEL_ROWS``, cut anywhere without changing
    a bit) a long prompt that arrives while two replies stream is fed a few rows per step
    (``scheduler.STEP_ROWS`` minus the decoding rows), so the two get a token every step; every
    reply still equals its solo reply. Without exact prefill its cut depends on the request
    alone: one whole chunk, and the two wait for it."""
    from backend import kernels, scheduler

    folder = tiny_model_dir("llama")
    chunk = kernels.MAX_KERNEL_ROWS if exact else 2048
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only(), prefill_chunk=chunk,
                         max_batch=3)
    vocab = engine.model.args.vocab_size
    short = [GenerateRequest(prompt_ids=[5 + i, 9, 11], max_tokens=40, ignore_eos=True,
                             logprobs=True, draft="none") for i in range(2)]
    long = GenerateRequest(prompt_ids=[3 + (7 * t) % (vocab - 4) for t in range(150)],
                           max_tokens=3, ignore_eos=True, logprobs=True, draft="none")
    expected = solo_replies(folder, short + [long], chunk)
    fed: list[list[int]] = []
    answer = engine.scheduler.answer
    monkeypatch.setattr(engine.scheduler, "answer",
                        lambda feeds: fed[-1].extend(f.rows for f in feeds) or answer(feeds))
    streams = [engine.submit(r) for r in short]
    events: list[list] = [[], [], []]
    tokens_per_step = []  # (tokens of the two short replies, whether the long one prefills)
    while engine.scheduler.busy or len(streams) < 3:
        if len(streams) < 3 and len(events[0]) >= 3:
            streams.append(engine.submit(long))
        fed.append([])
        engine.step()
        got = []
        for i, stream in enumerate(streams):
            got.append(len(stream.events))
            events[i] += stream.events
            stream.events.clear()
        prefilling = len(streams) == 3 and not any(
            isinstance(e, TokenEvent) for e in events[2])
        tokens_per_step.append((got[0] + got[1], prefilling))
    for i in range(3):
        assert events_reply(events[i]) == expected[i], i
    long_chunks = [n for rows in fed for n in rows if n > 1]
    if exact:
        assert max(long_chunks) <= scheduler.STEP_ROWS - 2
        during = [n for n, prefilling in tokens_per_step if prefilling]
        assert len(during) > 5 and all(n == 2 for n in during[1:])  # a token each, every step
    else:
        assert 149 in long_chunks  # one whole chunk

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


def solo_replies(folder, requests) -> list[tuple]:
    engine = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                         prefill_chunk=EXACT_CHUNK)
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

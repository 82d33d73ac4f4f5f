"""Engine behaviour on a tiny real model: streaming, reuse, chunking, cancellation, limits."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

import backend.engine as engine_module
from backend.api import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from backend.engine import Engine
from backend.errors import ContextLengthError, InvalidRequestError
from backend.tokenizer import Tokenizer
from backend.weights.loading import load_model


def make_engine(folder) -> Engine:
    return Engine(load_model(folder), Tokenizer.from_folder(folder), folder.name)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture
def engine(folder):
    return make_engine(folder)


def naive_greedy(folder, prompt: list[int], n: int) -> list[int]:
    """Recompute the whole sequence from scratch for every token (no cache reuse at all)."""
    model = load_model(folder).model
    seq = list(prompt)
    for _ in range(n):
        logits = model(mx.array(seq)[None], model.make_caches())
        seq.append(int(mx.argmax(logits[0, -1]).item()))
    return seq[len(prompt):]


def run(engine: Engine, request: GenerateRequest, cancel=None):
    events = list(engine.generate(request, cancel))
    assert isinstance(events[-1], DoneEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 61, 120, 33, 9]


def test_greedy_matches_naive_recompute(engine, folder):
    tokens, done = run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=12,
                                               ignore_eos=True))
    assert done.token_ids == naive_greedy(folder, PROMPT, 12)
    assert [t.token_id for t in tokens if t.token_id >= 0] == done.token_ids
    assert "".join(t.text for t in tokens) == done.text
    assert done.finish_reason == "length" and done.generated_tokens == 12
    assert done.prompt_tokens == len(PROMPT) and done.cached_tokens == 0


def test_chunked_prefill_gives_same_tokens(engine, folder, monkeypatch):
    expected = naive_greedy(folder, PROMPT, 6)
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 5)
    _, done = run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=6, ignore_eos=True))
    assert done.token_ids == expected


def test_second_request_reuses_common_prefix(engine, folder):
    run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=4, ignore_eos=True))
    branch = PROMPT[:8] + [11, 12, 13]
    _, done = run(engine, GenerateRequest(prompt_ids=branch, max_tokens=8, ignore_eos=True))
    assert done.cached_tokens == 8
    assert done.token_ids == naive_greedy(folder, branch, 8)
    # The same prompt again: everything but the last prompt token comes from the cache.
    _, again = run(engine, GenerateRequest(prompt_ids=branch, max_tokens=8, ignore_eos=True))
    assert again.cached_tokens == len(branch) - 1 and again.token_ids == done.token_ids


def test_seeded_sampling_is_reproducible(engine):
    req = GenerateRequest(prompt_ids=PROMPT, max_tokens=10, ignore_eos=True,
                          sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7))
    _, a = run(engine, req)
    _, b = run(engine, req)
    assert a.token_ids == b.token_ids


def test_cancel_stops_decode(engine):
    cancel = threading.Event()
    seen = []
    for event in engine.generate(GenerateRequest(prompt_ids=PROMPT, max_tokens=50,
                                                 ignore_eos=True), cancel):
        seen.append(event)
        if len(seen) == 3:
            cancel.set()
    done = seen[-1]
    assert done.finish_reason == "cancelled" and done.generated_tokens == 3


def test_cancel_before_prefill_generates_nothing(engine):
    cancel = threading.Event()
    cancel.set()
    _, done = run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=5), cancel)
    assert done.finish_reason == "cancelled" and done.token_ids == []


def test_eos_stops_with_reason_stop(engine):
    free = run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=6, ignore_eos=True))[1]
    eos_at = free.token_ids[2]
    engine.tokenizer.eos_token_ids = frozenset({eos_at})
    _, done = run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=6))
    first = free.token_ids.index(eos_at)
    assert done.finish_reason == "stop" and done.token_ids == free.token_ids[:first + 1]


def test_stop_string_cuts_text(engine):
    _, free = run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=16, ignore_eos=True))
    text = free.text
    cut = next(i for i in range(3, len(text)) if text[i].strip())
    stop = text[cut:cut + 2]
    _, done = run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=16, ignore_eos=True,
                                          stop=(stop,)))
    assert done.finish_reason == "stop"
    assert done.text == text[:text.index(stop)]


def test_chat_messages_use_template(engine):
    msgs = [{"role": "user", "content": "Hello there"}]
    _, done = run(engine, GenerateRequest(messages=msgs, max_tokens=3))
    assert done.prompt_tokens == len(engine.tokenizer.apply_chat_template(msgs))


def test_prompt_longer_than_context_is_a_clear_error(engine):
    too_long = [5] * engine.context_length
    with pytest.raises(ContextLengthError, match=str(engine.context_length)):
        list(engine.generate(GenerateRequest(prompt_ids=too_long)))


def test_output_is_clipped_to_the_context(engine):
    prompt = [5] * (engine.context_length - 3)
    _, done = run(engine, GenerateRequest(prompt_ids=prompt, max_tokens=50, ignore_eos=True))
    assert done.generated_tokens == 3 and done.finish_reason == "length"


@pytest.mark.parametrize("request_", [
    GenerateRequest(),
    GenerateRequest(prompt_ids=[1], messages=[{"role": "user", "content": "x"}]),
    GenerateRequest(prompt_ids=[10**9]),
    GenerateRequest(prompt_ids=[1], max_tokens=0),
    GenerateRequest(messages=[{"role": "user"}]),
    GenerateRequest(prompt_ids=[1], sampling=SamplingParams(temperature=-1)),
])
def test_malformed_requests_raise_invalid_request(engine, request_):
    with pytest.raises(InvalidRequestError):
        list(engine.generate(request_))
    # ...and the engine still works afterwards.
    assert run(engine, GenerateRequest(prompt_ids=PROMPT, max_tokens=2))[1].generated_tokens

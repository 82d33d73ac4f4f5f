"""A chat reply ends its turn: after the reply's text the engine feeds what the chat template
writes up to the next user's words (the reply's last token, ``<|im_end|>\\n<|im_start|>user\\n``
for ChatML), so a resumed conversation prefills only the new user message. On SmolLM2's real
weights and tokenizer, whose replies read back as the ids that were generated."""

from __future__ import annotations

import pytest

from backend.api import DoneEvent, GenerateRequest
from backend.engine import Engine
from backend.memory.budgets import CacheConfig

FIRST = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Name three colours of the rainbow."}]


def load(gguf) -> Engine:
    # Forwards of at most 16 tokens are row-invariant: replies compare bit for bit.
    return Engine.load(str(gguf), cache=CacheConfig.memory_only(), prefill_chunk=16)


@pytest.fixture(scope="module")
def engine(default_model_gguf):
    return load(default_model_gguf)


def turn(engine: Engine, messages: list[dict], n: int, **options) -> DoneEvent:
    request = GenerateRequest(messages=messages, max_tokens=n, logprobs=True, **options)
    *_, done = engine.generate(request)
    return done


def then(messages: list[dict], reply: str, words: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": reply},
                       {"role": "user", "content": words}]


def test_the_next_turn_prefills_only_the_users_words(engine, default_model_gguf):
    engine.clear_cache()
    tok = engine.tokenizer
    done = turn(engine, FIRST, 8)
    assert done.finish_reason == "length"
    tail = tok.turn_end_ids(FIRST, done.text)
    assert tail[:len(done.token_ids)] == done.token_ids
    assert tok.decode(tail[len(done.token_ids):]) == "<|im_end|>\n<|im_start|>user\n"
    second = then(FIRST, done.text, "And two more?")
    again = turn(engine, second, 8)
    assert again.cached_tokens == done.prompt_tokens + len(tail)
    assert tok.decode(tok.apply_chat_template(second)[again.cached_tokens:]) == \
        "And two more?<|im_end|>\n<|im_start|>assistant\n"
    # The fed turn end holds what a prefill of the whole second prompt would: same reply.
    fresh = turn(load(default_model_gguf), second, 8)
    assert fresh.cached_tokens == 0 and fresh.token_ids == again.token_ids



def test_a_draft_model_follows_the_turn_end(default_model_gguf):
    """The draft model lags the target after decoding: it catches up before the turn end is
    fed, so its caches hold the same ids as a fresh prefill's (the same drafts, accepted alike)."""
    def paired() -> Engine:
        return Engine.load(str(default_model_gguf), cache=CacheConfig.memory_only(),
                           prefill_chunk=16, draft=str(default_model_gguf), draft_depth=3)

    engine = paired()
    done = turn(engine, FIRST, 8, draft="model")
    second = then(FIRST, done.text, "And two more?")
    again = turn(engine, second, 12, draft="model")
    assert again.cached_tokens == done.prompt_tokens + len(
        engine.tokenizer.turn_end_ids(FIRST, done.text))
    assert engine.drafter.offset == engine.target_caches[0].offset
    fresh = turn(paired(), second, 12, draft="model")
    assert fresh.token_ids == again.token_ids
    assert (again.drafted_tokens, again.accepted_tokens) == \
        (fresh.drafted_tokens, fresh.accepted_tokens)

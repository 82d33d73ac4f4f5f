"""Exact prefill (``Engine.load(exact_prefill=True)``, ``--exact-prefill``): prompts prefill in
chunks the row-invariant kernels take whole, so a reply that resumes from a prefix another
request stored equals, bit for bit (token ids and log-probabilities, sampled with a seed), the
reply a cold engine gives the same request."""

from __future__ import annotations

import pytest

from backend.api import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from backend.engine import EXACT_PREFILL_CHUNK, PREFILL_CHUNK, Engine
from backend.memory.budgets import CacheBudgets, CacheConfig
from desktop.cli import _engine, build_parser

SYSTEM = "You are a terse assistant. Answer in one line, and never apologise for anything at all."


def chats() -> list[GenerateRequest]:
    users = ["Name three rivers.", "What is a prime number?", "Name three rivers in Europe.",
             "Why is the sky blue?", "What is a prime number? Give two."]
    return [GenerateRequest(messages=[{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": user}],
                            max_tokens=8, logprobs=True, ignore_eos=True,
                            sampling=SamplingParams(temperature=1.0, seed=11 + i))
            for i, user in enumerate(users)]


def reply(engine, request) -> tuple[list[int], list[float], int]:
    events = list(engine.generate(request))
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]
    done = [e for e in events if isinstance(e, DoneEvent)][0]
    return [t.token_id for t in tokens], [t.logprob for t in tokens], done.cached_tokens


@pytest.mark.parametrize("kind", ["llama", "mistral-window", "qwen3", "gemma3", "qwen3_next",
                                  "qwen3_moe", "qwen3_5_moe-4bit", "gemma4-moe",
                                  "glm4_moe_lite-4bit"])
def test_a_reply_from_a_cached_prefix_equals_a_cold_start(kind, tiny_model_dir):
    folder = str(tiny_model_dir(kind))
    warm = Engine.load(folder, cache=CacheConfig.memory_only(), exact_prefill=True)
    cold_cache = CacheConfig(CacheBudgets(0, 0, 0), None)
    reused = 0
    for request in chats():
        ids, logprobs, cached = reply(warm, request)
        cold = Engine.load(folder, cache=cold_cache, exact_prefill=True)
        cold_ids, cold_logprobs, cold_cached = reply(cold, request)
        assert cold_cached == 0
        assert (ids, logprobs) == (cold_ids, cold_logprobs)
        reused += cached
    assert reused > 0  # later requests resumed from the shared system prompt


def test_the_command_line_asks_for_exact_prefill(tiny_model_dir):
    """On by default for a float32 model (its products run on panels: exact costs nothing),
    off for a quantized one; either way the flags decide."""
    cases = ((["--no-exact-prefill"], "llama", PREFILL_CHUNK), ([], "llama", EXACT_PREFILL_CHUNK),
             ([], "qwen3_5-4bit", PREFILL_CHUNK),
             (["--exact-prefill"], "qwen3_5-4bit", EXACT_PREFILL_CHUNK))
    for flags, kind, chunk in cases:
        args = build_parser().parse_args(["generate", "--model", str(tiny_model_dir(kind)),
                                          *flags, "--prompt", "hi"])
        engine = _engine(args)
        assert engine.chunk_size == chunk, (flags, kind)
        assert engine.exact_prefill == (chunk != PREFILL_CHUNK)

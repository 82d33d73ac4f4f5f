"""Qwen3.5 / Qwen3.6 drafting with the MTP head their checkpoints ship (dense and MoE).

The tiny checkpoints (``tiny_model_dir("qwen3_5")``, ``("qwen3_5_moe")``: Hugging Face layout, a
one-layer head, the MoE head's experts one tensor each) get their head fitted with mlx-vlm's own
``Qwen3_5MTPDraftModel`` to the target's greedy choices on ``FIT_PROMPT``
(tests/fixtures/fitted_drafters.py), so on that prompt whole blocks, partial blocks and
rejections all happen, and on other prompts nearly every draft is rejected.

1. Same inputs, same drafts: given the same target hidden states and tokens, Arbor's head drafts
   the reference's greedy tokens, and its per-step distributions equal the reference's within
   ``REFERENCE_TOLERANCE`` (log-probabilities, float32; the two place the same pairs one RoPE
   position apart, which only rounds differently).
2. Greedy identity: speculative replies equal plain replies token for token and in
   log-probabilities at draft depths 1..8, fresh and resumed from each prefix-cache tier (the
   live caches, device, host, disk after a restart).
3. Rollback: after replies with accepted and rejected rounds, every cache (the target's
   recurrent and attention layers, the head's, the carried hidden state) equals a fresh
   prefill's of the same ids.
"""

from __future__ import annotations

import random
from typing import Callable

import mlx.core as mx
import numpy as np
import pytest

from backend.api import SamplingParams
from backend.caches.recurrent import RecurrentCache
from backend.caches.rotating import RotatingKVCache
from backend.engine import Engine
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.sampling import Sampler
from backend.speculation.mtp import MTPDrafter
from backend.weights.loading import load_model
from tests.fixtures.fitted_drafters import (FIT_PROMPT, fitted_mtp_checkpoint, greedy_path,
                                            reference_mtp)
from tests.test_speculative import reply

FAMILIES = ("qwen3_5", "qwen3_5_moe")
#: Log-probabilities of Arbor's head against the reference's, float32.
REFERENCE_TOLERANCE = 1e-4
EXACT_CHUNK = 16  # row-invariant forwards (tests/test_row_invariance.py)
MIB = 1 << 20
OTHER_PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def fitted(tiny_model_dir, tmp_path_factory):
    made = {}

    def make(family: str):
        if family not in made:
            made[family] = fitted_mtp_checkpoint(
                tiny_model_dir(family), tmp_path_factory.mktemp(f"{family}-fitted") / "model",
                steps=20)
        return made[family]

    return make


def cache_contents(cache) -> list[np.ndarray]:
    """What a cache holds for its positions: keys and values up to the offset, those of the
    window in logical order (whatever the ring's layout; where the window starts too), or the
    recurrent (conv, delta) state."""
    if isinstance(cache, RecurrentCache):
        return [np.array(a) for a in cache.arrays()]
    if isinstance(cache, RotatingKVCache):
        window = cache.visible_keys(cache.offset - 1)
        return [np.array(window.key_start), np.array(window.keys), np.array(window.values)]
    return [np.array(cache.keys[..., :cache.offset, :]),
            np.array(cache.values[..., :cache.offset, :])]


# -- 1. against the reference -------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_the_head_drafts_what_the_reference_drafts(family, fitted):
    """For contexts along the fitted path (where the head agrees with the target) and off it:
    the reference is given the target's hidden states over the context and the target's next
    token c (``prefill_from_target_hidden``), then drafts a block (``draft_block``); Arbor's
    drafter observes the same hidden states and proposes after ``context + [c]``."""
    folder = fitted(family)
    model = load_model(folder, dtype="float32", cpu_kernels=False).model
    path, _ = greedy_path(folder, FIT_PROMPT, 24)
    contexts = [FIT_PROMPT + path[:k] for k in (0, 5, 13)] + [OTHER_PROMPT, [9, 4]]
    depth, worst = 6, 0.0
    for context in contexts:
        hidden = model.hidden(mx.array([context]), model.make_caches())
        c = int(mx.argmax(model.logits(hidden[:, -1:])[0, -1]))
        ids = mx.array([context])

        # Greedy tokens.
        reference = reference_mtp(folder)
        reference.prefill_from_target_hidden(ids, hidden, c, None, greedy=True)
        want = reference.draft_block(c, hidden[:, -1:], None, depth + 1, None,
                                     greedy=True)[0].tolist()
        drafter = MTPDrafter(model)
        drafter.observe(0, ids[0], hidden)
        greedy = Sampler(SamplingParams(temperature=0.0))
        got = drafter.propose(context + [c], depth, greedy, lambda drafts: None)
        assert got.tokens.tolist() == want, f"context of {len(context)}"

        # Distributions, along tokens sampled by Arbor's drafter (the reference's sampler
        # replays them and records the logits it was given).
        sampler = Sampler(SamplingParams(temperature=1.0, seed=len(context)))
        drafter = MTPDrafter(model)
        drafter.observe(0, ids[0], hidden)
        draft = drafter.propose(context + [c], depth, sampler, lambda drafts: None)
        drawn, seen = iter(draft.tokens.tolist()), []

        def replay(logits: mx.array) -> mx.array:
            seen.append(logits.reshape(-1))
            return mx.array([[next(drawn)]])

        reference = reference_mtp(folder)
        reference.prefill_from_target_hidden(ids, hidden, c, replay)
        reference.draft_block(c, hidden[:, -1:], None, depth + 1, replay)
        assert len(seen) == depth
        for step, logits in enumerate(seen):
            expect = np.array(logits - mx.logsumexp(logits))
            diff = np.abs(np.array(draft.logprobs[step]) - expect).max()
            worst = max(worst, float(diff))
            assert diff < REFERENCE_TOLERANCE, f"context of {len(context)}, step {step}"
    print(f"{family}: worst log-probability difference {worst:.2e}")


# -- 2. greedy identity -------------------------------------------------------------------------

def block_outcomes(flags: list[bool], rounds: int, depth: int) -> set[str]:
    """Which round outcomes a reply at a fixed ``depth`` saw: runs of drafted tokens are the
    accepted part of each round (the token after a run is the target's own)."""
    runs, run = [], 0
    for flag in flags + [False]:
        if flag:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    seen = {"whole" if r == depth else "partial" for r in runs}
    if rounds > len(runs):
        seen.add("none")
    return seen


def resumed(load: Callable[[CacheConfig], Engine], tier: str, tmp_path,
            prompt: list[int]) -> Engine:
    """An engine (``load(cache config)``) whose next reply resumes the turn ``prompt`` from
    ``tier``: that first turn, then (device, host) another conversation taking the live caches
    or (disk) a restart."""
    budgets = {"device": CacheBudgets(64 * MIB, 0, 0), "host": CacheBudgets(0, 64 * MIB, 0),
               "disk": CacheBudgets(0, 0, 64 * MIB)}
    config = CacheConfig.memory_only() if tier == "live" else CacheConfig(
        budgets[tier], tmp_path / tier if tier == "disk" else None)
    engine = load(config)
    reply(engine, prompt, n=10)
    if tier in ("device", "host"):
        reply(engine, OTHER_PROMPT, n=3)
    elif tier == "disk":
        engine.close()
        engine = load(config)
    return engine


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_replies_equal_plain_ones_from_every_tier(family, fitted, tmp_path):
    folder = fitted(family)
    plain = Engine.load(str(folder), cache=CacheConfig.memory_only(), speculation="none")
    expected = {}

    def want(prompt, n):
        key = (tuple(prompt), n)
        if key not in expected:
            expected[key] = reply(plain, prompt, n=n)[:2]
        return expected[key]

    outcomes: set[str] = set()
    for depth in range(1, 9):
        engine = Engine.load(str(folder), cache=CacheConfig.memory_only(), draft_depth=depth)
        for prompt in (FIT_PROMPT, OTHER_PROMPT):
            ids, logprobs, done, flags = reply(engine, prompt, n=32)
            assert (ids, logprobs) == want(prompt, 32), f"depth {depth}"
            assert done.drafter == "mtp" and sum(flags) == done.accepted_tokens
            outcomes |= block_outcomes(flags, done.draft_rounds, depth)
        engine.close()
    assert outcomes == {"whole", "partial", "none"}, outcomes
    resumed_replies_equal_plain(
        lambda config, depth: Engine.load(str(folder), cache=config, draft_depth=depth),
        (1, 3, 8), "mtp", want, tmp_path)


def resumed_replies_equal_plain(load: Callable[[CacheConfig, int], Engine],
                                depths: tuple[int, ...], kind: str,
                                want: Callable[[list[int], int], tuple], tmp_path) -> None:
    """From each tier and at each depth (``load(cache config, depth)``), the next turn after
    ``FIT_PROMPT`` drafts with ``kind``, accepts drafts and equals ``want`` (plain decoding's
    reply). The turn stays on the fitted path (the first reply and two more of the target's own
    tokens), so the restored drafter drafts what the target then says."""
    follow = FIT_PROMPT + want(FIT_PROMPT, 32)[0][:12]
    for tier in ("live", "device", "host", "disk"):
        for depth in depths:
            engine = resumed(lambda config: load(config, depth), tier, tmp_path / f"{depth}",
                             FIT_PROMPT)
            ids, logprobs, done, _ = reply(engine, follow, n=16)
            assert done.cached_by_tier.get(tier, 0) > 0, (tier, done.cached_by_tier)
            assert done.accepted_tokens > 0 and done.drafter == kind
            assert (ids, logprobs) == want(follow, 16), f"{tier}, depth {depth}"
            engine.close()


# -- 3. rollback --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_rejected_rounds_leave_every_cache_as_a_fresh_prefill(family, fitted):
    """After two turns with accepted and rejected rounds, each of the engine's caches (the
    target's gated-delta and attention layers rolled back through the segmented scans, the
    head's layer, the carry) holds what one prefill of the same ids writes (row-invariant
    forwards: within 1e-5)."""
    folder = fitted(family)
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only(),
                         prefill_chunk=EXACT_CHUNK, draft_depth=4)
    ids, _, done, _ = reply(engine, FIT_PROMPT, n=30)
    assert 0 < done.accepted_tokens < done.drafted_tokens
    rng = random.Random(4)
    follow = FIT_PROMPT + ids + [rng.randrange(3, 200) for _ in range(3)]
    ids2, _, done, _ = reply(engine, follow, n=20)
    assert done.cached_tokens > len(FIT_PROMPT) and done.accepted_tokens < done.drafted_tokens
    held = list(engine.prefix.live)
    assert len(held) == len(follow) + len(ids2) - 1  # the last id is not fed
    fresh = Engine.load(str(folder), cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK)
    reply(fresh, held, n=1, draft="none")  # prefills exactly ``held``
    assert list(fresh.prefix.live) == held
    assert len(engine.caches) == len(fresh.caches) == len(engine.target_caches) + 2
    for i, (got, want) in enumerate(zip(engine.caches, fresh.caches, strict=True)):
        assert got.offset == want.offset == len(held), i
        for a, b in zip(cache_contents(got), cache_contents(want), strict=True):
            assert a.shape == b.shape, i
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"cache {i}")

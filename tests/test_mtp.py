"""The multi-token-prediction head: Qwen3-Next ``mtp.*`` weights, and drafting with them.

Tiny random checkpoints with a one-layer head (``TINY_CONFIGS["qwen3_next-mtp"]``; its main model
matches transformers and mlx-lm in tests/test_parity.py like every row). There is no reference
for the head's numerics (transformers ignores ``mtp.*``, mlx-lm strips it) and none is needed for
the reply, which verification makes the target's own; so these tests pin:

* the head: present exactly when the checkpoint ships it, its shapes, determinism, incremental
  == one pass, and its empty slot 0 invisible;
* the pairing: a draft comes from the head over (token p, target hidden at p - 1) of exactly the
  committed ids, whatever rounds, rollbacks and plain steps came before (against a from-scratch
  computation in the test);
* speculative greedy with the head == plain greedy, token for token and logprob for logprob, for
  draft lengths 1..8 and a prompt resumed from the prefix cache, with a random head (drafts
  rejected) and an *agreeing* head (drafts often accepted); stats say ``drafter == "mtp"``;
* rollback: after a reply with rejected rounds the head's caches equal a fresh prefill's; after
  a restart from the disk tier they equal those of an engine that never stopped.

The agreeing head (``agreeing_checkpoint``) is built by hand on the same tiny model: ``fc``
passes the hidden half through, the layer's output projections are zero (the layer is the
identity), norms scale by 1, and the target's ``lm_head`` scores only two tokens (+v and -v), so
the head predicts the current token again and the target often repeats it.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from backend import kernels
from backend.api import SamplingParams
from backend.engine import Engine
from backend.errors import InvalidRequestError
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.models.qwen3_next import HeadCache, MTPHead
from backend.sampling import Sampler
from backend.speculation.mtp import MTPDrafter
from backend.speculation.rollback import SpeculativeWrite
from backend.weights.loading import load_model
from tests.test_speculative import reply, resumed_reply  # reply: (ids, logprobs, DoneEvent, flags)

MTP = "qwen3_next-mtp"
EXACT_CHUNK = 16  # row-invariant forwards (tests/test_row_invariance.py)
REPEATED = (65, 66)  # the only tokens the agreeing checkpoint's target scores


def agreeing_checkpoint(source: Path, folder: Path) -> Path:
    """``source`` (with an MTP head) rewritten so that the head agrees with the target often;
    see the module docstring."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    hidden = tensors["mtp.fc.weight"].shape[0]
    fc = np.zeros((hidden, 2 * hidden), np.float32)
    fc[:, hidden:] = np.eye(hidden)  # fc(concat(embedding, hidden)) = hidden
    tensors["mtp.fc.weight"] = fc
    for name in [k for k in tensors if k.startswith("mtp.")]:
        if "norm" in name.rsplit(".", 2)[-2] or name.endswith(("o_proj.weight",
                                                                 "down_proj.weight")):
            tensors[name] = np.zeros_like(tensors[name])  # norms scale by 1 + 0; no residuals
    head = tensors["lm_head.weight"]
    v = head[REPEATED[0]].copy()
    head[:] = 0.0
    head[REPEATED[0]], head[REPEATED[1]] = v, -v
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    random_head = tiny_model_dir(MTP)
    agreeing = agreeing_checkpoint(random_head, tmp_path_factory.mktemp("agreeing") / "model")
    return {"random head": random_head, "agreeing head": agreeing}


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(6, 30))] for _ in range(count)]


def head_state(drafter: MTPDrafter) -> list[np.ndarray]:
    """What the drafter's caches hold: each layer's keys and values up to its offset, and the
    carried hidden state."""
    out = []
    for cache in drafter.head_caches:
        out += [np.array(cache.keys[..., :cache.offset, :]),
                np.array(cache.values[..., :cache.offset, :])]
    return out + [np.array(drafter.carry.conv)]


# -- the head ---------------------------------------------------------------------------------

def test_a_head_exactly_when_the_checkpoint_ships_one(tiny_model_dir):
    with_head = load_model(tiny_model_dir(MTP)).model
    head = with_head.draft_head()
    assert isinstance(head, MTPHead) and len(head.layers) == 1
    assert (kernels.outputs(head.fc.weight), head.fc.weight.shape[1]) == (64, 128)  # or panels
    assert not head.layers[0].is_linear  # full attention, whatever layer_types[0] says
    assert load_model(tiny_model_dir("qwen3_next")).model.draft_head() is None

    memory = CacheConfig.memory_only()
    auto = Engine.load(str(tiny_model_dir(MTP)), cache=memory)
    assert auto.speculation == "mtp" and auto.drafter.kind == "mtp"
    assert auto.caches == auto.target_caches + auto.drafter.caches
    assert len(auto.drafter.caches) == 2  # one head layer, the carry
    plain = Engine.load(str(tiny_model_dir(MTP)), cache=memory, speculation="none")
    assert plain.drafter is None and plain.caches == plain.target_caches
    headless = Engine.load(str(tiny_model_dir("qwen3_next")), cache=memory)
    assert headless.speculation == "lookup" and headless.drafter is None
    with pytest.raises(InvalidRequestError, match="multi-token-prediction head"):
        reply(headless, [5, 6, 7], n=4, draft="mtp")
    with pytest.raises(InvalidRequestError, match="multi-token-prediction head"):
        reply(plain, [5, 6, 7], n=4, draft="mtp")


def test_head_shapes_determinism_and_incremental_writes(tiny_model_dir):
    model = load_model(tiny_model_dir(MTP)).model
    head = model.draft_head()
    rng = np.random.default_rng(0)
    n = 12
    tokens = mx.array(rng.integers(3, 200, size=(1, n)))
    previous = mx.array(rng.normal(size=(1, n, 64)).astype(np.float32))

    def one_pass(slot0=None):
        caches = head.make_caches()
        head.open(caches, mx.float32)
        if slot0 is not None:  # whatever slot 0 holds, attention must not see it
            caches[0].keys[..., :1, :] = slot0
            caches[0].values[..., :1, :] = slot0
        return model.draft_hidden(tokens, previous, caches), caches

    out, caches = one_pass()
    assert out.shape == (1, n, 64) and caches[0].offset == n + 1
    assert model.logits(out).shape == (1, n, model.args.vocab_size)
    again, _ = one_pass()
    assert mx.array_equal(out, again)  # deterministic
    garbage, _ = one_pass(slot0=mx.full((1, 2, 1, 16), 7.0))
    assert mx.array_equal(out, garbage)
    caches = head.make_caches()
    head.open(caches, mx.float32)
    parts = [model.draft_hidden(tokens[:, :5], previous[:, :5], caches)]
    parts += [model.draft_hidden(tokens[:, i:i + 1], previous[:, i:i + 1], caches)
              for i in range(5, n)]
    np.testing.assert_allclose(np.array(mx.concatenate(parts, axis=1)), np.array(out),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="slot 0"):
        model.draft_hidden(tokens, previous, head.make_caches())  # not opened
    assert isinstance(caches[0], HeadCache)


# -- the pairing ------------------------------------------------------------------------------

def test_drafts_come_from_the_pairs_of_the_committed_ids(tiny_model_dir):
    """Drive the drafter as the decode loops do (a prefill chunk; the newest id fed by its own
    step before the proposal, or leading the verify block after it; blocks rolled back to a
    random count; plain steps), and check every proposal against the head run from scratch over
    the pairs (token p, target hidden at p - 1) of exactly the committed ids."""
    model = load_model(tiny_model_dir(MTP)).model
    drafter = MTPDrafter(model)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))  # logprobs = log-softmax
    caches = model.make_caches()
    rng = random.Random(5)
    hiddens: list[mx.array] = []  # (1, 1, H): the target's hidden state at each held position

    def forward(ids: list[int]) -> mx.array:
        start = caches[0].offset
        tokens = mx.array(ids, dtype=mx.int32)
        hidden = model.hidden(tokens[None], caches)
        drafter.observe(start, tokens, hidden)
        return hidden

    def log_softmax(logits: mx.array) -> np.ndarray:
        return np.array(logits - mx.logsumexp(logits))

    held = [rng.randrange(3, 200) for _ in range(9)]
    hidden = forward(held)  # a prefill chunk
    hiddens += [hidden[:, i:i + 1] for i in range(len(held))]
    drafter.feed(held)
    leading = 0
    for round_ in range(16):
        token = rng.randrange(3, 200)  # the target's next token
        fed = round_ % 2 == 0
        if fed or round_ % 5 == 3:  # fed by its own step (a plain step when not proposing)
            hiddens.append(forward([token]))
            held.append(token)
            if not fed:
                continue
        context = held if fed else held + [token]
        draft = drafter.propose(context, 3, sampler, lambda drafts: None)
        fresh = drafter.head.make_caches()
        drafter.head.open(fresh, mx.float32)
        previous = mx.concatenate(hiddens[:len(context) - 1], axis=1)
        out = model.draft_hidden(mx.array([context[1:]]), previous, fresh)[:, -1:]
        np.testing.assert_allclose(np.array(draft.logprobs[0]), log_softmax(
            model.logits(out)[0, -1]), atol=1e-5, rtol=0)
        second = model.draft_hidden(draft.tokens[:1].reshape(1, 1), out, fresh)
        np.testing.assert_allclose(np.array(draft.logprobs[1]), log_softmax(
            model.logits(second)[0, -1]), atol=1e-5, rtol=0)
        block = ([] if fed else [token]) + draft.tokens.tolist()  # the verify, its rollback
        tx = SpeculativeWrite(caches, len(block))
        rows = forward(block)
        mx.eval(rows, [c.arrays() for c in caches])
        keep = rng.randrange(0, len(block) - 3 + 1) + (0 if fed else 1)
        leading += not fed
        tx.commit(keep)
        held += block[:keep]
        hiddens += [rows[:, i:i + 1] for i in range(keep)]
        drafter.settle(held)
    assert leading > 4
    drafter.catch_up(held)
    assert {c.offset for c in drafter.caches} == {len(held)}


# -- through the engine -----------------------------------------------------------------------

@pytest.mark.parametrize("head", ["random head", "agreeing head"])
def test_greedy_mtp_speculation_equals_plain_greedy(head, checkpoints):
    folder = str(checkpoints[head])
    memory = CacheConfig.memory_only()
    plain = Engine.load(folder, cache=memory, speculation="none")
    cases = [[5], [5, 6]] + prompts(11)  # one- and two-token prompts: slot 0 only, at first
    expected = {tuple(p): reply(plain, p)[:2] for p in cases}
    drafted = accepted = 0
    for depth in range(1, 9):
        engine = Engine.load(folder, cache=memory, draft_depth=depth)  # "auto": the head
        for prompt in cases:
            ids, logprobs, done, flags = reply(engine, prompt)
            assert (ids, logprobs) == expected[tuple(prompt)], f"depth {depth}"
            assert done.drafter == "mtp" and sum(flags) == done.accepted_tokens
            drafted += done.drafted_tokens
            accepted += done.accepted_tokens
        done = resumed_reply(engine, plain, cases[-1], expected[tuple(cases[-1])][0],
                             f"depth {depth}")
        drafted += done.drafted_tokens
        accepted += done.accepted_tokens
    assert drafted > 0
    if head == "agreeing head":
        assert 0 < accepted < drafted  # kept drafts and rolled-back ones
        assert done.mean_accepted > 0 and 0 < max(done.acceptance_by_position) <= 1


def test_rejected_rounds_leave_the_head_caches_of_a_fresh_prefill(checkpoints):
    """After replies with accepted and rejected rounds (and a resumed turn) the head's caches
    hold what one prefill of the same ids writes (row-invariant forwards: within 1e-5)."""
    folder = str(checkpoints["agreeing head"])
    engine = Engine.load(folder, cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK,
                         draft_depth=4)
    prompt = prompts(12, 1)[0]
    ids, _, done, _ = reply(engine, prompt, n=30)
    assert 0 < done.accepted_tokens < done.drafted_tokens
    ids2, _, done, _ = reply(engine, prompt + ids + [7, 8], n=20)
    assert done.cached_tokens > len(prompt) and done.accepted_tokens < done.drafted_tokens
    held = list(engine.prefix.live)
    assert len(held) == len(prompt) + len(ids) + 2 + len(ids2) - 1  # the last id is not fed
    fresh = Engine.load(folder, cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK)
    reply(fresh, held, n=1, draft="none")  # prefills exactly ``held``
    assert list(fresh.prefix.live) == held
    for got, want in zip(head_state(engine.drafter), head_state(fresh.drafter), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_head_caches_survive_a_restart_from_the_disk_tier(checkpoints, tmp_path):
    """The head's caches go through the prefix cache's tiers with the target's: after a
    restart, a resumed conversation leaves them bit for bit as in an engine that never
    stopped, and the reply is the plain one."""
    folder = str(checkpoints["agreeing head"])
    config = CacheConfig(CacheBudgets(0, 0, 1 << 20), tmp_path)
    live = Engine.load(folder, cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK,
                       draft_depth=3)
    engine = Engine.load(folder, cache=config, prefill_chunk=EXACT_CHUNK, draft_depth=3)
    prompt = prompts(13, 1)[0]
    first = reply(engine, prompt, n=16)
    assert first[:2] == reply(live, prompt, n=16)[:2]
    engine.close()
    restarted = Engine.load(folder, cache=config, prefill_chunk=EXACT_CHUNK, draft_depth=3)
    follow = prompt + first[0] + [9, 10, 11]
    ids, logprobs, done, _ = reply(restarted, follow, n=16)
    assert done.cached_by_tier.get("disk", 0) > 0 and done.drafted_tokens > 0
    want = reply(live, follow, n=16)
    assert (ids, logprobs) == want[:2]
    assert done.accepted_tokens == want[2].accepted_tokens
    for got, expect in zip(head_state(restarted.drafter), head_state(live.drafter), strict=True):
        np.testing.assert_array_equal(got, expect)
    restarted.close()

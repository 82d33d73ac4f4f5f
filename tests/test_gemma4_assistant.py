"""The Gemma 4 assistant (``gemma4_assistant``) drafting for its Gemma 4 target.

The pair: the tiny ``gemma4_text`` target (KV-shared layers, a window of 8 that wraps every few
tokens) and a two-layer assistant built with mlx-vlm 0.7.10's own drafter class
(``tests/fixtures/tiny_gemma4_assistant.py``), random, or fitted briefly to the target's greedy
reply to ``PROMPT`` (so that replies there see whole blocks and part of blocks accepted, and
other prompts nothing).

1. Given the same target keys, values, hidden states and ids, Arbor's greedy drafts equal
   mlx-vlm's, and each step's log-distribution within ``TOLERANCE``: before and after the window
   fills, with the ring as a prefill leaves it and after a one-token step overwrote its oldest
   position; dense and centroid-routed heads.
2. Speculative replies equal plain replies token for token and in log-probabilities (every
   round's verify block of 4..7 rows crosses the window's wrap somewhere in a 40-token reply
   over 12 prompt ids); resumed from the live, device, host and disk tiers.
3. Rounds with rejected drafts leave the target's caches and the drafter's inputs as a fresh
   prefill of the committed ids gives them; 1,000 rounds keep active memory flat.
4. Pairing: ``arbor models import TARGET --draft ASSISTANT [--quantize-draft 4]``, ``models
   list`` naming the assistant, a stored target drafting with it; an assistant alone or for
   another target refused with one line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from backend.api import GenerateRequest, SamplingParams
from backend.engine import Engine
from backend.errors import ModelLoadError
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.sampling import Sampler
from backend.speculation.assistant import AssistantDrafter
from backend.speculation.rollback import SpeculativeWrite
from backend.weights.loading import load_model
from tests.fixtures import tiny_gemma4_assistant as fixture
from tests.test_speculative import reply

TARGET = "gemma4_text"
TOLERANCE = 1e-4  # float32 log-probabilities (native CPU kernels vs MLX ops), as test_gemma4
PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 300, 12)]
OTHER = [int(x) for x in np.random.default_rng(5).integers(3, 300, 12)]
KIB = 1024
EXACT_CHUNK = 16  # row-invariant prefill chunks (tests/test_row_invariance.py)
GREEDY = Sampler(SamplingParams())


def no_history(_drafts):
    return None


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    """Target folder, its greedy reply to PROMPT, and assistants: "random", "ordered" (random,
    centroid head), "fitted" (to that reply)."""
    folder = tiny_model_dir(TARGET)
    text = json.loads((folder / "config.json").read_text())
    plain = Engine.load(str(folder), cache=CacheConfig.memory_only(), speculation="none")
    ids = reply(plain, PROMPT, n=40)[0]
    target = load_model(folder).model
    root = tmp_path_factory.mktemp("assistants")
    made = {"target": folder, "reply": ids, "text": text}
    for name, ordered in (("random", False), ("ordered", True), ("fitted", False)):
        config = fixture.assistant_config(text, ordered)
        model = fixture.reference_assistant(config, seed=1)
        if name == "fitted":
            fixture.fit(model, target, PROMPT + ids, len(PROMPT) - 1)
        made[name] = fixture.write_assistant(root / f"tiny-assistant-{name}", model, config)
        made[f"{name} reference"] = model
    return made


# -- 1. drafts equal the reference's -----------------------------------------------------------

@pytest.mark.parametrize("head", ["random", "ordered", "fitted"])
@pytest.mark.parametrize("fed", [False, True], ids=["unfed", "fed by a step"])
def test_drafts_equal_the_reference(pair, head, fed):
    """At positions before, at and past the window (8), the drafter over the target's live
    caches proposes mlx-vlm's greedy drafts; each step's log-distribution along them matches
    within TOLERANCE. ``fed``: the target's one-token step for the newest id is already queued
    (it overwrote the ring's oldest position, which the drafter kept)."""
    target = load_model(pair["target"]).model
    assistant = load_model(pair[head]).model
    reference = pair[f"{head} reference"]
    ids = PROMPT + pair["reply"]
    hidden, kv = fixture.target_states(target, ids)
    steps = 5
    for position in (1, 2, 7, 8, 9, 13, 30, 47):
        want, want_logprobs = fixture.reference_draft(reference, target, hidden, kv, ids,
                                                      position, steps)
        caches = target.make_caches()
        drafter = AssistantDrafter(target, assistant, caches)
        prefix = mx.array(ids[:position], dtype=mx.int32)
        drafter.observe(0, prefix, target.hidden(prefix[None], caches))
        if fed:
            step = mx.array(ids[position:position + 1], dtype=mx.int32)
            drafter.observe(position, step, target.hidden(step[None], caches))
        draft = drafter.propose(ids[:position + 1], steps, GREEDY, no_history)
        assert draft.tokens.tolist() == want, f"position {position}"
        # The distributions along the reference's drafts, through the same inputs.
        got = []
        previous = drafter._hidden_at(position - 1)
        histories = {kind: drafter._visible(cache, position - 1)
                     for kind, cache in drafter.sources.items()}
        for token in [ids[position]] + want[:-1]:
            embedded = target.model.embed(mx.array([[token]], dtype=mx.int32))
            logits, previous = assistant.step(embedded, previous, histories)
            got.append(logits - mx.logsumexp(logits))
        np.testing.assert_allclose(np.array(mx.stack(got)), np.array(want_logprobs),
                                   atol=TOLERANCE, rtol=0, err_msg=f"position {position}")


def test_the_first_round_needs_a_hidden_state(pair):
    """One id and nothing observed: nothing to draft from (None), not an error."""
    target = load_model(pair["target"]).model
    drafter = AssistantDrafter(target, load_model(pair["random"]).model, target.make_caches())
    assert drafter.propose([5], 3, GREEDY, no_history) is None
    assert drafter.caches == []  # its inputs are the target's caches


# -- 2. speculative replies are plain replies --------------------------------------------------

def test_speculative_replies_equal_plain_replies(pair):
    folder = str(pair["target"])
    memory = CacheConfig.memory_only()
    plain = Engine.load(folder, cache=memory, speculation="none")
    expected = {tuple(p): reply(plain, p, n=40)[:2] for p in (PROMPT, OTHER)}
    outcomes = {}
    for head in ("random", "fitted"):
        for depth in (None, 1, 3, 6):
            engine = Engine.load(folder, cache=memory, draft=str(pair[head]), draft_depth=depth)
            for prompt, label in ((PROMPT, "prompt"), (OTHER, "other")):
                ids, logprobs, done, flags = reply(engine, prompt, n=40)
                assert (ids, logprobs) == expected[tuple(prompt)], (head, depth, label)
                assert done.drafter == "assistant" and sum(flags) == done.accepted_tokens
                outcomes[head, depth, label] = (done.drafted_tokens, done.accepted_tokens)
    # The fitted assistant drafts whole blocks on its prompt, part of blocks deeper, and
    # nothing that a random target accepts elsewhere; the random one is never accepted.
    drafted, accepted = outcomes["fitted", 3, "prompt"]
    assert drafted > 0 and accepted == drafted, outcomes
    drafted, accepted = outcomes["fitted", 6, "prompt"]
    assert 0 < accepted < drafted, outcomes
    assert all(a == 0 < d for (head, _, label), (d, a) in outcomes.items()
               if head == "random" or label == "other"), outcomes


def test_replies_resumed_from_every_tier_equal_plain_replies(pair, tmp_path):
    """Four conversations taking turns (one on PROMPT, where drafts are accepted), resumed from
    the live caches and the device tier, then under budgets that keep nothing on the device
    from the host and disk tiers (a restart in between), reply as plain decoding does."""
    folder = str(pair["target"])
    # Never switched: one prefill in row-invariant chunks, as a resumed state was written.
    plain = Engine.load(folder, cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                        prefill_chunk=EXACT_CHUNK, speculation="none")
    fresh = Engine.load(folder, cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                        prefill_chunk=EXACT_CHUNK, draft=str(pair["fitted"]), draft_depth=4)
    configs = (CacheConfig(CacheBudgets(1 << 20, 0, 0), None, capture_interval=16),
               CacheConfig(CacheBudgets(0, 256 * KIB, 1 << 20), tmp_path, capture_interval=16))
    rng = random.Random(2)
    tiers: dict[str, int] = {}
    drafted = accepted = 0
    for config in configs:
        def engine():
            return Engine.load(folder, cache=config, prefill_chunk=EXACT_CHUNK,
                               draft=str(pair["fitted"]), draft_depth=4)

        spec = engine()
        convs = [list(PROMPT)] + [[rng.randrange(3, 300) for _ in range(12)] for _ in range(3)]
        for turn in range(3):
            for c in [0, 0, 1, 2, 3]:  # PROMPT's second turn resumes from the live caches
                prompt = convs[c]
                ids, logprobs, done, _ = reply(spec, prompt, n=8)
                assert (ids, logprobs) == reply(plain, prompt, n=8)[:2], (turn, c)
                # Resumed, the assistant drafts what it drafts after a fresh prefill.
                never = reply(fresh, prompt, n=8)[2]
                assert (done.drafted_tokens, done.accepted_tokens) == \
                    (never.drafted_tokens, never.accepted_tokens), (turn, c, done.cached_by_tier)
                for tier, n in done.cached_by_tier.items():
                    tiers[tier] = tiers.get(tier, 0) + n
                drafted += done.drafted_tokens
                accepted += done.accepted_tokens
                convs[c] = prompt + ids + [rng.randrange(3, 300) for _ in range(3)]
            if turn == 1:
                spec.close()
                spec = engine()
        spec.close()
    assert 0 < accepted < drafted
    assert all(tiers.get(t, 0) > 0 for t in ("live", "device", "host", "disk")), tiers


def test_replies_in_a_batch_equal_their_solo_replies(pair):
    """Four requests sharing batched forwards, each lane with its own assistant over its own
    target caches (PROMPT's drafts accepted, the others' not; one samples with a seed; a fixed
    depth, as the depth controller learns from every request's rounds): each reply equals the
    one it gets alone."""
    from tests.test_batching import events_reply

    folder = str(pair["target"])
    rng = random.Random(6)
    requests = [GenerateRequest(prompt_ids=prompt, max_tokens=20, logprobs=True,
                                ignore_eos=True, sampling=sampling)
                for prompt, sampling in (
                    (PROMPT, SamplingParams()), (OTHER, SamplingParams()),
                    (PROMPT[:7], SamplingParams(temperature=0.8, seed=9)),
                    ([rng.randrange(3, 300) for _ in range(20)], SamplingParams()))]
    solo = Engine.load(folder, cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                       prefill_chunk=EXACT_CHUNK, draft=str(pair["fitted"]), draft_depth=3)
    expected = [events_reply(list(solo.generate(r))) for r in requests]
    engine = Engine.load(folder, cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK,
                         draft=str(pair["fitted"]), draft_depth=3, max_batch=4)
    streams = [engine.submit(r) for r in requests]
    events = [[] for _ in requests]
    most = 0
    while engine.scheduler.busy:
        engine.step()
        most = max(most, len(engine.scheduler.running))
        for i, stream in enumerate(streams):
            while stream.events:
                events[i].append(stream.events.popleft())
            assert stream.error is None, stream.error
    assert most == 4
    done = [e[-1] for e in events]
    assert all(d.drafter == "assistant" for d in done) and done[0].accepted_tokens > 0
    solo_done = [list(solo.generate(r))[-1] for r in requests]
    for i, got in enumerate(events):
        assert events_reply(got) == expected[i], f"request {i}"
        assert (done[i].drafted_tokens, done[i].accepted_tokens) == \
            (solo_done[i].drafted_tokens, solo_done[i].accepted_tokens), f"request {i}"


# -- 3. rollback and memory --------------------------------------------------------------------

def _rounds(target, drafter, caches, committed: list[int], rng: random.Random, count: int
            ) -> list[int]:
    """``count`` rounds as the decode loop runs them, each keeping a random number of drafts
    (none in about a third): a one-token step for the newest id first in every other round
    (the ring's oldest position overwritten), else the id leads the verify block."""
    for _ in range(count):
        token = rng.randrange(3, 300)
        fed = rng.random() < 0.5
        if fed:
            step = mx.array([token], dtype=mx.int32)
            hidden = target.hidden(step[None], caches)
            drafter.observe(len(committed), step, hidden)
            mx.async_eval(hidden)  # as the decode loop starts the step's logits
            committed = committed + [token]
        draft = drafter.propose(committed if fed else committed + [token], rng.randrange(1, 7),
                                GREEDY, no_history)
        block = draft.tokens if fed else mx.concatenate([mx.array([token]), draft.tokens])
        start = len(committed)
        tx = SpeculativeWrite(caches, block.shape[0])
        hidden = target.hidden(block[None], caches)
        drafter.observe(start, block, hidden)
        mx.eval(hidden, [c.arrays() for c in caches])
        keep = 0 if rng.random() < 0.35 else rng.randrange(0, block.shape[0] + 1)
        if not fed:
            keep = max(keep, 1)  # the newest id is the target's own
        tx.commit(keep)
        committed = committed + block.tolist()[:keep]
        drafter.settle(committed)
    return committed


def test_rejected_rounds_leave_what_a_fresh_prefill_gives(pair):
    """After rounds with rejected drafts, the target's caches hold what a fresh prefill of
    the committed ids writes (row-invariant chunks: bit for bit) and the drafter drafts from
    the same inputs (hidden state, keys per type) as one fresh from that prefill."""
    target = load_model(pair["target"]).model
    assistant = load_model(pair["fitted"]).model
    rng = random.Random(4)
    caches = target.make_caches()
    drafter = AssistantDrafter(target, assistant, caches)
    committed = PROMPT[:5]
    prefix = mx.array(committed, dtype=mx.int32)
    drafter.observe(0, prefix, target.hidden(prefix[None], caches))
    committed = _rounds(target, drafter, caches, committed, rng, 30)
    assert len(committed) > 3 * 8  # the window wrapped several times
    # Last, a block led by the newest id, two of its five rows kept.
    draft = drafter.propose(committed + [66], 4, GREEDY, no_history)
    block = mx.concatenate([mx.array([66], dtype=mx.int32), draft.tokens])
    tx = SpeculativeWrite(caches, block.shape[0])
    hidden = target.hidden(block[None], caches)
    drafter.observe(len(committed), block, hidden)
    mx.eval(hidden, [c.arrays() for c in caches])
    tx.commit(2)
    committed = committed + block.tolist()[:2]
    drafter.settle(committed)

    fresh_caches = target.make_caches()
    fresh = AssistantDrafter(target, assistant, fresh_caches)
    for i in range(0, len(committed), 16):
        chunk = mx.array(committed[i:i + 16], dtype=mx.int32)
        fresh.observe(i, chunk, target.hidden(chunk[None], fresh_caches))
    anchor = len(committed) - 1
    for got, want in zip(caches, fresh_caches, strict=True):
        a, b = got.visible_keys(anchor), want.visible_keys(anchor)
        assert a.key_start == b.key_start
        np.testing.assert_array_equal(np.array(a.keys), np.array(b.keys))
        np.testing.assert_array_equal(np.array(a.values), np.array(b.values))
    truth = {kind: cache.visible_keys(anchor) for kind, cache in fresh.sources.items()}
    # The next id fed by a one-token step (its key overwrites the ring's oldest position):
    # both drafters still hand the assistant the window the target's query at the anchor sees.
    token = 77
    for d, cs in ((drafter, caches), (fresh, fresh_caches)):
        step = mx.array([token], dtype=mx.int32)
        hidden = target.hidden(step[None], cs)
        d.observe(len(committed), step, hidden)
        mx.eval(hidden)
    assert caches[0].offset == len(committed) + 1
    for d in (drafter, fresh):
        np.testing.assert_array_equal(np.array(d._hidden_at(anchor)),
                                      np.array(fresh._hidden_at(anchor)))
        for kind, cache in d.sources.items():
            seen = d._visible(cache, anchor)
            assert seen.key_start == truth[kind].key_start, kind
            np.testing.assert_array_equal(np.array(seen.keys), np.array(truth[kind].keys))
            np.testing.assert_array_equal(np.array(seen.values), np.array(truth[kind].values))
    held = committed + [token]
    got = drafter.propose(held, 6, GREEDY, no_history).tokens.tolist()
    assert got == fresh.propose(held, 6, GREEDY, no_history).tokens.tolist()


def test_a_thousand_rounds_keep_active_memory_flat(pair):
    """1,100 rounds in one conversation (some 2,000 tokens): what is active beside the target's
    caches (which grow with the context) stays flat: the drafter keeps a bounded tail of hidden
    states and edges, and nothing holds an old buffer alive."""
    target = load_model(pair["target"]).model
    assistant = load_model(pair["fitted"]).model
    rng = random.Random(5)
    caches = target.make_caches()
    drafter = AssistantDrafter(target, assistant, caches)
    prefix = mx.array(PROMPT, dtype=mx.int32)
    drafter.observe(0, prefix, target.hidden(prefix[None], caches))
    committed = _rounds(target, drafter, caches, list(PROMPT), rng, 100)

    def besides_caches() -> int:
        mx.clear_cache()
        return mx.get_active_memory() - sum(c.nbytes for c in caches)

    before = besides_caches()
    committed = _rounds(target, drafter, caches, committed, rng, 1000)
    assert len(committed) > 1500
    assert besides_caches() <= before + 64 * KIB, (before, besides_caches())


# -- 4. pairing --------------------------------------------------------------------------------

def test_an_assistant_alone_or_for_another_target_is_refused(pair, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="Gemma 4 assistant: it drafts for its target"):
        Engine.load(str(pair["random"]), cache=CacheConfig.memory_only())
    with pytest.raises(ModelLoadError, match="cannot draft for .*Gemma 4 targets"):
        Engine.load(str(tiny_model_dir("llama")), cache=CacheConfig.memory_only(),
                    draft=str(pair["random"]))


@pytest.mark.parametrize("bits", [None, 4])
def test_import_pairs_an_assistant_and_a_stored_target_drafts_with_it(
        pair, bits, capsys, monkeypatch, tmp_path):
    """``arbor models import TARGET --draft ASSISTANT [--quantize-draft 4]``: listed as the
    target's assistant, loaded with it (``drafter == "assistant"``), replies as plain."""
    from tests.test_model_pairing import arbor, list_lines

    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    extra = ["--quantize-draft", str(bits)] if bits else []
    code, out, err = arbor(capsys, "models", "import", str(pair["target"]), "--name", "g4",
                           "--draft", str(pair["fitted"]), *extra)
    assert code == 0, err
    lines = list_lines(capsys)
    assert lines["g4"].endswith("draft tiny-assistant-fitted (assistant)")
    assert "gemma4_assistant" in lines["tiny-assistant-fitted"]
    if bits:
        assert "4-bit" in lines["tiny-assistant-fitted"]
    code, out, err = arbor(capsys, "models", "list", "--verbose")
    assert code == 0, err
    assert "cache per token: 0 bytes" in out  # the assistant keeps no caches
    engine = Engine.load("g4", cache=CacheConfig.memory_only())
    plain = Engine.load("g4", cache=CacheConfig.memory_only(), speculation="none")
    ids, logprobs, done, _ = reply(engine, PROMPT, n=24)
    assert (ids, logprobs) == reply(plain, PROMPT, n=24)[:2]
    assert done.drafter == "assistant" and done.accepted_tokens > 0
    assert reply(engine, PROMPT, n=4, draft="model")[2].drafter == "assistant"


def test_pairing_an_assistant_with_another_target_is_refused(pair, tiny_model_dir, capsys,
                                                             monkeypatch, tmp_path):
    from tests.test_cli import assert_one_line_error
    from tests.test_model_pairing import arbor, store_state

    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    code, _, err = arbor(capsys, "models", "import", str(tiny_model_dir("llama")), "--name",
                         "tiny", "--draft", str(pair["fitted"]))
    assert_one_line_error(code, err, "cannot draft for 'tiny'", "Gemma 4 targets")
    assert store_state(tmp_path / "home") == {}


# -- 5. the benchmark's rows -------------------------------------------------------------------

def test_bench_rows_measure_and_the_tiny_pair_replies_as_plain(pair):
    """``arbor bench spec``'s assistant rows on the tiny pair: every cost measured, break-even
    acceptances that are probabilities and grow with what a round costs, and the fitted pair's
    reply through the engine equal to plain decoding's (timings are the benchmark's, not
    asserted here)."""
    from backend.bench import assistant as bench

    costs = bench.measure(pair["target"], pair["fitted"], context=20, max_drafts=4, repeats=1)
    assert costs.plain_s > 0 and costs.draft_s > 0 and set(costs.verify_s) == {1, 2, 3, 4}
    for k in costs.verify_s:
        even = costs.break_even(k)
        assert even is None or 0 <= even <= 1
    cheap = bench.Costs(20, plain_s=1.0, draft_s=0.1, verify_s={1: 1.0, 2: 1.0})
    assert 0 < cheap.break_even(1) < cheap.break_even(2) < 1  # each extra draft costs 0.1
    assert bench.Costs(20, 1.0, 1.0, {1: 2.0}).break_even(1) is None  # 2 tokens in 3 plain steps
    equal, drafted, accepted = bench.same_tokens(pair["target"], pair["fitted"], pair["target"])
    assert equal and drafted > 0
    assert "same tokens as plain: yes" in bench.format_rows(costs, (equal, drafted, accepted))


def test_an_assistant_shipped_without_a_tokenizer_pairs_by_its_vocabulary_size(
        pair, capsys, monkeypatch, tmp_path):
    """An assistant folder holding only its config and weights pairs with a target it fits
    (vocabulary size, width, window, heads) and drafts; one for another window is refused in
    one line."""
    import shutil

    from tests.test_cli import assert_one_line_error
    from tests.test_model_pairing import arbor

    monkeypatch.setenv("ARBOR_HOME", str(tmp_path / "home"))
    bare = tmp_path / "bare-assistant"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(pair["fitted"] / name, bare / name)
    engine = Engine.load(str(pair["target"]), cache=CacheConfig.memory_only(), draft=str(bare))
    assert reply(engine, PROMPT, n=8)[2].drafter == "assistant"
    code, _, err = arbor(capsys, "models", "import", str(pair["target"]), "--name", "g4",
                         "--draft", str(bare))
    assert code == 0, err
    other = tmp_path / "other-window"
    shutil.copytree(bare, other)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["sliding_window"] = 16
    (other / "config.json").write_text(json.dumps(config))
    code, _, err = arbor(capsys, "models", "import", str(pair["target"]), "--name", "g5",
                         "--draft", str(other))
    assert_one_line_error(code, err, "cannot draft for 'g5'", "sliding_window is 16")

"""DFlash block drafts for Qwen3.5 / Qwen3.6 and Gemma 4 targets.

The tiny drafter (tests/fixtures/fitted_drafters.py: the published layout, two layers reading
the target's layers 0 and 2, blocks of 16) is made with mlx-vlm's ``DFlashDraftModel`` and
fitted to the tiny target's greedy choices along ``FIT_PROMPT``, so on that prompt whole blocks,
partial blocks and rejections happen, elsewhere mostly rejections.

1. Same inputs, same drafts: given the same captured target states and tokens, over two rounds
   (the context growing between them), Arbor's block drafts the reference's greedy tokens and
   its per-position distributions equal the reference's within ``REFERENCE_TOLERANCE``.
2. Greedy identity at depths 1..15 (a block of 16 with its anchor; verify blocks stay within
   the 16 row-invariant rows), fresh and resumed from each prefix-cache tier; the sampled
   distribution test for block drafts (chi-square and TV against the target's own
   distribution), which a broken residual or keeping every draft fails.
3. After rejected rounds every cache (the target's, the drafter's context) equals a fresh
   prefill's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from backend.api import SamplingParams
from backend.engine import Engine
from backend.memory.budgets import CacheConfig
from backend.sampling import Sampler
from backend.speculation import acceptance
from backend.speculation.dflash import DFlashDrafter
from backend.weights.loading import load_model
from tests.fixtures.fitted_drafters import (DFLASH_BLOCK, FIT_PROMPT, fitted_dflash_checkpoint,
                                            greedy_path, reference_dflash)
from tests.test_mtp_qwen3_5 import (EXACT_CHUNK, OTHER_PROMPT, block_outcomes, cache_contents,
                                    resumed_replies_equal_plain)
from tests.test_speculative import reply
from tests.test_speculative_distribution import (_accept_everything, _reject_to_target,
                                                 assert_matches, chi_square_p)

REFERENCE_TOLERANCE = 1e-4


#: The target kinds a block drafter reads: recurrent (Qwen3.5's gated-delta layers) and
#: sliding-window (Gemma 4: windows of 8, so a block of 16 wraps inside itself; shared keys).
TARGETS = ["qwen3_5", "gemma4"]
_pairs: dict[str, tuple] = {}


def _pair(name: str, tiny_model_dir, tmp_path_factory) -> tuple:
    """(target folder, fitted drafter folder), made once per target."""
    if name not in _pairs:
        target = tiny_model_dir(name)
        _pairs[name] = target, fitted_dflash_checkpoint(
            target, tmp_path_factory.mktemp(f"dflash-{name}") / "d")
    return _pairs[name]


@pytest.fixture(scope="module", params=TARGETS)
def pair(request, tiny_model_dir, tmp_path_factory):
    """Each target kind with its fitted drafter."""
    return _pair(request.param, tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen_pair(tiny_model_dir, tmp_path_factory):
    """The Qwen3.5 pair: for what does not depend on the target's kind (the acceptance rule,
    pairing, the bench rows, memory)."""
    return _pair("qwen3_5", tiny_model_dir, tmp_path_factory)


def test_the_drafter_reads_the_target_layers_outputs_as_transformers_computes_them(pair):
    """What the block drafter is conditioned on: the target's residual stream after each layer
    it names (``capture``), concatenated, equals transformers' hidden states after those layers
    (Gemma 4's own forward, with its shared keys and per-layer inputs, captures as the plain
    decoder does)."""
    from tests.fixtures.references import transformers_layer_outputs

    target_folder, folder = pair
    model = load_model(target_folder, dtype="float32", cpu_kernels=False).model
    layers = load_model(folder, dtype="float32", cpu_kernels=False).model.args.target_layer_ids
    model.model.capture(layers)
    tokens = np.array([FIT_PROMPT + OTHER_PROMPT])
    model.hidden(mx.array(tokens), model.make_caches())
    want = transformers_layer_outputs(target_folder, tokens, layers)
    np.testing.assert_allclose(np.array(model.model.captured), want, atol=1e-4, rtol=0)


def test_blocks_equal_the_reference(pair):
    target_folder, folder = pair
    model = load_model(target_folder, dtype="float32", cpu_kernels=False).model
    draft = load_model(folder, dtype="float32", cpu_kernels=False).model
    model.model.capture(draft.args.target_layer_ids)
    path, _ = greedy_path(target_folder, FIT_PROMPT, 30)
    ids = FIT_PROMPT + path
    model.hidden(mx.array([ids]), model.make_caches())
    features = model.model.captured
    worst = 0.0
    for first, second in ((len(FIT_PROMPT), len(FIT_PROMPT) + 6), (9, 10), (20, 31)):
        reference = reference_dflash(folder, target_folder)
        reference_caches = reference.make_cache()
        drafter = DFlashDrafter(model, draft)
        start = 0
        for anchor in (first, second):
            n = DFLASH_BLOCK - 1
            seen = []

            def record(logits: mx.array) -> mx.array:
                seen.append(logits[0])
                return mx.argmax(logits, axis=-1)

            want = reference.draft_block(ids[anchor], features[:, start:anchor],
                                         reference_caches, n + 1, record)[0].tolist()
            drafter.observe(start, mx.array(ids[start:anchor]), features[:, start:anchor])
            start = anchor
            greedy = drafter.propose(ids[:anchor + 1], n, Sampler(SamplingParams()),
                                     lambda drafts: None)
            assert greedy.tokens.tolist() == want, f"anchor {anchor}"
            sampled = drafter.propose(ids[:anchor + 1], n, Sampler(SamplingParams(
                temperature=1.0, seed=anchor)), lambda drafts: None)
            expect = np.array(seen[0] - mx.logsumexp(seen[0], axis=-1, keepdims=True))
            diff = float(np.abs(np.array(sampled.logprobs) - expect).max())
            worst = max(worst, diff)
            assert diff < REFERENCE_TOLERANCE, f"anchor {anchor}"
            drafter.settle(ids[:anchor + 1])
    print(f"worst log-probability difference {worst:.2e}")


# -- 2. greedy identity -------------------------------------------------------------------------

def test_speculative_replies_equal_plain_ones_at_every_depth_and_tier(pair, tmp_path):
    target, folder = pair
    plain = Engine.load(str(target), cache=CacheConfig.memory_only(), speculation="none")
    expected = {}

    def want(prompt, n):
        if (tuple(prompt), n) not in expected:
            expected[tuple(prompt), n] = reply(plain, prompt, n=n)[:2]
        return expected[tuple(prompt), n]

    outcomes: set[str] = set()
    for depth in range(1, DFLASH_BLOCK):
        engine = Engine.load(str(target), cache=CacheConfig.memory_only(), draft=str(folder),
                             draft_depth=depth)
        assert engine.speculation == "dflash"
        for prompt in (FIT_PROMPT, OTHER_PROMPT):
            ids, logprobs, done, flags = reply(engine, prompt, n=32)
            assert (ids, logprobs) == want(prompt, 32), f"depth {depth}"
            assert done.drafter == "dflash" and sum(flags) == done.accepted_tokens
            assert done.drafted_tokens <= depth * done.draft_rounds
            outcomes |= block_outcomes(flags, done.draft_rounds, depth)
        engine.close()
    assert outcomes == {"whole", "partial", "none"}, outcomes
    resumed_replies_equal_plain(
        lambda config, depth: Engine.load(str(target), cache=config, draft=str(folder),
                                          draft_depth=depth),
        (1, 7, 15), "dflash", want, tmp_path)


def test_rejected_rounds_leave_every_cache_as_a_fresh_prefill(pair):
    """The target's layers rolled back after each rejected block, the drafter's context
    caches (never written past the committed ids): all equal one prefill of the same ids."""
    target, folder = pair
    engine = Engine.load(str(target), cache=CacheConfig.memory_only(), draft=str(folder),
                         prefill_chunk=EXACT_CHUNK, draft_depth=6)
    ids, _, done, _ = reply(engine, FIT_PROMPT, n=30)
    assert 0 < done.accepted_tokens < done.drafted_tokens
    follow = FIT_PROMPT + ids + [44, 45, 46]
    ids2, _, done, _ = reply(engine, follow, n=20)
    assert done.cached_tokens > len(FIT_PROMPT) and done.accepted_tokens < done.drafted_tokens
    held = list(engine.prefix.live)
    assert len(held) == len(follow) + len(ids2) - 1
    fresh = Engine.load(str(target), cache=CacheConfig.memory_only(), draft=str(folder),
                        prefill_chunk=EXACT_CHUNK)
    reply(fresh, held, n=1, draft="none")  # prefills exactly ``held``
    assert list(fresh.prefix.live) == held
    assert len(engine.caches) == len(engine.target_caches) + 2  # two drafter layers
    for i, (got, want) in enumerate(zip(engine.caches, fresh.caches, strict=True)):
        assert got.offset == want.offset == len(held), i
        for a, b in zip(cache_contents(got), cache_contents(want), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"cache {i}")


# -- 2b. sampled block drafts keep the target's distribution ------------------------------------

SAMPLED = SamplingParams(temperature=1.0, top_k=6)
TRIALS = 20_000


def block_trials(pair, rule=None, seed: int = 0):
    """Verify rounds of a real block's first two drafts off the fitted path (where drafter and
    target disagree): the block's distributions q_0, q_1 from the drafter, the target's p_0 after
    the context and p_1 after each possible first token, judged ``TRIALS`` times. Returns the
    committed first tokens' counts with p_0, and the second tokens' counts after the most
    frequent accepted first token with p_1 there."""
    target_folder, folder = pair
    model = load_model(target_folder, dtype="float32", cpu_kernels=False).model
    draft = load_model(folder, dtype="float32", cpu_kernels=False).model
    model.model.capture(draft.args.target_layer_ids)
    context = OTHER_PROMPT
    hidden = model.hidden(mx.array([context]), model.make_caches())
    sampler = Sampler(SamplingParams(**{**SAMPLED.__dict__, "seed": seed}))
    c = int(mx.argmax(model.logits(hidden[:, -1:])[0, -1]))
    drafter = DFlashDrafter(model, draft)
    drafter.observe(0, mx.array(context), model.model.captured)
    block = drafter.propose(context + [c], 2, sampler, lambda drafts: None)
    q = block.logprobs  # (2, V): fixed for the context, whatever was drawn
    q_dists = sampler.distributions(q, [None, None])  # already filtered: sampling them again
    target_row = lambda ids: model.logits(model.hidden(mx.array([ids]),  # noqa: E731
                                                       model.make_caches())[:, -1:])[0]
    p0 = sampler.distributions(target_row(context + [c]), [None])[0]
    support = [int(t) for t in np.nonzero(np.array(p0.probs()))[0]]
    p1 = {x: sampler.distributions(target_row(context + [c, x]), [None])[0] for x in support}
    first = np.zeros(q.shape[1], np.int64)
    second: dict[int, np.ndarray] = {x: np.zeros(q.shape[1], np.int64) for x in support}
    judge = rule or acceptance.judge
    for _ in range(TRIALS):
        drafts = mx.stack([q_dists[0].sample(), q_dists[1].sample()]).astype(mx.int32)
        d0 = int(drafts[0].item())
        verdict = judge([p0, p1.get(d0, p0), p0], drafts, q, sampler)
        accepted, nxt = int(verdict.accepted.item()), int(verdict.next_token.item())
        committed = drafts.tolist()[:accepted] + [nxt]
        first[committed[0]] += 1
        if accepted >= 1 and committed[0] in second:  # (a wrong rule may keep any draft)
            second[committed[0]][committed[1]] += 1
    x = max(second, key=lambda k: second[k].sum())
    assert second[x].sum() > 2_000
    return (first, np.array(p0.probs(), np.float64)), (second[x], np.array(p1[x].probs(),
                                                                            np.float64))


def test_sampled_block_drafts_keep_the_target_distribution(qwen_pair):
    """The first committed token over all trials (chi-square p > 1e-3, TV < 0.01); the second
    after the most frequent accepted first token, a few thousand trials (p > 1e-3, and TV within
    what that many samples of six tokens stray: < 0.05)."""
    (first, p0), (second, p1) = block_trials(qwen_pair)
    assert_matches(first[None], p0[None], positions=1)
    tv = 0.5 * np.abs(second / second.sum() - p1).sum()
    assert chi_square_p(second, p1) > 1e-3 and tv < 0.05, tv


@pytest.mark.parametrize("rule", [_reject_to_target, _accept_everything])
def test_a_broken_residual_or_keeping_every_draft_fails_it(qwen_pair, rule):
    (counts, probs), _ = block_trials(qwen_pair, rule)
    with pytest.raises(AssertionError, match="position 0|outside the target's support"):
        assert_matches(counts[None], probs[None], positions=1)


# -- pairing ------------------------------------------------------------------------------------

def test_models_import_pairs_a_dflash_drafter(qwen_pair, tmp_path, capsys):
    """``arbor models import TARGET --draft DFLASH``: the drafter (no tokenizer of its own) is
    stored and paired; generating with the stored model drafts with it. A drafter built for
    other layers is refused with one line, and nothing is paired."""
    import json
    import shutil

    from desktop.cli import main

    target, folder = qwen_pair
    assert main(["models", "import", str(target), "--name", "tiny-q35",
                 "--draft", str(folder)]) == 0
    capsys.readouterr()
    assert main(["models", "list"]) == 0
    assert "draft d" in capsys.readouterr().out  # the drafter's folder name, stored
    engine = Engine.load("tiny-q35", cache=CacheConfig.memory_only(), draft_depth=4)
    assert engine.speculation == "dflash"
    ids, logprobs, done, _ = reply(engine, FIT_PROMPT, n=16)
    assert done.drafter == "dflash" and done.accepted_tokens > 0
    plain = Engine.load("tiny-q35", cache=CacheConfig.memory_only(), speculation="none")
    assert (ids, logprobs) == reply(plain, FIT_PROMPT, n=16)[:2]

    other = tmp_path / "other-layers"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 7]
    (other / "config.json").write_text(json.dumps(config))
    assert main(["models", "import", str(target), "--name", "tiny-q35-b",
                 "--draft", str(other)]) != 0
    err = capsys.readouterr().err.strip()
    assert "cannot draft for" in err and "layers [7]" in err and "\n" not in err
    assert main(["models", "list"]) == 0
    assert "tiny-q35-b" not in capsys.readouterr().out


@pytest.mark.parametrize("change,needle", [
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
     "layer_types ['sliding_attention']"),
    (lambda c: c["dflash_config"].update(causal=True), "a causal mask inside the block"),
    (lambda c: c["dflash_config"].update(attention_sink_bias=True), "attention sinks"),
    (lambda c: c["dflash_config"].update(draft_window_size=64), "a context window of 64"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "names no dflash_config.mask_token_id"),
])
def test_drafters_beyond_the_published_layout_are_refused_with_one_line(qwen_pair, tmp_path,
                                                                        change, needle):
    """A drafter config whose attention Arbor does not implement, or that leaves the mask id
    out for a target without a default one (Qwen3.5's), is refused when loaded, naming what;
    nothing drafts with it wrongly."""
    import json
    import shutil

    from backend.errors import ModelLoadError

    target, folder = qwen_pair
    other = tmp_path / "changed"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    change(config)
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        Engine.load(str(target), cache=CacheConfig.memory_only(), draft=str(other))
    message = str(info.value)
    assert needle in message and "\n" not in message, message


# -- arbor bench spec ---------------------------------------------------------------------------

def test_bench_rows_for_both_drafters_and_their_tokens_equal_plain(qwen_pair):
    """The drafter rows of ``arbor bench spec`` on the tiny pair (the target's own MTP head and
    the fitted DFlash drafter): a row per kind and draft count, and both drafters' replies
    through the engine equal plain decoding's."""
    from backend.bench import drafters as bench_drafters

    target, folder = qwen_pair
    rows = bench_drafters.round_costs(target, folder, drafts=(1, 15), prompt_tokens=24,
                                      repeats=1, log=lambda m: None)
    assert [(r.drafter, r.drafts) for r in rows] == [("mtp", 1), ("mtp", 15), ("dflash", 1),
                                                      ("dflash", 15)]
    assert all(r.plain_ms > 0 and r.draft_ms > 0 and r.verify_ms > 0 for r in rows)
    assert bench_drafters.same_tokens_as_plain(target, folder, new_tokens=16) == {
        "mtp": True, "dflash": True}
    table = bench_drafters.format_table(rows, {"mtp": True, "dflash": True}, 64, 4)
    assert "break-even" in table and "mtp yes, dflash yes" in table


def test_break_even_acceptance_is_where_a_round_pays_as_plain_steps_do():
    from backend.bench.drafters import CostRow

    for k, a in ((1, 0.5), (4, 0.8), (15, 0.9)):
        expected = sum(a ** j for j in range(k + 1))  # tokens a round of k drafts commits
        row = CostRow("dflash", k, plain_ms=2.0, draft_ms=0.5, verify_ms=2.0 * expected - 0.5)
        assert abs(row.break_even - a) < 1e-6
    assert CostRow("mtp", 2, 1.0, 1.0, 2.5).break_even is None  # 3.5 steps' time for <= 3


def test_block_drafts_in_a_batch_equal_their_solo_replies(pair):
    """Three requests drafting DFlash blocks at once (different prompts, arriving at different
    steps; greedy and seeded sampling): each reply equals its solo reply, bit for bit, with the
    same drafted and accepted counts (the scheduler hands every sequence its own rows of the
    captured layers)."""
    from backend.api import DoneEvent, GenerateRequest
    from tests.test_batching import events_reply

    target, folder = pair
    requests = [GenerateRequest(prompt_ids=list(p), max_tokens=20, ignore_eos=True,
                                logprobs=True, sampling=s)
                for p, s in ((FIT_PROMPT, SamplingParams()), (OTHER_PROMPT, SamplingParams()),
                             (FIT_PROMPT[:9], SamplingParams(temperature=0.8, seed=3)))]

    def engine(max_batch: int) -> Engine:
        return Engine.load(str(target), cache=CacheConfig.memory_only(), draft=str(folder),
                           prefill_chunk=EXACT_CHUNK, draft_depth=5, max_batch=max_batch)

    def drafting(events) -> tuple[int, int]:
        done = next(e for e in events if isinstance(e, DoneEvent))
        return done.drafted_tokens, done.accepted_tokens

    solo = engine(1)
    solo_events = [list(solo.generate(r)) for r in requests]
    expected = [events_reply(e) for e in solo_events]
    batched = engine(3)
    streams, events, step = {}, {}, 0
    while len(streams) < len(requests) or batched.scheduler.busy:
        for i in range(len(requests)):
            if i == step:  # one arrives per step
                streams[i], events[i] = batched.submit(requests[i]), []
        batched.step()
        for i, stream in streams.items():
            while stream.events:
                events[i].append(stream.events.popleft())
            assert stream.error is None, stream.error
        step += 1
    for i in range(len(requests)):
        assert events_reply(events[i]) == expected[i], f"request {i}"
        # The same drafts too: each sequence's block read its own captured rows.
        assert drafting(events[i]) == drafting(solo_events[i]), f"request {i}"
    assert max(drafting(e)[1] for e in solo_events) > 0


# -- memory -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_a_thousand_rounds_keep_active_memory_flat(qwen_pair, kind):
    """Rounds as the decode loop runs them (propose, a verify block observed, a random part
    kept, settle), the context started over when it grows past 160: the target states waiting
    for the drafter stay within a round's, and after 1,000 more rounds active memory is where
    it was after the first 100 (nothing kept across rounds or conversations: observed states,
    context rows, snapshots)."""
    from backend.speculation.mtp import MTPDrafter
    from backend.speculation.rollback import SpeculativeWrite

    target_folder, folder = qwen_pair
    model = load_model(target_folder, dtype="float32", cpu_kernels=False).model
    if kind == "dflash":
        draft = load_model(folder, dtype="float32", cpu_kernels=False).model
        model.model.capture(draft.args.target_layer_ids)
        drafter = DFlashDrafter(model, draft)
    else:
        drafter = MTPDrafter(model)
    caches = model.make_caches()
    rng = np.random.default_rng(0)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    held: list[int] = []

    def forward(ids: list[int]) -> None:
        start = caches[0].offset
        hidden = model.hidden(mx.array([ids]), caches)
        drafter.observe(start, mx.array(ids), model.model.captured if kind == "dflash"
                        else hidden)
        mx.eval(hidden, [c.arrays() for c in caches])

    def start_over() -> None:
        for cache in caches:
            cache.free()
        drafter.close()
        held[:] = rng.integers(3, 200, 20).tolist()
        forward(held)
        drafter.feed(held)

    def rounds(count: int) -> None:
        for _ in range(count):
            c = int(rng.integers(3, 200))
            draft = drafter.propose(held + [c], int(rng.integers(1, 9)), sampler,
                                    lambda drafts: None)
            block = [c] + draft.tokens.tolist()
            tx = SpeculativeWrite(caches, len(block))
            forward(block)
            keep = int(rng.integers(1, len(block) + 1))
            tx.commit(keep)
            held.extend(block[:keep])
            drafter.settle(held)
            # What waits to be consumed is the latest round's, never a growing backlog.
            assert drafter._observed.positions <= 2 * len(block), drafter._observed.positions
            if len(held) > 160:
                start_over()

    start_over()
    rounds(100)
    start_over()  # measured at the same point: a fresh 20-token context
    mx.clear_cache()
    before = mx.get_active_memory()
    rounds(1000)
    start_over()
    mx.clear_cache()
    assert mx.get_active_memory() <= before + 64 * 1024, (before, mx.get_active_memory())

"""Speculative decoding never changes the answer.

* Greedy identity: for full attention, a sliding window crossed inside verify blocks, hybrid
  recurrent (Qwen3-Next, Qwen3.5 dense and MoE), latent-attention (GLM-4.7-Flash) and Gemma 4
  (KV-shared layers; the MoE layout) tiny models, with every drafter (prompt lookup, a draft model that agrees, one that
  does not) and every draft length 1..8, speculative greedy output is plain greedy output token
  for token (and logprob for logprob), also for a prompt resumed from the prefix cache.
* Rollback: after rejected rounds every cache holds exactly the committed tokens (the next step
  equals a fresh prefill's), and 1,000 rounds leave active memory flat.
* The prompt-lookup index finds what the plain search finds.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.api import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from backend.caches.kv import KVCache
from backend.caches.latent import LatentCache
from backend.caches.recurrent import RecurrentCache
from backend.caches.rotating import RotatingKVCache
from backend.engine import Engine
from backend.memory.budgets import CacheConfig
from backend.speculation.depth import DepthController
from backend.speculation.drafters import PromptLookupDrafter, lookup
from backend.speculation.rollback import SpeculativeWrite
from backend.weights.loading import load_model
from tests.fixtures.tiny_models import write_tiny_model

KINDS = ("llama", "gemma3", "qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4_moe_lite", "gemma4",
         "gemma4-moe")


def reply(engine: Engine, prompt, n=24, draft="auto", sampling=None):
    ids, logprobs, done = [], [], None
    request = GenerateRequest(prompt_ids=list(prompt), max_tokens=n, ignore_eos=True,
                              logprobs=True, draft=draft,
                              sampling=sampling or SamplingParams())
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
        elif isinstance(event, TokenEvent) and event.token_id >= 0:
            ids.append((event.token_id, event.from_draft))
            logprobs.append(event.logprob)
    return [t for t, _ in ids], logprobs, done, [f for _, f in ids]


def resumed_reply(engine: Engine, plain: Engine, prompt, reply_ids, label: str) -> DoneEvent:
    """The next turn of the conversation ``prompt`` + ``reply_ids``, resumed from the prefix
    cache: asserts it was resumed and equals plain decoding's reply; its DoneEvent."""
    follow = list(prompt) + list(reply_ids) + [5, 6, 7]
    ids, logprobs, done, _ = reply(engine, follow, n=12)
    assert done.cached_tokens > len(prompt)
    assert (ids, logprobs) == reply(plain, follow, n=12)[:2], f"resumed, {label}"
    return done


def copy_heavy_prompt(rng: random.Random, vocab: int) -> list[int]:
    """Random text with a repeated passage: prompt lookup finds continuations in it."""
    passage = [rng.randrange(3, vocab) for _ in range(12)]
    return ([rng.randrange(3, vocab) for _ in range(5)] + passage
            + [rng.randrange(3, vocab) for _ in range(4)] + passage[:6])


def eager_lookup(engine: Engine) -> Engine:
    """Prompt lookup from 1-gram matches: tiny random models seldom repeat 2-grams, and the
    test needs many drafted rounds (and rejections) on every cache kind."""
    engine.drafter_for = lambda request, lane: PromptLookupDrafter(min_ngram=1)
    return engine


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Draft models with the targets' tokenizer but other random weights (low acceptance)."""
    made = {}

    def make(kind):
        if kind not in made:
            made[kind] = write_tiny_model(tmp_path_factory.mktemp(f"draft-{kind}"), kind, seed=7)
        return made[kind]

    return make


#: Depths from one draft to the deepest default, the ones between sampled (each depth is an engine
#: per drafter kind and family: every one of 1..8 took a fifth of this file's time).
DEPTHS = (1, 2, 3, 5, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculation_equals_plain_greedy(kind, tiny_model_dir, other_draft):
    folder = tiny_model_dir(kind)
    memory = CacheConfig.memory_only()
    plain = Engine.load(str(folder), cache=memory, speculation="none")
    engines = {"lookup": lambda depth: eager_lookup(Engine.load(
                   str(folder), cache=memory, speculation="lookup", draft_depth=depth)),
               "same model": lambda depth: Engine.load(str(folder), cache=memory,
                                                       draft=str(folder), draft_depth=depth),
               "other model": lambda depth: Engine.load(str(folder), cache=memory,
                                                        draft=str(other_draft(kind)),
                                                        draft_depth=depth)}
    rng = random.Random(kind)
    vocab = plain.model.args.vocab_size
    prompts = [copy_heavy_prompt(rng, vocab) for _ in range(3)]
    expected = {tuple(p): reply(plain, p)[:2] for p in prompts}
    for name, make in engines.items():
        drafted = accepted = rejected_rounds = 0
        for depth in DEPTHS:
            engine = make(depth)
            for prompt in prompts:
                ids, logprobs, done, _ = reply(engine, prompt)
                assert (ids, logprobs) == expected[tuple(prompt)], f"{name}, depth {depth}"
                drafted += done.drafted_tokens
                accepted += done.accepted_tokens
            done = resumed_reply(engine, plain, prompts[-1], expected[tuple(prompts[-1])][0],
                                 f"{name}, depth {depth}")
            rejected_rounds += done.drafted_tokens > done.accepted_tokens
        assert drafted > 0, f"{name} never drafted"
        if name == "same model":
            assert accepted == drafted  # a perfect drafter: every draft accepted
        if name == "other model":
            assert accepted < drafted  # rejections happened, and were rolled back exactly


class ScriptedDepths(DepthController):
    """Depths from a script (plain stretches between drafting rounds), whatever the prices;
    keeps what each round was told (depth, after_plain_step, after_round)."""

    def __init__(self, script):
        super().__init__()
        self.script = script
        self.told: list[tuple[int, bool, bool]] = []

    def choose(self, limit: int, rounds=None) -> int:
        self.rounds += 1
        return min(self.script[(self.rounds - 1) % len(self.script)], limit)

    def record(self, depth, accepted, seconds, after_plain_step=False, after_round=False,
               rounds=None):
        self.told.append((depth, after_plain_step, after_round))
        super().record(depth, accepted, seconds, after_plain_step, after_round, rounds)


@pytest.mark.parametrize("kind", KINDS)
def test_a_draft_model_catching_up_plain_stretches_changes_nothing(kind, tiny_model_dir,
                                                                    other_draft):
    # After plain steps the draft model lags the target by more than one round leaves: it
    # catches up on its own (priced apart) before drafting; the reply must not change.
    folder = tiny_model_dir(kind)
    memory = CacheConfig.memory_only()
    plain = Engine.load(str(folder), cache=memory, speculation="none")
    for draft in (str(folder), str(other_draft(kind))):
        engine = Engine.load(str(folder), cache=memory, draft=draft)
        engine._controllers["model"] = ScriptedDepths([0, 0, 0, 0, 3, 0, 0, 0, 2, 2, 0, 5])
        for seed in range(3):
            prompt = copy_heavy_prompt(random.Random(seed), plain.model.args.vocab_size)
            plain.clear_cache()  # both prefill the whole prompt alike (the restored prefix of an
            engine.clear_cache()  # earlier reply would be resumed in other chunks)
            told = engine._controllers["model"].told
            told.clear()
            ids, logprobs, done, _ = reply(engine, prompt, n=40)
            assert (ids, logprobs) == reply(plain, prompt, n=40)[:2], f"{kind}, {draft}"
            assert done.drafted_tokens > 0
            # The depth controller hears what each round followed (the prefill's step counts
            # as a plain one): a plain step right after a verify round (not priced) and a
            # round right after a plain step (priced less that step).
            before = [0] + [depth for depth, _, _ in told]
            for previous, (depth, after_plain_step, after_round) in zip(before, told):
                assert after_round == (depth == 0 and previous > 0)
                assert after_plain_step == (depth > 0 and previous == 0)


def test_tokens_say_which_came_from_drafts(tiny_model_dir):
    folder = tiny_model_dir("llama")
    engine = Engine.load(str(folder), cache=CacheConfig.memory_only(), draft=str(folder),
                         draft_depth=4)
    ids, _, done, from_draft = reply(engine, [5, 6, 7, 8], n=20)
    assert sum(from_draft) == done.accepted_tokens > 0
    assert done.drafter == "model" and done.mean_accepted > 0
    assert len(done.acceptance_by_position) == 4 and done.acceptance_by_position[0] == 1.0


def test_a_4_bit_draft_drafts_with_int8_inputs_and_changes_nothing(tiny_model_dir, tmp_path,
                                                                  native_kernels):
    """A 4-bit draft model's products round their inputs to int8 (faster, approximate): its
    drafts differ a little from exact products', the replies not at all."""
    from backend.models.cpu_linear import KernelQuantizedLinear
    from backend.weights.store import import_hf_folder

    folder = tiny_model_dir("llama")
    draft = import_hf_folder(folder, tmp_path / "q4", quantize=4)
    memory = CacheConfig.memory_only()
    plain = Engine.load(str(folder), cache=memory, speculation="none")
    spec = Engine.load(str(folder), cache=memory, draft=str(draft), draft_depth=3)
    layers = [m for _, m in spec.draft.model.named_modules()
              if isinstance(m, KernelQuantizedLinear)]
    assert layers and all(layer.int8_inputs for layer in layers)
    rng = random.Random(3)
    accepted = 0
    for _ in range(3):
        prompt = copy_heavy_prompt(rng, plain.model.args.vocab_size)
        ids, logprobs, done, _ = reply(spec, prompt, n=32)
        assert (ids, logprobs) == reply(plain, prompt, n=32)[:2]
        accepted += done.accepted_tokens
    assert accepted > 0


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    import json
    import shutil

    from backend.errors import ModelLoadError

    folder = tiny_model_dir("llama")
    other = tmp_path / "other-vocab"
    shutil.copytree(folder, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ModelLoadError, match="cannot draft for .*token"):
        Engine.load(str(folder), cache=CacheConfig.memory_only(), draft=str(other))


# -- rollback on every cache kind ------------------------------------------------------------

def _cache(kind):
    return {"kv": KVCache, "window": lambda: RotatingKVCache(6),
            "recurrent": RecurrentCache, "latent": lambda: LatentCache(12)}[kind]()


@pytest.mark.parametrize("case", ["llama", "gemma3", "qwen3_next", "qwen3_5", "qwen3_5_moe",
                                  "qwen3_5-4bit", "qwen3_5_moe-4bit", "glm4_moe_lite",
                                  "glm4_moe_lite-4bit", "gemma4", "gemma4-moe", "gemma4-4bit",
                                  "gemma4-moe-4bit"])
def test_rejected_rounds_leave_exactly_the_committed_tokens(case, tiny_model_dir):
    """Many verify rounds with random acceptance, then one step: equal (bitwise) to a fresh
    prefill of exactly the committed ids, for every cache kind the model uses."""
    model = load_model(tiny_model_dir(case)).model
    rng = random.Random(3)
    caches = model.make_caches()
    committed = [rng.randrange(3, 200) for _ in range(4)]
    model.hidden(mx.array([committed]), caches)
    for _ in range(12):
        block = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 9))]
        tx = SpeculativeWrite(caches, len(block))
        mx.eval(model.hidden(mx.array([block]), caches), [c.arrays() for c in caches])
        keep = rng.randrange(0, len(block) + 1)
        tx.commit(keep)
        committed += block[:keep]
        assert {c.offset for c in caches} == {len(committed)}
    probe = mx.array([[9]])
    got = model.logits(model.hidden(probe, caches))[0, -1]
    fresh = model.make_caches()
    for i in range(0, len(committed), 16):  # row-invariant chunks: the same state bit for bit
        model.hidden(mx.array([committed[i:i + 16]]), fresh)
    want = model.logits(model.hidden(probe, fresh))[0, -1]
    np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("kind", ["kv", "window", "recurrent", "latent"])
def test_a_thousand_rounds_leak_no_memory(kind):
    rng = random.Random(0)
    cache = _cache(kind)

    def write(n):
        if kind == "recurrent":
            bounds = cache.boundaries(n)
            conv = [mx.random.normal((1, 3, 8)) for _ in bounds]
            delta = [mx.random.normal((1, 2, 4, 4)) for _ in bounds]
            cache.advance(n, conv, delta)
        elif kind == "latent":
            cache.update(mx.random.normal((1, 1, n, 12)), mx.random.normal((1, 1, n, 4)))
        else:
            cache.update(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
        mx.eval(cache.arrays())

    write(20)

    def rounds(count):
        for _ in range(count):
            n = rng.randrange(1, 9)
            tx = SpeculativeWrite([cache], n)
            write(n)
            tx.commit(rng.randrange(0, n + 1))
            if cache.offset > 200:  # stay inside a bounded context
                cache.restore(None, 0) if cache.can_rewind_to(0) else None
                write(20)

    rounds(100)
    mx.clear_cache()
    before = mx.get_active_memory()
    rounds(1000)
    mx.clear_cache()
    assert mx.get_active_memory() <= before + 64 * 1024, (before, mx.get_active_memory())


# -- prompt lookup -----------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 8))
def test_lookup_index_finds_what_the_plain_search_finds(context, n):
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    for end in range(1, len(context) + 1):  # one growing context, as during a reply
        draft = drafter.propose(context[:end], n, None, None)
        assert (draft.known if draft else []) == lookup(context[:end], n, 3, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=40), min_size=2, max_size=6),
       st.integers(1, 8))
def test_lookup_index_follows_contexts_that_do_not_grow(contexts, n):
    """One drafter asked about unrelated contexts in turn (shorter ones: the index starts over;
    edited ones no shorter than the last: it must notice too) finds what the plain search
    finds in each."""
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    for context in contexts:
        draft = drafter.propose(context, n, None, None)
        assert (draft.known if draft else []) == lookup(context, n, 3, 1)


def test_lookup_index_notices_a_shorter_context_and_an_edit_that_keeps_the_length():
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    assert drafter.propose([1, 2, 3, 1], 2, None, None).known == [2, 3]
    assert drafter.propose([4, 5, 4], 2, None, None).known == [5, 4]  # shorter: start over
    # The same length with one id edited (a stale index would still follow 4 with 5), then
    # grown.
    assert drafter.propose([4, 6, 4], 1, None, None).known == [6]
    assert drafter.propose([4, 6, 4, 4, 6], 2, None, None).known == [4, 4]


def test_a_cold_lookup_needs_a_longer_match_until_a_proposal_is_kept():
    """In free text a two-token match is nearly always a stray one: until a proposal's first id
    was kept, prompt lookup proposes only from ``cold_min_ngram``-token matches."""
    drafter = PromptLookupDrafter(max_ngram=4, min_ngram=2, cold_min_ngram=3)
    only_a_pair = [1, 2, 3, 4, 1, 2, 3, 4, 6, 9, 4, 6]  # [4, 6] seen before, [9, 4, 6] not
    assert drafter.propose([8, 4, 6, 9, 4, 6], 2, None, None) is None
    copied = [1, 2, 3, 4, 1, 2, 3]
    assert drafter.propose(copied, 2, None, None).known == [4, 1]
    drafter.settle(copied + [4])  # its first id kept: a passage is being copied
    assert drafter.propose(only_a_pair, 2, None, None).known == [9, 4]
    drafter.settle(only_a_pair + [7])  # rejected: cold again
    assert drafter.propose(only_a_pair + [7, 4, 6], 2, None, None) is None
    # The default drafter proposes from the pair at once.
    assert PromptLookupDrafter().propose(only_a_pair, 2, None, None).known == [9, 4]

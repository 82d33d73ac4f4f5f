"""Round costs known before the first round (``backend/speculation/profile.py``).

* The engine measures them at the first drafting reply, stores them per model, dtype and machine
  in the cache dir, and a later engine (a fresh process) reuses them without measuring.
* A stored profile is measured again when it is stale: the model's weights changed, another
  Arbor version, another machine; an unreadable one too.
* Seeded with costs that say drafting pays, the first round drafts; with costs that say it does
  not, it steps plainly; and replies are the same tokens as plain decoding either way.
* Rounds of several sequences in one batched step are priced at their share of the step, and
  each reply keeps its own context between rounds (one controller serves the batch).

Behaviour only: no test here asserts how long anything took.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from backend import paths
from backend.api import DoneEvent, GenerateRequest
from backend.engine import MAX_DRAFT, Engine
from backend.feeds import Feed
from backend.memory.budgets import CacheConfig
from backend.scheduler import MAX_GROUP_ROWS, Scheduler
from backend.speculation import profile
from backend.speculation.depth import AFTER_HIT, AFTER_MISS, DepthController, Rounds
from tests.test_speculative import reply


@pytest.fixture(autouse=True)
def _own_profiles(tmp_path, monkeypatch):
    """Each test here starts with no stored profile (the session shares one elsewhere)."""
    monkeypatch.setenv("ARBOR_PROFILES_DIR", str(tmp_path / "profiles"))


def lookup_engine(folder, **kwargs) -> Engine:
    return Engine.load(str(folder), cache=CacheConfig.memory_only(), speculation="lookup",
                       **kwargs)


def stored(engine: Engine) -> dict:
    files = sorted(paths.profiles_dir().glob("*.json"))
    files = [f for f in files if f.name != "hashes.json"]
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def rewrite(mutate) -> None:
    (path,) = [f for f in paths.profiles_dir().glob("*.json") if f.name != "hashes.json"]
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))


SENTINEL = {str(d): 1.0 + d for d in range(MAX_DRAFT + 1)}  # no machine measures these


def test_the_first_drafting_reply_stores_a_profile_that_a_fresh_engine_reuses(tiny_model_dir):
    folder = tiny_model_dir("llama")
    engine = lookup_engine(folder)
    assert not paths.profiles_dir().exists() or not list(paths.profiles_dir().glob("*-*.json"))
    reply(engine, [5, 6, 7, 8, 5, 6, 7], n=6)
    data = stored(engine)
    assert sorted(int(d) for d in data["costs"]) == list(range(MAX_DRAFT + 1))
    assert all(s > 0 for s in data["costs"].values())
    assert data["key"]["machine"] == profile.machine()
    assert data["key"]["arbor"] == profile.arbor_version()
    # The controller started from them.
    measured = {int(d): s for d, s in data["costs"].items()}
    controller = engine.depth("lookup")
    assert set(controller.cost) == set(measured)

    rewrite(lambda d: d.update(costs=SENTINEL))
    fresh = lookup_engine(folder)
    assert fresh.depth("lookup").cost == {int(d): s for d, s in SENTINEL.items()}
    assert stored(fresh)["costs"] == SENTINEL  # read, not measured again


def profile_files() -> list:
    return [f for f in paths.profiles_dir().glob("*.json") if f.name != "hashes.json"] \
        if paths.profiles_dir().exists() else []


def test_prepare_settles_the_costs_so_the_first_reply_measures_nothing(tiny_model_dir):
    folder = tiny_model_dir("llama")
    plain = Engine.load(str(folder), cache=CacheConfig.memory_only(), speculation="none")
    plain.prepare()  # nothing to settle without a drafter
    assert profile_files() == []
    engine = lookup_engine(folder)
    engine.prepare()
    (path,) = profile_files()
    assert engine.depth("lookup").cost == {int(d): s for d, s in stored(engine)["costs"].items()}
    path.unlink()
    reply(engine, [5, 6, 7, 8, 5, 6, 7], n=6)
    assert profile_files() == []  # the reply neither measured nor stored them again


def test_no_profile_without_drafting_or_with_a_fixed_depth(tiny_model_dir):
    folder = tiny_model_dir("llama")
    reply(Engine.load(str(folder), cache=CacheConfig.memory_only(), speculation="none"),
          [5, 6, 7, 8], n=4)
    reply(lookup_engine(folder, draft_depth=2), [5, 6, 7, 8], n=4)
    reply(lookup_engine(folder, cost_profiles=False), [5, 6, 7, 8], n=4)
    assert not paths.profiles_dir().exists() or not [
        f for f in paths.profiles_dir().glob("*.json") if f.name != "hashes.json"]


@pytest.mark.parametrize("stale", ["arbor version", "machine", "weights", "unreadable"])
def test_a_stale_profile_is_measured_again(stale, tiny_model_dir, tmp_path, monkeypatch):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    lookup_engine(folder).depth("lookup")
    rewrite(lambda d: d.update(costs=SENTINEL))
    assert lookup_engine(folder).depth("lookup").cost[3] == 4.0  # current: reused
    if stale == "arbor version":
        rewrite(lambda d: d["key"].update(arbor="0.0.1"))
    elif stale == "machine":
        monkeypatch.setattr(profile, "machine", lambda: "another CPU x64 mlx 9.9")
    elif stale == "weights":
        (weights,) = folder.glob("*.safetensors")
        arrays = mx.load(str(weights))
        name = sorted(arrays)[0]
        arrays[name] = arrays[name] + 1
        mx.save_safetensors(str(weights), arrays)
    else:
        (path,) = [f for f in paths.profiles_dir().glob("*.json") if f.name != "hashes.json"]
        path.write_text("{not json")
    engine = lookup_engine(folder)
    costs = engine.depth("lookup").cost
    assert costs and costs != {int(d): s for d, s in SENTINEL.items()}
    data = stored(engine)
    assert data["costs"] != SENTINEL
    assert data["key"]["machine"] == profile.machine()


def seeded(folder, costs: dict[int, float]) -> Engine:
    """An engine whose stored profile says ``costs`` (as a fresh process would find it)."""
    lookup_engine(folder).depth("lookup")
    rewrite(lambda d: d.update(costs={str(k): v for k, v in costs.items()}))
    return lookup_engine(folder)


def test_the_first_round_drafts_when_the_profile_says_drafting_pays(tiny_model_dir):
    folder = tiny_model_dir("llama")
    cheap = seeded(folder, {d: 1.0 + 0.02 * d for d in range(MAX_DRAFT + 1)})
    assert cheap.depth("lookup").choose(MAX_DRAFT, Rounds()) > 0
    dear = seeded(folder, {d: 1.0 + 2.0 * d for d in range(MAX_DRAFT + 1)})
    assert dear.depth("lookup").choose(MAX_DRAFT, Rounds()) == 0
    # Without a profile the first round is a plain step (plain decoding priced first).
    assert lookup_engine(folder, cost_profiles=False).depth("lookup").choose(
        MAX_DRAFT, Rounds()) == 0


def test_a_seeded_first_reply_drafts_from_its_first_rounds_and_keeps_plain_tokens(
        tiny_model_dir):
    folder = tiny_model_dir("llama")
    plain = Engine.load(str(folder), cache=CacheConfig.memory_only(), speculation="none")
    # Every id once, then a few again: whatever comes first, the 1-gram lookup finds it.
    prompt = list(range(3, plain.model.args.vocab_size)) + [5, 6, 7]
    engine = seeded(folder, {d: 1.0 + 0.02 * d for d in range(MAX_DRAFT + 1)})
    engine.drafter_for = lambda request, lane: _one_gram_lookup()
    ids, logprobs, done, _ = reply(engine, prompt, n=3)
    assert (ids, logprobs) == reply(plain, prompt, n=3)[:2]
    assert done.drafted_tokens > 0  # a 3-token reply: only a first round can draft
    unseeded = lookup_engine(folder, cost_profiles=False)
    unseeded.drafter_for = lambda request, lane: _one_gram_lookup()
    assert reply(unseeded, prompt, n=3)[2].drafted_tokens == 0


def _one_gram_lookup():
    from backend.speculation.drafters import PromptLookupDrafter

    return PromptLookupDrafter(min_ngram=1)


def test_a_batched_step_tells_each_feed_its_share():
    caches = [object()]
    one, three = Feed(mx.array([1]), caches), Feed(mx.array([1, 2, 3]), caches, "all")
    Scheduler._share([one, three])
    assert (one.share, three.share) == (0.25, 0.75)
    alone = Feed(mx.array([1, 2]), caches, "all")
    Scheduler._share([alone])
    assert alone.share == 1.0
    chunk = Feed(mx.arange(MAX_GROUP_ROWS + 1), caches, "none")
    Scheduler._share([one, chunk])
    assert one.share is None  # a prefill chunk in the step: its time prices nothing


def test_a_round_priced_without_time_still_counts_its_acceptance():
    controller = DepthController()
    controller.record(0, 0, 1.0)
    controller.record(2, 2, None)
    assert 2 not in controller.cost and controller.reached[AFTER_MISS][:2] == [1, 1]


def test_replies_in_one_batch_keep_their_own_context():
    controller = DepthController()
    copying, free = Rounds(), Rounds()
    controller.record(0, 0, 1.0, rounds=free)
    controller.record(3, 3, 1.5, rounds=copying)
    controller.record(3, 0, 1.5, rounds=free)
    assert copying.context == AFTER_HIT and free.context == AFTER_MISS
    # The copying reply's next outcomes are judged in its own context, not the other's.
    before = list(controller.reached[AFTER_HIT])
    controller.record(3, 3, 1.5, rounds=copying)
    assert controller.reached[AFTER_HIT][0] == before[0] + 1


def test_a_concurrent_batch_of_drafting_replies_equals_their_solo_replies(tiny_model_dir):
    folder = tiny_model_dir("llama")
    plain = Engine.load(str(folder), cache=CacheConfig.memory_only(), speculation="none")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8 + i, 5, 6] for i in range(4)]
    solo = [reply(plain, p, n=16)[:2] for p in prompts]
    engine = lookup_engine(folder, max_batch=4)
    engine.drafter_for = lambda request, lane: _one_gram_lookup()
    streams = [engine.submit(GenerateRequest(prompt_ids=p, max_tokens=16, ignore_eos=True,
                                             logprobs=True, draft="lookup")) for p in prompts]
    events = [[] for _ in streams]
    while engine.step():
        for stream, seen in zip(streams, events):
            while stream.events:
                seen.append(stream.events.popleft())
    for stream, seen in zip(streams, events):
        seen.extend(stream.events)
    drafted = 0
    for seen, (ids, logprobs) in zip(events, solo):
        done = seen[-1]
        assert isinstance(done, DoneEvent)
        assert done.token_ids == ids
        assert [e.logprob for e in seen[:-1] if e.token_id >= 0] == logprobs
        drafted += done.drafted_tokens
    assert drafted > 0


class Told(DepthController):
    """A fixed depth; keeps the seconds each round was priced at."""

    def __init__(self) -> None:
        super().__init__(fixed=2)
        self.seconds: list[float | None] = []

    def record(self, depth, accepted, seconds, after_plain_step=False, after_round=False,
               rounds=None):
        self.seconds.append(seconds)
        super().record(depth, accepted, seconds, after_plain_step, after_round, rounds)


@pytest.mark.parametrize("share", [1.0, 0.25, None])
def test_a_round_is_priced_at_its_share_of_the_batched_step(share, tiny_model_dir):
    from backend.api import SamplingParams
    from backend.decoding import Decoding, Emitted, speculative_tokens
    from backend.sampling import Sampler

    engine = lookup_engine(tiny_model_dir("llama"))
    caches = engine.model.make_caches()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    logits = engine.scheduler.answer([Feed(mx.array(prompt), caches, "last")])[0][1]
    d = Decoding(engine.model, caches, Sampler(SamplingParams()), prompt, list(prompt),
                 budget=10, eos=frozenset())
    ticks = iter(range(1000))
    controller = Told()
    tokens = speculative_tokens(d, logits[-1], _one_gram_lookup(), controller,
                                clock=lambda: float(next(ticks)))
    answer = None
    for item in iter(lambda: tokens.send(answer), None):
        if isinstance(item, Emitted):
            answer = None
            continue
        item.share = share  # as the scheduler says when several sequences share the step
        answer = engine.scheduler.answer([item])[0]
    assert controller.seconds  # every round lasted 1 tick of the fake clock
    assert all(s == (None if share is None else share) for s in controller.seconds)

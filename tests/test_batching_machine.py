"""Random traffic through the scheduler: requests arriving at random steps, random lengths,
greedy and seeded sampling, stop strings, cancellations, shared system prompts, drafting
(prompt lookup, a draft model, the MTP head) or plain, small prefix-cache budgets. Every
completed reply equals its solo reply bit for bit (ids and log-probabilities; a cancelled one
is a prefix of it); the prefix cache's invariants and budgets hold after every step.

Speculative sampling draws from the random stream as its rounds go, so the draft depth is
fixed per example (the controller's choice depends on measured time); forwards of at most 16
tokens make replies independent of which prefix-cache state they resumed from.
"""

from __future__ import annotations

import random
import threading

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from backend.api import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from backend.engine import Engine
from backend.memory.budgets import CacheBudgets, CacheConfig

KIB = 1024
EXACT_CHUNK = 16
# (tiny model, drafters it can use)
SETUPS = [("llama", ("none", "lookup", "model")), ("gemma3", ("none", "lookup", "model")),
          ("qwen3_next-mtp", ("none", "lookup", "mtp")), ("qwen3_moe", ("none", "lookup"))]


def reply_of(events: list) -> tuple[list[int], list[float], str]:
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]
    done = [e for e in events if isinstance(e, DoneEvent)]
    return ([e.token_id for e in tokens], [e.logprob for e in tokens],
            done[0].finish_reason if done else "")


class BatchingMachine(RuleBasedStateMachine):
    folders: dict = {}  # filled by the test with the tiny model folders

    @initialize(setup=st.sampled_from(SETUPS), data=st.data(),
                max_batch=st.sampled_from([2, 3, 4]), depth=st.integers(1, 4),
                device=st.sampled_from([4, 64, 4096]), host=st.sampled_from([0, 64]),
                seed=st.integers(0, 10_000))
    def setup(self, setup, data, max_batch, depth, device, host, seed):
        kind, drafters = setup
        self.drafter = data.draw(st.sampled_from(drafters))
        self.folder = self.folders[kind]
        draft = str(self.folder) if self.drafter == "model" else None
        speculation = {"none": "none", "lookup": "lookup", "model": "model", "mtp": "mtp"}[
            self.drafter]
        options = dict(prefill_chunk=EXACT_CHUNK, draft=draft, speculation=speculation,
                       draft_depth=depth)
        self.engine = Engine.load(str(self.folder), cache=CacheConfig(
            CacheBudgets(device * KIB, host * KIB, 0), None), max_batch=max_batch, **options)
        self.solo_engine = Engine.load(str(self.folder), cache=CacheConfig(
            CacheBudgets(0, 0, 0), None), **options)
        self.rng = random.Random(seed)
        vocab = self.engine.model.args.vocab_size
        self.systems = [[self.rng.randrange(3, vocab - 1) for _ in range(20)] for _ in range(2)]
        self.vocab = vocab
        self.live: list[dict] = []
        self.ended: list[dict] = []

    @rule(shared=st.booleans(), n=st.integers(1, 30), max_tokens=st.integers(1, 12),
          sampled=st.booleans(), stop=st.booleans())
    def submit(self, shared, n, max_tokens, sampled, stop):
        prompt = (self.rng.choice(self.systems) if shared else []) + [
            self.rng.randrange(3, self.vocab - 1) for _ in range(n)]
        sampling = (SamplingParams(temperature=0.8, top_p=0.95, seed=self.rng.randrange(1000))
                    if sampled else SamplingParams())
        request = GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, sampling=sampling,
                                  logprobs=True, ignore_eos=self.rng.random() < 0.5,
                                  stop=("e",) if stop else ())
        cancel = threading.Event()
        self.live.append(dict(request=request, cancel=cancel, events=[],
                              stream=self.engine.submit(request, cancel)))

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()
            self._drain()
            self.engine.prefix.check_invariants()
            assert self.engine.prefix.within_budgets(), self.engine.cache_stats()

    @rule(i=st.integers(0, 10))
    def cancel(self, i):
        if self.live:
            self.live[i % len(self.live)]["cancel"].set()

    def _drain(self):
        for entry in list(self.live):
            stream = entry["stream"]
            while stream.events:
                entry["events"].append(stream.events.popleft())
            assert stream.error is None, stream.error
            if stream.done:
                self.live.remove(entry)
                self.ended.append(entry)

    @invariant()
    def consistent(self):
        if getattr(self, "engine", None) is not None:
            assert self.engine.prefix.faults == 0

    def teardown(self):
        if getattr(self, "engine", None) is None:
            return
        while self.engine.step() or self.live:
            self._drain()
        self._drain()
        self.engine.prefix.check_invariants()
        assert not self.engine.prefix.running
        for entry in self.ended:
            ids, logprobs, finish = reply_of(entry["events"])
            want = reply_of(list(self.solo_engine.generate(entry["request"])))
            if entry["cancel"].is_set() and finish == "cancelled":
                assert ids == want[0][:len(ids)] and logprobs == want[1][:len(ids)]
            else:
                assert (ids, logprobs, finish) == want, entry["request"]


def test_random_traffic_equals_solo_replies(tiny_model_dir):
    BatchingMachine.folders = {kind: tiny_model_dir(kind) for kind, _ in SETUPS}
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(BatchingMachine, settings=settings(
        max_examples=16, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))

"""Where a reply's cached prompt tokens came from adds up: over random conversations on the real
engine (tiny model, small tier budgets so states move between device, host and disk; switches,
regenerations, prefetches, restarts), every ``DoneEvent``'s ``cached_by_tier`` sums to its
``cached_tokens`` ("live" included), names only known sources, and a prefetched state is credited
to the tier the prefetch read it from."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from backend.api import DoneEvent, GenerateRequest, SamplingParams
from backend.engine import Engine
from backend.memory.budgets import CacheBudgets, CacheConfig

KIB = 1 << 10
SOURCES = {"live", "device", "host", "disk"}


class StatsMachine(RuleBasedStateMachine):
    folder: Path

    @initialize(device=st.sampled_from([0, 16, 64]), host=st.sampled_from([0, 16]),
                seed=st.integers(0, 10_000))
    def setup(self, device, host, seed):
        self.tmp = tempfile.TemporaryDirectory()
        self.config = CacheConfig(CacheBudgets(device * KIB, host * KIB, 4096 * KIB),
                                  Path(self.tmp.name), capture_interval=16, pre_end=4)
        self.engine = Engine.load(str(self.folder), cache=self.config)
        self.rng = random.Random(seed)
        self.chats: list[list[dict]] = []
        self.done: list[DoneEvent] = []
        self.prefetched = 0

    def _words(self) -> str:
        return " ".join(self.rng.choice(["garden", "river", "lantern", "gate", "winter", "old"])
                        for _ in range(self.rng.randrange(2, 7)))

    def _reply(self, messages: list[dict]) -> str:
        request = GenerateRequest(messages=messages, max_tokens=self.rng.randrange(1, 5),
                                  sampling=SamplingParams(temperature=1.0, seed=self.rng.randrange(100)))
        done = list(self.engine.generate(request))[-1]
        self.done.append(done)
        return done.text

    @rule()
    def new_chat(self):
        messages = [{"role": "user", "content": self._words()}]
        self.chats.append(messages + [{"role": "assistant", "content": self._reply(messages)}])

    @rule(i=st.integers(0, 50))
    def next_turn(self, i):
        if self.chats:
            chat = self.chats[i % len(self.chats)]
            chat.append({"role": "user", "content": self._words()})
            chat.append({"role": "assistant", "content": self._reply(chat)})

    @rule(i=st.integers(0, 50))
    def regenerate(self, i):
        if self.chats:
            self._reply(self.chats[i % len(self.chats)][:-1])

    @rule(i=st.integers(0, 50))
    def open_then_send(self, i):
        """What the app does on opening a chat: prefetch, then the user's next turn."""
        if self.chats:
            chat = self.chats[i % len(self.chats)]
            self.prefetched += self.engine.prefetch(messages=chat)
            chat.append({"role": "user", "content": self._words()})
            chat.append({"role": "assistant", "content": self._reply(chat)})

    @rule()
    def restart(self):
        self.engine.close()
        self.engine = Engine.load(str(self.folder), cache=self.config)

    @invariant()
    def tiers_add_up(self):
        for done in getattr(self, "done", []):
            assert set(done.cached_by_tier) <= SOURCES, done.cached_by_tier
            assert all(n >= 0 for n in done.cached_by_tier.values()), done.cached_by_tier
            assert sum(done.cached_by_tier.values()) == done.cached_tokens, \
                (done.cached_by_tier, done.cached_tokens)

    def teardown(self):
        if hasattr(self, "engine"):
            self.engine.close()
            self.tmp.cleanup()


def test_cached_tokens_by_tier_always_sum_to_the_cached_count(tiny_model_dir):
    from hypothesis.stateful import run_state_machine_as_test

    StatsMachine.folder = tiny_model_dir("llama")
    run_state_machine_as_test(StatsMachine, settings=settings(
        max_examples=12, stateful_step_count=12, deadline=None,
        suppress_health_check=list(HealthCheck)))


def test_a_prefetch_is_credited_to_the_tier_it_read_from(tiny_model_dir, tmp_path):
    """After a restart the chat's state is on disk only: the prefetch moves it to the device,
    and the reply that uses it names the disk."""
    folder = tiny_model_dir("llama")
    config = CacheConfig(CacheBudgets(1 << 30, 1 << 30, 1 << 30), tmp_path, capture_interval=16, pre_end=4)
    chat = [{"role": "user", "content": "Tell me about the garden behind the old house."}]
    engine = Engine.load(str(folder), cache=config)
    first = list(engine.generate(GenerateRequest(messages=chat, max_tokens=4)))[-1]
    engine.close()
    engine = Engine.load(str(folder), cache=config)
    chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the gate?"}]
    assert engine.prefetch(messages=chat) > 0
    done = list(engine.generate(GenerateRequest(messages=chat, max_tokens=4)))[-1]
    engine.close()
    assert done.cached_by_tier.get("disk", 0) > 0 and done.cached_by_tier.get("device", 0) == 0
    assert sum(done.cached_by_tier.values()) == done.cached_tokens

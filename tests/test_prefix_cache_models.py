"""The prefix cache with real tiny models, one per cache kind: full attention (Llama), a sliding
window that wraps (Gemma 3, window 8), hybrid recurrent (Qwen3-Next), latent attention
(GLM-4.7-Flash, its Hugging Face checkpoint and an mlx-community 4-bit folder on the quantized
kernels); and every Qwen3.5 row: dense and MoE, Hugging Face checkpoints whose MTP head drafts
(its caches are stored alongside) and mlx-community 4-bit folders on the quantized kernels;
and every Gemma 4 layout (KV-shared layers whose keys are stored once, with a wrapping window;
the MoE layout), Hugging Face and mlx-community 4-bit.

Exactness contract. With forwards of at most 16 tokens (``prefill_chunk=16``; such blocks are
row-invariant, tests/test_row_invariance.py) every position's state is computed alike whatever
came before, so a reply must be *bit for bit* the reply of
a process that never switched: same token ids, same log-probabilities, whatever sequence of
conversations, switches, regenerations, evictions, tier moves, corrupted files and restarts
came first. (With the default chunked prefill a fresh prefill runs other matrix kernels than
the decode steps that produced a reply's cache; ``test_fresh_prefill_agrees_within_tolerance``
states that weaker contract.)
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from backend.api import DoneEvent, GenerateRequest, TokenEvent
from backend.engine import Engine
from backend.memory.budgets import CacheBudgets, CacheConfig

KINDS = ("llama", "gemma3", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5-4bit",
         "qwen3_5_moe-4bit", "glm4_moe_lite", "glm4_moe_lite-4bit", "gemma4", "gemma4-moe",
         "gemma4-4bit", "gemma4-moe-4bit")
KIB = 1024
#: Forwards of at most 16 tokens are row-invariant (tests/test_row_invariance.py): a position's
#: state is then the same however the prompt was cut into chunks or decoded.
EXACT_CHUNK = 16


def run(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float], DoneEvent]:
    """Greedy reply of ``n`` tokens with the model's log-probabilities."""
    ids, logprobs, done = [], [], None
    request = GenerateRequest(prompt_ids=prompt, max_tokens=n, ignore_eos=True, logprobs=True)
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
        elif isinstance(event, TokenEvent) and event.token_id >= 0:
            ids.append(event.token_id)
            logprobs.append(event.logprob)
    return ids, logprobs, done


def reference(folder: Path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The never-switched reply: a fresh engine that stores nothing, one prefill."""
    engine = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                         prefill_chunk=EXACT_CHUNK)
    ids, logprobs, _ = run(engine, prompt, n)
    return ids, logprobs


@pytest.mark.parametrize("kind", KINDS)
def test_small_forwards_do_not_depend_on_history(kind, tiny_model_dir):
    """The reference above is sound: a conversation kept live turn after turn gives bitwise the
    replies of fresh prefills of the same ids."""
    folder = tiny_model_dir(kind)
    live = Engine.load(str(folder), cache=CacheConfig.memory_only(), prefill_chunk=EXACT_CHUNK)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 200) for _ in range(10)]
    for turn in range(3):
        ids, logprobs, done = run(live, prompt, 5)
        if turn:
            assert done.cached_tokens == len(prompt) - 4  # the last reply token was never fed
        assert (ids, logprobs) == reference(folder, prompt, 5)
        prompt = prompt + ids + [rng.randrange(3, 200) for _ in range(3)]


class ConversationMachine(RuleBasedStateMachine):
    """Random conversations over one engine with small budgets; every reply is checked against
    the never-switched reply, bit for bit."""

    kind = "llama"
    folder: Path
    served: dict[str, int]  # prompt tokens restored per source, over every example

    @initialize(device=st.sampled_from([0, 8, 64]), host=st.sampled_from([0, 8, 64]),
                disk=st.sampled_from([0, 24, 4096]), seed=st.integers(0, 10_000))
    def setup(self, device, host, disk, seed):
        self.tmp = tempfile.TemporaryDirectory()
        self.config = CacheConfig(CacheBudgets(device * KIB, host * KIB, disk * KIB),
                                  Path(self.tmp.name), capture_interval=16, pre_end=4)
        self.engine = self._engine()
        self.rng = random.Random(seed)
        self.systems = [[self.rng.randrange(3, 200) for _ in range(12)] for _ in range(2)]
        self.convs: list[list[int]] = []

    def _engine(self) -> Engine:
        return Engine.load(str(self.folder), cache=self.config, prefill_chunk=EXACT_CHUNK)

    def _reply(self, prompt: list[int]) -> list[int]:
        n = self.rng.randrange(1, 5)
        ids, logprobs, done = run(self.engine, prompt, n)
        assert (ids, logprobs) == reference(self.folder, prompt, n), \
            f"reply after restoring {done.cached_by_tier} differs from the never-switched one"
        for tier, n in done.cached_by_tier.items():
            self.served[tier] = self.served.get(tier, 0) + n
        return ids

    def _user(self) -> list[int]:
        return [self.rng.randrange(3, 200) for _ in range(self.rng.randrange(2, 6))]

    @rule(system=st.integers(0, 1))
    def new_conversation(self, system):
        prompt = self.systems[system] + self._user()
        self.convs.append(prompt + self._reply(prompt))

    @rule(i=st.integers(0, 100))
    def next_turn(self, i):
        if self.convs:
            i %= len(self.convs)
            prompt = self.convs[i] + self._user()
            self.convs[i] = prompt + self._reply(prompt)

    @rule(i=st.integers(0, 100), back=st.integers(1, 6))
    def regenerate_or_edit(self, i, back):
        if self.convs:
            conv = self.convs[i % len(self.convs)]
            prompt = conv[:max(2, len(conv) - back)]
            self._reply(prompt)

    @rule()
    def restart(self):
        self.engine.close()
        self.engine = self._engine()

    @rule(which=st.integers(0, 1000))
    def corrupt_a_file(self, which):
        files = sorted(Path(self.tmp.name).glob("*/nodes/*.safetensors"))
        if files:
            victim = files[which % len(files)]
            data = bytearray(victim.read_bytes())
            data[which % len(data)] ^= 0x40
            victim.write_bytes(bytes(data))

    @invariant()
    def within_budgets(self):
        if hasattr(self, "engine"):
            self.engine.prefix.check_invariants()
            assert self.engine.prefix.within_budgets(), self.engine.cache_stats()

    def teardown(self):
        if hasattr(self, "engine"):
            self.engine.close()
            self.tmp.cleanup()


@pytest.fixture
def _models(tiny_model_dir):
    return {kind: tiny_model_dir(kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_random_conversations_equal_never_switched_replies(kind, _models):
    machine = type(f"Conversations_{kind}", (ConversationMachine,),
                   {"kind": kind, "folder": _models[kind], "served": {}})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=12, stateful_step_count=25, deadline=None, database=None,
        derandomize=True, suppress_health_check=list(HealthCheck)))
    # Restores really happened (test_every_tier_serves_... covers each tier surely).
    assert machine.served.get("live", 0) > 0, machine.served
    assert sum(machine.served.get(t, 0) for t in ("device", "host", "disk")) > 0, machine.served


@pytest.mark.parametrize("kind", KINDS)
def test_every_tier_serves_and_replies_stay_exact(kind, tiny_model_dir, tmp_path):
    """A fixed script that surely moves state through host and disk and restarts."""
    folder = tiny_model_dir(kind)
    config = CacheConfig(CacheBudgets(0, 256 * KIB, 1 << 20), tmp_path, capture_interval=16)
    engine = Engine.load(str(folder), cache=config, prefill_chunk=EXACT_CHUNK)
    rng = random.Random(1)
    system = [rng.randrange(3, 200) for _ in range(12)]
    convs = [system + [rng.randrange(3, 200) for _ in range(4)] for _ in range(4)]
    tiers: dict[str, int] = {}
    for turn in range(3):
        for c, prompt in enumerate(convs):
            ids, logprobs, done = run(engine, prompt, 3)
            assert (ids, logprobs) == reference(folder, prompt, 3)
            if turn:
                assert done.cached_tokens == len(prompt) - 4  # all but the new user turn
            for tier, n in done.cached_by_tier.items():
                tiers[tier] = tiers.get(tier, 0) + n
            convs[c] = prompt + ids + [rng.randrange(3, 200) for _ in range(3)]
        if turn == 1:
            engine.close()
            engine = Engine.load(str(folder), cache=config, prefill_chunk=EXACT_CHUNK)
    assert tiers["host"] > 0 and tiers["disk"] > 0, tiers
    assert engine.prefix.within_budgets()
    engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_prefill_agrees_within_tolerance(kind, tiny_model_dir, tmp_path):
    """Default chunked prefill: a conversation resumed from the disk tier (whose reply states
    came from decode steps) against one fresh prefill of the same ids: same greedy tokens,
    log-probabilities within 1e-4 (float32), and the top-2 gap is reported for near ties."""
    folder = tiny_model_dir(kind)
    config = CacheConfig(CacheBudgets(0, 0, 1 << 20), tmp_path)
    engine = Engine.load(str(folder), cache=config)
    rng = random.Random(2)
    prompt = [rng.randrange(3, 200) for _ in range(40)]
    for _ in range(3):
        ids, _, _ = run(engine, prompt, 6)
        prompt = prompt + ids + [rng.randrange(3, 200) for _ in range(5)]
    engine.close()
    resumed_engine = Engine.load(str(folder), cache=config)
    ids, logprobs, done = run(resumed_engine, prompt, 6)
    assert done.cached_by_tier["disk"] > 0
    fresh = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 0, 0), None))
    fresh_ids, fresh_logprobs, fresh_done = run(fresh, prompt, 6)
    assert fresh_done.cached_tokens == 0
    assert ids == fresh_ids
    assert np.allclose(logprobs, fresh_logprobs, atol=1e-4, rtol=0), \
        np.abs(np.array(logprobs) - np.array(fresh_logprobs)).max()
    resumed_engine.close()

"""Faults inside the prefix cache never fail a turn and never leave it inconsistent.

A fixed scenario (two conversations sharing a system prompt, a branch that splits a node,
evictions to disk, a resume from disk, a restart, a prefetch) runs over fake caches that hold
token ids (tests/fixtures/fake_caches.py), once per call site with a fault injected at that
call, for every call the scenario makes there:

* every SQLite and file call of the disk tier (``DiskIO`` and its connection): the disk is
  full, or the index is corrupt;
* every step of the prefix cache's own operations (``_split``, ``begin``, ``commit``,
  ``persist`` and what they call on the caches, the trie and the tier ledger), raising before
  the step or after it has done its work.

After each operation the trie's invariant checker holds, the live caches hold exactly what
the prefix cache says they hold, every restore brings back exactly the prompt's first tokens,
and budgets hold; once the fault is gone the next request is served (from the cache again,
for disk faults, without a restart).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from backend.memory.budgets import CacheBudgets
from backend.memory.disk import DiskStore, RetryPolicy
from backend.memory.prefix_cache import PrefixCache
from tests.fixtures import fake_caches
from tests.fixtures.fake_caches import LAYOUTS, leaked_snapshots, stored_snapshots
from tests.fixtures.faults import (CORRUPT, DISK_FULL, FaultPlan, FaultyIO, InjectedFault,
                                   disk_error, wrap_methods)

SYSTEM = list(range(100, 130))
A = SYSTEM + [1] * 6
B = SYSTEM + [2] * 6
# A device budget for about one conversation, no host tier: states go through the disk.
BUDGETS = CacheBudgets(device_bytes=60 * fake_caches.KV_BYTES_PER_TOKEN * 4, host_bytes=0,
                       disk_bytes=1 << 30)
HOST_TOO = CacheBudgets(0, 1 << 30, 1 << 30)
SMALL_DISK = CacheBudgets(0, 0, 3000)
pytestmark = pytest.mark.cache_faults
NO_WAIT = RetryPolicy(first_s=0.0, most_s=0.0)  # a degraded disk tier retries at every write


class Driver:
    """Drives a prefix cache the way the engine does, asserting what must hold after any
    fault: consistency, restores that bring back exactly the prompt's first tokens, caches
    that hold what the prefix cache says they hold."""

    def __init__(self, layout: str, root: Path, plan: FaultPlan) -> None:
        self.layout, self.root, self.plan = layout, root, plan
        self.retired: list[PrefixCache] = []
        self.caches_of: dict[int, list] = {}
        self.open()

    def open(self) -> None:
        self.caches = LAYOUTS[self.layout]()
        store = DiskStore(self.root, "fake-model", io=FaultyIO(self.plan), retry=NO_WAIT)
        self.pc = PrefixCache(self.caches, BUDGETS, store, capture_interval=8, pre_end=4)
        self.caches_of[id(self.pc)] = self.caches
        self.check()

    def check(self) -> None:
        self.pc.check_invariants()
        assert self.pc.within_budgets(), self.pc.stats()
        for cache in self.caches:
            assert cache.held() == list(self.pc.live), f"{cache.kind} holds other tokens"

    def request(self, prompt: list[int], reply: list[int]):
        resume = self.pc.begin(prompt)
        for cache in self.caches:
            assert cache.held() == prompt[:resume.cached], f"{cache.kind} after restore"
        self.pc.check_invariants()
        for cache in self.caches:
            cache.write(prompt[resume.cached:-1])
            cache.write(prompt[-1:])
        self.pc.attach_captures(prompt)
        self.pc.check_invariants()
        for token in reply:
            for cache in self.caches:
                cache.write([token])
        self.pc.commit(prompt + reply)
        assert list(self.pc.live) in ([], prompt + reply)
        self.check()
        return resume

    def restart(self) -> None:
        self.pc.close()
        self.retired.append(self.pc)
        self.open()

    def scenario(self) -> None:
        self.request(A, [5, 6])
        self.request(B, [7])  # a branch: the stored A is split at the system prompt's end
        self.request(A + [5, 6, 3], [8])  # A again, from the tiers
        self.pc.persist()
        self.check()
        self.restart()
        self.request(B + [7, 4], [9])  # from disk, after a restart
        self.pc.prefetch(A + [5, 6, 3, 8, 1])
        self.check()
        self.request(A + [5, 6, 3, 8, 1], [2])
        self.pc.set_budgets(HOST_TOO)  # copies move down to the host tier
        self.check()
        self.request(B + [7, 4, 9, 3], [3])
        self.pc.set_budgets(SMALL_DISK)  # and out of the disk: old leaves are dropped
        self.check()
        self.pc.set_budgets(BUDGETS)

    def leaks(self) -> list:
        held = [s for pc in self.retired + [self.pc] for s in stored_snapshots(pc)]
        held += [s for pc in self.retired + [self.pc] for c in self.caches_of[id(pc)]
                 for s in c._lazy]
        return leaked_snapshots(held)


def record_sites(layout: str, tmp_path: Path, setup=None) -> FaultPlan:
    """The calls the scenario makes, per site, without faults."""
    plan = FaultPlan()
    driver = Driver(layout, tmp_path / "record", plan)
    if setup is not None:
        setup(driver, plan)
    driver.scenario()
    counts = plan.counts.copy()
    driver.pc.close()
    assert not driver.leaks()
    plan.counts = counts
    return plan


# -- the disk tier: every SQLite and file call ------------------------------------------------
FILE_SITES = ["mkdir", "open_lock", "write_file", "replace", "read_file", "unlink", "listdir"]
SQL_SITES = ["connect", "sql:PRAGMA", "sql:CREATE", "sql:SELECT", "sql:INSERT", "sql:UPDATE",
             "sql:DELETE", "commit"]
# Files fail with OSErrors (a full disk); SQLite says "full" or "corrupt".
DISK_CASES = ([(site, DISK_FULL) for site in FILE_SITES + SQL_SITES]
              + [(site, CORRUPT) for site in SQL_SITES])


@pytest.fixture(autouse=True)
def _fresh_snapshots():
    fake_caches.SNAPSHOTS.clear()
    yield


@pytest.mark.parametrize("site,flavour", DISK_CASES, ids=[f"{s}-{f}" for s, f in DISK_CASES])
def test_a_disk_fault_at_any_call_costs_speed_never_a_turn(site, flavour, tmp_path, caplog):
    layout = "mixed"
    counts = record_sites(layout, tmp_path).counts
    assert site in counts, f"the scenario never reaches {site}: {dict(counts)}"
    for n in range(1, counts[site] + 1):
        caplog.clear()
        fake_caches.SNAPSHOTS.clear()
        plan = FaultPlan(lambda s: disk_error(s, flavour))
        plan.arm(site, n)
        driver = Driver(layout, tmp_path / f"{site}-{n}", plan)
        with caplog.at_level(logging.WARNING, logger="backend.memory"):
            driver.scenario()
        assert plan.fired == 1, f"call {n} of {site} was not reached"
        assert driver.pc.faults == 0, "the disk tier let a fault through to the prefix cache"
        lines = [r for r in caplog.records if r.name == "backend.memory.disk"
                 and "checksum" not in r.getMessage()]
        assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]  # the fault, the recovery
        # The fault is gone: the tier stores again without a restart, and serves what it stores.
        follow = A + [5, 6, 3, 8, 1, 2, 9]
        driver.request(follow, [4])
        assert driver.pc.disk.mode == "on", driver.pc.disk.note
        driver.restart()
        resume = driver.request(follow + [4, 6], [1])
        assert resume.by_tier["disk"] > 0, resume
        driver.pc.close()
        assert not driver.leaks()


def test_a_disk_that_stays_full_serves_every_turn_then_comes_back(tmp_path, caplog):
    """Every write fails for a while (one log line for it, not one per request); replies go on
    from memory; once there is room the tier stores again by itself."""
    plan = FaultPlan()
    driver = Driver("full", tmp_path, plan)
    plan.arm("write_file", 1, persistent=True)
    with caplog.at_level(logging.WARNING, logger="backend.memory"):
        for i in range(6):
            driver.request(SYSTEM + [i] * 5, [i])
            driver.pc.persist()
            assert driver.pc.disk.mode == "read-only"
    assert plan.fired >= 6  # it kept trying (no wait in this test's retry policy)
    full = [r for r in caplog.records if "full" in r.getMessage()]
    assert len(full) == 1, [r.getMessage() for r in caplog.records]
    assert driver.pc.stats().disk_mode == "read-only" and "full" in driver.pc.stats().disk_note
    plan.heal()
    driver.request(SYSTEM + [9] * 5, [9])
    driver.pc.persist()
    stats = driver.pc.stats()
    assert stats.disk_mode == "on" and stats.disk_note == "" and stats.tiers["disk"].entries > 0
    driver.pc.close()


def test_a_nearly_full_disk_that_flaps_is_said_once(tmp_path, caplog):
    """Small writes go through and big ones fail, turn after turn: one line that the disk is
    full and one that it stores again, not a pair per request."""

    class EveryOtherWrite(FaultPlan):
        def hit(self, site: str) -> None:
            self.counts[site] += 1
            if site == "write_file" and self.counts[site] % 2 == 0:
                raise disk_error(site)

    driver = Driver("full", tmp_path, EveryOtherWrite())
    with caplog.at_level(logging.WARNING, logger="backend.memory"):
        for i in range(8):
            driver.request(SYSTEM + [i] * 5, [i])
            driver.pc.persist()
    lines = [r.getMessage() for r in caplog.records if r.name == "backend.memory.disk"]
    assert len(lines) == 2 and "full" in lines[0] and "again" in lines[1], lines
    driver.pc.close()


def test_retries_back_off_while_the_disk_stays_full(tmp_path):
    now = [0.0]
    plan = FaultPlan()
    plan.arm("write_file", 1, persistent=True)
    store = DiskStore(tmp_path, "m", io=FaultyIO(plan), retry=RetryPolicy(1.0, 4.0),
                      clock=lambda: now[0])
    attempts = []
    for t in [0, 0.5, 1.0, 1.5, 2.9, 3.0, 6.9, 7.0, 10.9, 11.0]:
        now[0] = t
        before = plan.counts["write_file"]
        store.write(f"n{t}", None, 0, [1], [], 1)
        if plan.counts["write_file"] > before:
            attempts.append(t)
    assert attempts == [0, 1.0, 3.0, 7.0, 11.0]  # waits of 1, 2, 4, then at most 4 seconds
    store.close()


# -- the prefix cache's own steps -------------------------------------------------------------
CACHE_STEPS = ["restore", "reserve", "prepare_snapshots", "take_snapshots", "cancel_snapshots",
               "split", "snapshot", "export_snapshot", "import_snapshot", "free"]
TRIE_STEPS = ["split", "add_child", "remove_leaf", "lock", "unlock", "touch"]
LEDGER_STEPS = ["set_device", "drop_device", "set_host", "drop_host", "set_disk", "drop_disk"]
OWN_STEPS = ["_split", "_load_device", "_write_disk", "_record_segment", "_attach", "_restore",
             "_enforce_budgets", "_new_data", "_add_layers", "_relock", "_touch"]
STORE_STEPS = ["read", "write", "delete", "touch", "set_parent"]
STEPS = ([("cache", s) for s in CACHE_STEPS] + [("trie", s) for s in TRIE_STEPS]
         + [("ledger", s) for s in LEDGER_STEPS] + [("cache-own", s) for s in OWN_STEPS]
         + [("store", s) for s in STORE_STEPS])


def _instrument(plan: FaultPlan, after: bool):
    def setup(driver: Driver, plan_=plan) -> None:
        pc = driver.pc
        for cache in driver.caches:
            wrap_methods(cache, CACHE_STEPS, plan_, "cache.", after)
        wrap_methods(pc.trie, TRIE_STEPS, plan_, "trie.", after)
        wrap_methods(pc.tiers, LEDGER_STEPS, plan_, "ledger.", after)
        wrap_methods(pc, OWN_STEPS, plan_, "cache-own.", after)
        wrap_methods(pc.disk, STORE_STEPS, plan_, "store.", after)
    return setup


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("owner,step", STEPS, ids=[f"{o}.{s}" for o, s in STEPS])
def test_a_fault_at_any_step_leaves_the_trie_consistent(owner, step, after, tmp_path, caplog):
    site = f"{owner}.{step}"
    layout = "mixed"

    def fault(_site):
        return InjectedFault(f"injected at {_site}")

    recorder = FaultPlan(fault)
    driver = _instrumented_driver(layout, tmp_path / "record", recorder, after)
    driver.scenario()
    assert driver.pc.faults == 0
    calls = recorder.counts[site]
    assert calls, f"the scenario never calls {site}: {dict(recorder.counts)}"
    for n in range(1, calls + 1):
        fake_caches.SNAPSHOTS.clear()
        plan = FaultPlan(fault)
        driver = _instrumented_driver(layout, tmp_path / f"{site}-{n}", plan, after)
        plan.arm(site, n)
        with caplog.at_level(logging.CRITICAL, logger="backend.memory"):
            driver.scenario()
        assert plan.fired == 1, f"call {n} of {site} was not reached"
        faults = sum(pc.faults for pc in driver.retired + [driver.pc])
        assert faults == 1, f"{faults} faults recovered"
        plan.heal()
        follow = A + [5, 6, 3, 8, 1, 2, 9]
        driver.request(follow, [4])  # served: the driver checks every token it restores
        resume = driver.request(follow + [4, 6], [1])
        assert resume.cached >= len(follow) + 1, "the cache serves again after the fault"
        driver.pc.clear()
        assert all(not s.is_lazy for s in driver.leaks()), "a lost snapshot still views a cache"


def _instrumented_driver(layout: str, root: Path, plan: FaultPlan, after: bool) -> Driver:
    """A driver whose caches, trie, ledger, store and prefix-cache steps all pass ``plan``
    (the store's own start-up is not what these tests fault: ``DiskIO`` covers it)."""
    plan.enabled = False
    driver = Driver(layout, root, plan)
    _instrument(plan, after)(driver)
    plain_open = Driver.open

    def reopen() -> None:
        enabled, plan.enabled = plan.enabled, False
        plain_open(driver)
        _instrument(plan, after)(driver)
        plan.enabled = enabled

    driver.open = reopen
    plan.enabled = True
    return driver



# -- the real engine: a fault inside a real cache's step --------------------------------------
REAL_STEPS = ["split", "import_snapshot", "export_snapshot", "restore", "take_snapshots"]


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3_next"])
def test_a_fault_in_a_real_cache_costs_a_recompute_not_the_reply(kind, tiny_model_dir, tmp_path):
    """Every step above, faulted at each of its calls in turn on the model's own caches: each
    reply equals the reply of an engine that stores nothing, and the cache stays consistent."""
    from backend.api import DoneEvent, GenerateRequest
    from backend.engine import Engine
    from backend.memory.budgets import CacheConfig

    folder = tiny_model_dir(kind)
    budgets = CacheBudgets(device_bytes=6 * 1024, host_bytes=6 * 1024, disk_bytes=1 << 30)

    def reply(engine, prompt):
        request = GenerateRequest(prompt_ids=prompt, max_tokens=4, ignore_eos=True)
        return next(e for e in engine.generate(request) if isinstance(e, DoneEvent)).token_ids

    cold = Engine.load(str(folder), cache=CacheConfig(CacheBudgets(0, 0, 0), None),
                       prefill_chunk=16)
    system = list(range(3, 40))
    prompts = [system + [50, 51], system + [60, 61, 62], system + [50, 51, 70]]
    expected = [reply(cold, p) for p in prompts]
    fired = {}
    for step in REAL_STEPS:
        for n in (1, 2, 3):
            plan = FaultPlan(lambda site: InjectedFault(site))
            engine = Engine.load(str(folder), cache=CacheConfig(budgets, tmp_path / f"{step}{n}"),
                                 prefill_chunk=16)
            for cache in engine.caches:
                wrap_methods(cache, [step], plan, "cache.")
            plan.arm(f"cache.{step}", n)
            for prompt, want in zip(prompts + prompts, expected + expected):
                assert reply(engine, prompt) == want, (step, n)
                engine.prefix.check_invariants()
            assert engine.prefix.faults == plan.fired <= 1
            fired[step] = fired.get(step, 0) + plan.fired
            engine.close()
    assert all(fired[step] for step in REAL_STEPS if step != "split"), fired

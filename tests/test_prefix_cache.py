"""The prefix trie and its tiers, with fake caches that hold token ids (tests/fixtures/fake_caches).

Every test runs on four layouts (full attention, sliding window, recurrent, mixed) and asserts
which token ids each layer holds after each request. After every operation the prefix cache's
invariant checker runs, and at teardown every snapshot must be closed exactly once or still
stored (no leaks, no double closes).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from backend.memory.budgets import CacheBudgets
from backend.memory.disk import DiskStore
from backend.memory.prefix_cache import PrefixCache
from backend.memory.trie import PrefixTrie
from tests.fixtures import fake_caches
from tests.fixtures.fake_caches import LAYOUTS, leaked_snapshots, stored_snapshots

BIG = CacheBudgets(1 << 30, 1 << 30, 1 << 30)
NO_DISK = CacheBudgets(1 << 30, 1 << 30, 0)


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request):
    return request.param


class Harness:
    """A prefix cache over fake caches, driven the way the engine drives it."""

    def __init__(self, layout: str, budgets: CacheBudgets = NO_DISK, disk_dir=None,
                 interval: int = 4096, pre_end: int = 4) -> None:
        self.layout = layout
        self.caches = LAYOUTS[layout]()
        disk = DiskStore(disk_dir, "fake-model") if disk_dir is not None else None
        self.pc = PrefixCache(self.caches, budgets, disk, capture_interval=interval,
                              pre_end=pre_end)
        self.pc.check_invariants()

    def request(self, prompt: list[int], reply: list[int], cancel_at: int | None = None):
        """One generation: restore, prefill (all but the last token in one write, like a
        chunk), the last prompt token, then the reply one token at a time. ``cancel_at``
        stops the prefill once the caches hold that many tokens."""
        resume = self.pc.begin(prompt)
        for cache in self.caches:
            assert cache.held() == prompt[:resume.cached], f"{cache.kind} after restore"
        self.pc.check_invariants()
        if cancel_at is not None:
            self._write(prompt[resume.cached:cancel_at])
            held = prompt[:cancel_at]
        else:
            self._write(prompt[resume.cached:-1])
            self._write(prompt[-1:])
            self.pc.attach_captures(prompt)
            self.pc.check_invariants()
            for token in reply:
                self._write([token])
            held = prompt + reply
        self.pc.commit(held)
        for cache in self.caches:
            assert cache.held() == held, f"{cache.kind} after commit"
        self.pc.check_invariants()
        assert self.pc.faults == 0, "an operation failed inside the prefix cache (see the log)"
        return resume

    def _write(self, tokens):
        if tokens:
            for cache in self.caches:
                cache.write(tokens)

    @property
    def has_state(self) -> bool:
        return any(c.snapshot_kind == "state" for c in self.caches)


@pytest.fixture
def _no_snapshot_leaks():
    fake_caches.SNAPSHOTS.clear()
    harnesses: list[Harness] = []
    yield harnesses
    held = [s for h in harnesses for s in stored_snapshots(h.pc)]
    held += [s for h in harnesses for c in h.caches for s in c._lazy]
    leaks = leaked_snapshots(held)
    assert not leaks, f"{len(leaks)} snapshots neither closed nor stored: {leaks[:3]}"


@pytest.fixture
def harness(layout, _no_snapshot_leaks):
    def make(**kwargs) -> Harness:
        h = Harness(kwargs.pop("layout", layout), **kwargs)
        _no_snapshot_leaks.append(h)
        return h

    return make


SYSTEM = list(range(100, 140))  # a 40-token system prompt


def turn(*parts) -> list[int]:
    out = []
    for p in parts:
        out += list(p)
    return out


# -- the trie alone --------------------------------------------------------------------------

def test_trie_match_split_and_locks():
    trie = PrefixTrie()
    a = trie.add_child(trie.root, [1, 2, 3, 4])
    b = trie.add_child(a, [5, 6])
    assert trie.match([1, 2, 3, 4, 5, 6, 7]).length == 6
    m = trie.match([1, 2, 9])
    assert m.length == 2 and m.path == [a]
    upper = trie.split(a, 2)
    assert (upper.start, upper.end, a.start, a.end) == (0, 2, 2, 4)
    assert trie.match([1, 2, 3, 4, 5, 6]).path == [upper, a, b]
    trie.lock(b)
    assert (upper.locks, a.locks, b.locks) == (1, 1, 1)
    with pytest.raises(ValueError):
        trie.remove_leaf(b)
    trie.unlock(b)
    trie.check()
    with pytest.raises(ValueError):
        trie.add_child(upper, [3])


# -- behaviour per layout --------------------------------------------------------------------

def test_resume_next_turn_restores_everything(harness):
    h = harness()
    p1 = turn(SYSTEM, [1, 2, 3])
    assert h.request(p1, [7, 8, 9]).cached == 0
    p2 = turn(p1, [7, 8, 9], [4, 5])
    r = h.request(p2, [10, 11])
    assert r.cached == len(p1) + 3  # the whole previous exchange, on every layout
    assert r.by_tier["live"] == r.cached


def test_exact_repeat_evaluates_at_most_pre_end_tokens(harness):
    h = harness()
    p = turn(SYSTEM, [1, 2, 3])
    h.request(p, [7, 8])
    r = h.request(p, [9])  # regenerate
    expected = len(p) - 1 if not h.has_state else len(p) - 4
    assert r.cached == expected


def test_branch_from_shared_system_prompt(harness):
    h = harness()
    a = turn(SYSTEM, [1, 2, 3, 4, 5, 6, 7, 8])
    h.request(a, [50, 51])
    b = turn(SYSTEM, [9, 9, 9, 9, 9, 9])
    r = h.request(b, [52])
    if h.has_state:
        assert r.cached == 0  # no state was stored at len(SYSTEM) yet: recompute, capture there
    else:
        assert r.cached == len(SYSTEM)
    c = turn(SYSTEM, [3, 3, 3, 3, 3])
    assert h.request(c, [53]).cached == len(SYSTEM)  # the branch point is now a restore point
    # and the shared prefix is stored once
    assert sum(1 for n in h.pc.trie.nodes() if n.start == 0) == 1


def test_partial_edge_match_splits_the_node(harness):
    h = harness()
    a = turn(SYSTEM, list(range(1, 21)))
    h.request(a, [60])
    b = turn(SYSTEM, list(range(1, 11)), [99, 98, 97, 96, 95, 94])
    r = h.request(b, [61])
    assert r.cached == (len(SYSTEM) + 10 if not h.has_state else 0)
    node = h.pc.trie.match(b).node_at(len(SYSTEM) + 9)
    assert node.end == len(SYSTEM) + 10  # the edge was cut at the divergence
    # both branches still resume completely
    for prompt, reply in ((a, [60]), (b, [61])):
        follow = turn(prompt, reply, [5, 5, 5])
        assert h.request(follow, [1]).cached == len(prompt) + len(reply)


def test_switching_conversations_restores_the_right_tokens(harness):
    h = harness()
    convs = [turn(SYSTEM, [i] * 5) for i in range(1, 5)]
    for conv in convs:
        h.request(conv, [70 + conv[-1]])
    for conv in convs:  # every conversation resumes fully, from the stored nodes
        r = h.request(turn(conv, [70 + conv[-1]], [1, 2]), [3])
        assert r.cached == len(conv) + 1
        assert r.by_tier["device"] > 0 or r.by_tier["live"] == r.cached


def test_regenerate_keeps_both_replies(harness):
    h = harness()
    p = turn(SYSTEM, [1, 2, 3, 4, 5])
    h.request(p, [10, 11, 12, 13])
    h.request(p, [10, 11, 20, 21])  # a regenerated reply sharing two tokens
    for reply in ([10, 11, 12, 13], [10, 11, 20, 21]):
        r = h.request(turn(p, reply, [7]), [8])
        assert r.cached == len(p) + len(reply)


def test_cancelled_prefill_keeps_its_captures(harness):
    h = harness(interval=16)
    p = turn(SYSTEM, list(range(1, 30)))  # 69 tokens: captures at 16, 32, 48, 64 (and 65)
    h.request(p, [], cancel_at=50)
    assert h.request(p, [5]).cached == 50  # the state where it stopped was recorded
    other = turn(p[:49], [77] * 5)  # diverges before the stop: the capture at 48 serves
    assert h.request(other, [6]).cached == (49 if not h.has_state else 48)


def test_abort_drops_live_caches_but_keeps_stored_nodes(harness):
    h = harness()
    p = turn(SYSTEM, [1, 2, 3])
    h.request(p, [4, 5])
    follow = turn(p, [4, 5], [6])
    h.pc.begin(follow)
    for cache in h.caches:
        cache.write(follow[-1:])  # half a write, then the model raised
    h.pc.abort()
    h.pc.check_invariants()
    assert all(c.offset == 0 for c in h.caches)
    assert h.request(follow, [7]).cached == len(p) + 2


def test_eviction_keeps_live_path_and_shared_prefix(harness, layout):
    # A device budget for ~70 stored tokens, no host or disk: old conversations go.
    kinds = [c.snapshot_kind for c in LAYOUTS[layout]()]
    budget = 70 * fake_caches.KV_BYTES_PER_TOKEN * kinds.count("span") + \
        12 * fake_caches.STATE_BYTES * kinds.count("state")
    h = harness(budgets=CacheBudgets(budget, 0, 0))
    convs = [turn(SYSTEM, [i] * 8) for i in range(1, 9)]
    for conv in convs:
        h.request(conv, [90, 91])
        assert h.pc.within_budgets()
    assert h.pc.stats().tiers["device"].evictions > 0
    last = convs[-1]
    r = h.request(turn(last, [90, 91], [1]), [2])  # the live conversation is intact
    assert r.cached == len(last) + 2
    assert h.pc.trie.match(SYSTEM).length == len(SYSTEM)  # the shared prefix survived
    first = convs[0]
    assert h.request(turn(first, [90, 91], [1]), [2]).cached < len(first)  # the oldest went


def test_host_and_disk_tiers_round_trip_and_survive_restart(harness, tmp_path):
    budgets = CacheBudgets(0, 0, 1 << 30)  # nothing stays on device or host: all from disk
    h = harness(budgets=budgets, disk_dir=tmp_path)
    convs = [turn(SYSTEM, [i] * 6) for i in range(1, 4)]
    for conv in convs:
        h.request(conv, [80, 81])
    h.pc.persist()
    stats = h.pc.stats()
    assert stats.tiers["device"].bytes == 0 and stats.tiers["disk"].entries > 0
    h.pc.close()
    # a new process: fresh caches, the index reloaded from disk
    h2 = harness(budgets=budgets, disk_dir=tmp_path)
    for conv in convs:
        follow = turn(conv, [80, 81], [3])
        r = h2.request(follow, [4])
        assert r.cached == len(conv) + 2
        assert r.by_tier["disk"] > 0
    h2.pc.close()


def test_host_tier_serves_when_device_is_full(harness):
    h = harness(budgets=CacheBudgets(0, 1 << 30, 0))
    a, b = turn(SYSTEM, [1] * 6), turn(SYSTEM, [2] * 6)
    h.request(a, [5])
    h.request(b, [6])
    r = h.request(turn(a, [5], [7]), [8])
    assert r.cached == len(a) + 1 and r.by_tier["host"] > 0
    assert h.pc.stats().tiers["device"].bytes == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_disk_file_means_recompute_never_wrong_tokens(harness, tmp_path, damage):
    budgets = CacheBudgets(0, 0, 1 << 30)
    h = harness(budgets=budgets, disk_dir=tmp_path)
    a = turn(SYSTEM, [1] * 6)
    h.request(a, [5, 6])
    h.pc.persist()
    h.pc.close()
    files = sorted((tmp_path / "fake-model" / "nodes").iterdir(), key=lambda p: p.stat().st_size)
    victim = files[-1]  # the biggest node: the system prompt and more
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:len(data) // 2]))
    else:
        victim.unlink()
    h2 = harness(budgets=budgets, disk_dir=tmp_path)
    follow = turn(a, [5, 6], [7])
    r = h2.request(follow, [8])  # the harness asserts every layer holds the right tokens
    assert r.cached < len(a) + 2
    assert h2.request(turn(follow, [8], [9]), [1]).cached == len(follow) + 1  # stored again
    h2.pc.close()


def test_second_process_reads_but_never_writes(harness, tmp_path):
    h1 = harness(budgets=BIG, disk_dir=tmp_path)
    a = turn(SYSTEM, [1] * 5)
    h1.request(a, [2])
    h1.pc.persist()
    h2 = harness(budgets=BIG, disk_dir=tmp_path)  # h1 still holds the writer lock
    assert h2.pc.stats().disk_read_only
    r = h2.request(turn(a, [2], [3]), [4])
    assert r.cached == len(a) + 1 and r.by_tier["disk"] > 0
    before = sorted(p.name for p in (tmp_path / "fake-model" / "nodes").iterdir())
    h2.request(turn(SYSTEM, [9] * 5), [1])
    h2.pc.persist()
    assert sorted(p.name for p in (tmp_path / "fake-model" / "nodes").iterdir()) == before
    h2.pc.close()
    h1.pc.close()


def test_prefetch_promotes_without_running_the_model(harness, tmp_path):
    h = harness(budgets=CacheBudgets(1 << 30, 0, 1 << 30), disk_dir=tmp_path)
    a = turn(SYSTEM, [1] * 5)
    h.request(a, [2])
    h.pc.persist()
    h.pc.close()
    h2 = harness(budgets=CacheBudgets(1 << 30, 0, 1 << 30), disk_dir=tmp_path)
    written = [c.written for c in h2.caches]
    assert h2.pc.prefetch(turn(a, [2], [3])) == len(a) + 1
    assert [c.written for c in h2.caches] == written
    reads = []
    read = h2.pc.disk.read
    h2.pc.disk.read = lambda *args: reads.append(args) or read(*args)
    r = h2.request(turn(a, [2], [3]), [4])
    assert not reads, "the prefetch already brought the state to the device"
    # ... and the reply still says where it came from: the disk, read by the prefetch
    assert r.by_tier["disk"] == len(a) + 1 and r.by_tier["device"] == 0
    r = h2.request(turn(a, [2], [3], [4], [5]), [6])  # credited once: now it is device / live
    assert r.by_tier["disk"] == 0
    h2.pc.close()


def test_clear_forgets_everything(harness, tmp_path):
    h = harness(budgets=BIG, disk_dir=tmp_path)
    a = turn(SYSTEM, [1] * 5)
    h.request(a, [2])
    h.pc.persist()
    h.pc.clear()
    h.pc.check_invariants()
    assert len(h.pc.trie) == 0 and h.pc.stats().tiers["disk"].bytes == 0
    assert h.request(turn(a, [2], [3]), [4]).cached == 0
    h.pc.close()


# -- random operations against a reference model ----------------------------------------------

class PrefixCacheMachine(RuleBasedStateMachine):
    """Random conversations, turns, regenerations, branches, cancels, budgets and restarts;
    the reference is the set of sequences the caches ever held: a restore may only bring
    back a prefix of one of them, and must hold exactly the prompt's first tokens."""

    def __init__(self):
        super().__init__()
        self.tmp = None

    @initialize(layout=st.sampled_from(sorted(LAYOUTS)),
                device=st.sampled_from([0, 400, 4000]), host=st.sampled_from([0, 600, 1 << 20]),
                disk=st.sampled_from([0, 2000, 1 << 20]), seed=st.integers(0, 1000))
    def setup(self, layout, device, host, disk, seed):
        import tempfile

        fake_caches.SNAPSHOTS.clear()
        self.tmp = tempfile.TemporaryDirectory()
        self.layout = layout
        self.budgets = CacheBudgets(device, host, disk)
        self.h = Harness(layout, self.budgets, self.tmp.name, interval=8)
        self.rng = random.Random(seed)
        self.convs: list[list[int]] = []
        self.held: set[tuple[int, ...]] = set()
        self.retired: list[Harness] = []

    def _run(self, prompt, reply, cancel_at=None):
        r = self.h.request(prompt, reply, cancel_at)
        best = max((sum(1 for _ in _common(prompt, s)) for s in self.held), default=0)
        assert r.cached <= min(best, len(prompt) - 1)
        self.held.add(tuple(prompt[:cancel_at] if cancel_at else prompt + reply))
        return r

    @rule(sys=st.sampled_from([0, 1]), n=st.integers(1, 6))
    def new_conversation(self, sys, n):
        prompt = [200 + sys] * 3 + [self.rng.randrange(20) for _ in range(n)]
        reply = [self.rng.randrange(20) for _ in range(self.rng.randrange(1, 4))]
        self._run(prompt, reply)
        self.convs.append(prompt + reply)

    @rule(i=st.integers(0, 50), n=st.integers(1, 5))
    def next_turn(self, i, n):
        if not self.convs:
            return
        i %= len(self.convs)
        prompt = self.convs[i] + [self.rng.randrange(20) for _ in range(n)]
        reply = [self.rng.randrange(20) for _ in range(self.rng.randrange(1, 4))]
        self._run(prompt, reply)
        self.convs[i] = prompt + reply

    @rule(i=st.integers(0, 50), cut=st.integers(1, 20))
    def regenerate_or_edit(self, i, cut):
        if not self.convs:
            return
        conv = self.convs[i % len(self.convs)]
        prompt = conv[:max(1, len(conv) - cut)] + [self.rng.randrange(20)]
        self._run(prompt, [self.rng.randrange(20)])

    @rule(i=st.integers(0, 50), at=st.integers(1, 30))
    def cancel(self, i, at):
        if not self.convs:
            return
        prompt = self.convs[i % len(self.convs)] + [1, 2, 3]
        resume = self.h.pc.begin(prompt)
        stop = min(len(prompt) - 1, resume.cached + at)
        for cache in self.h.caches:
            assert cache.held() == prompt[:resume.cached]
            if stop > resume.cached:
                cache.write(prompt[resume.cached:stop])
        self.h.pc.commit(prompt[:stop])
        self.held.add(tuple(prompt[:stop]))

    @rule()
    def restart(self):
        self.h.pc.close()
        self.retired.append(self.h)  # its memory is gone with the process
        self.h = Harness(self.layout, self.budgets, self.tmp.name, interval=8)

    @rule()
    def corrupt_a_file(self):
        files = sorted((Path(self.tmp.name) / "fake-model" / "nodes").glob("*.safetensors"))
        if files:
            victim = self.rng.choice(files)
            data = bytearray(victim.read_bytes())
            data[self.rng.randrange(len(data))] ^= 0x01
            victim.write_bytes(bytes(data))

    @invariant()
    def consistent_and_within_budgets(self):
        if getattr(self, "h", None) is None:
            return
        self.h.pc.check_invariants()
        assert self.h.pc.within_budgets(), self.h.pc.stats()
        assert self.h.pc.faults == 0, "an operation failed inside the prefix cache (see the log)"

    def teardown(self):
        if getattr(self, "h", None) is not None:
            held = [s for h in self.retired + [self.h]
                    for s in stored_snapshots(h.pc) + [s for c in h.caches for s in c._lazy]]
            self.h.pc.close()
            assert not leaked_snapshots(held)
        if self.tmp is not None:
            self.tmp.cleanup()


def _common(a, b):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


# -- several live slots: sequences that run at the same time ----------------------------------

class SlotsMachine(RuleBasedStateMachine):
    """Up to three sequences at once, each in its own slot over one trie: requests begin,
    write, commit and cancel interleaved, sharing system prompts; prefetches and budget changes
    meanwhile. Every restore brings back exactly the prompt's first tokens, every slot's caches
    hold what the prefix cache says, and the trie's invariants and budgets hold throughout."""

    @initialize(layout=st.sampled_from(sorted(LAYOUTS)), device=st.sampled_from([0, 400, 4000]),
                host=st.sampled_from([0, 1 << 20]), disk=st.sampled_from([0, 1 << 20]),
                seed=st.integers(0, 1000))
    def setup(self, layout, device, host, disk, seed):
        import tempfile

        fake_caches.SNAPSHOTS.clear()
        self.tmp = tempfile.TemporaryDirectory()
        self.layout = layout
        self.budgets = CacheBudgets(device, host, disk)
        self.h = Harness(layout, self.budgets, self.tmp.name, interval=8)
        self.pc = self.h.pc
        self.slots = [self.pc.slots[0]] + [self.pc.new_slot(LAYOUTS[layout]())
                                           for _ in range(2)]
        self.rng = random.Random(seed)
        self.writing: dict[int, list[int]] = {}  # slot index -> ids its caches hold
        self.convs: list[list[int]] = []

    def _write(self, i: int, tokens: list[int]) -> None:
        for cache in self.slots[i].caches:
            cache.write(tokens)
        self.writing[i] += tokens

    @rule(i=st.integers(0, 2), sys=st.sampled_from([0, 1]), n=st.integers(1, 6),
          follow=st.booleans())
    def start(self, i, sys, n, follow):
        if i in self.writing:
            return
        base = self.rng.choice(self.convs) if follow and self.convs else [200 + sys] * 3
        prompt = base + [self.rng.randrange(20) for _ in range(n)]
        slot = self.slots[i]
        resume = self.pc.begin(prompt, slot)
        for cache in slot.caches:
            assert cache.held() == prompt[:resume.cached], f"slot {i} after restore"
        self.writing[i] = list(prompt[:resume.cached])
        self._write(i, prompt[resume.cached:])
        self.pc.attach_captures(self.writing[i], slot)
        self.convs.append(prompt)

    @rule(i=st.integers(0, 2), n=st.integers(1, 3))
    def decode(self, i, n):
        if i in self.writing:
            for _ in range(n):
                self._write(i, [self.rng.randrange(20)])

    @rule(i=st.integers(0, 2))
    def finish(self, i):
        if i not in self.writing:
            return
        held = self.writing.pop(i)
        self.pc.commit(held, self.slots[i])
        for cache in self.slots[i].caches:
            assert cache.held() == held
        self.convs.append(held)

    @rule(i=st.integers(0, 50))
    def prefetch(self, i):
        if self.convs:
            self.pc.prefetch(self.convs[i % len(self.convs)] + [1])

    @rule(device=st.sampled_from([0, 300, 4000]))
    def budgets(self, device):
        self.pc.set_budgets(CacheBudgets(device, self.budgets.host_bytes,
                                         self.budgets.disk_bytes))

    @invariant()
    def consistent(self):
        if getattr(self, "pc", None) is None:
            return
        self.pc.check_invariants()
        assert self.pc.faults == 0, "an operation failed inside the prefix cache (see the log)"
        for i, slot in enumerate(self.slots):
            held = self.writing.get(i, list(slot.live))
            for cache in slot.caches:
                assert cache.held() == held, f"slot {i} holds other tokens"

    def teardown(self):
        if getattr(self, "pc", None) is not None:
            for i in list(self.writing):
                self.pc.commit(self.writing.pop(i), self.slots[i])
            self.pc.check_invariants()
            held = stored_snapshots(self.pc) + [s for slot in self.slots for c in slot.caches
                                                for s in c._lazy]
            assert not leaked_snapshots(held)
            self.pc.close()
        if getattr(self, "tmp", None) is not None:
            self.tmp.cleanup()


TestSlotsMachine = SlotsMachine.TestCase
TestSlotsMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])

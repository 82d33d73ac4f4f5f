"""PrefixCache: one prefix trie for every conversation, over the model's live caches, in tiers.

Scope: which token ids the live caches hold, where every other stored prefix lives (device /
host / disk), and moving state between them. Not in scope: running the model (the engine writes
the caches between ``begin`` and ``commit``) or what a conversation is (the trie needs no
conversation id: any prompt that shares a prefix with anything stored reuses it).

One request, as the engine drives it::

    resume = cache.begin(prompt)     # 1. longest stored prefix -> live caches at resume.cached
                                     #    (captures for this prefill scheduled on every cache)
    ... prefill prompt[resume.cached:], decode ...
    cache.attach_captures(held)      # 2. after the prefill (or a cancel): keep what it crossed
    cache.commit(held)               # 3. record the generated segment; held = ids the caches hold
    cache.persist()                  # 4. write new nodes to disk (the engine calls this when idle)
    (cache.abort() instead of 2-3 when the write failed half way: the live caches are dropped)

Node data. Every node holds, per cache layer, the snapshot of its edge: for a *span* layer
(full-attention KV) the keys/values of exactly ``[start, end)``; for a *state* layer (rotating
window, recurrent state) the state at ``end`` or nothing (a node cut out of a longer one has no
state of its own). Each node's data sits on one or more tiers at once: ``device`` (the caches'
own snapshots, MLX arrays; lazy views of the live buffer cost nothing until the live cache
overwrites them), ``host`` (numpy ``SnapshotRecord``s) and ``disk`` (one file, see ``disk.py``).
Every change of residency goes through one method per transition of the ``TierLedger``
(``tiers.py``: ``set_device``, ``drop_device``, ``set_host``, ``drop_host``, ``set_disk``,
``drop_disk``), which is also the only place the byte and entry counters change.

Matching (``begin``). The longest stored prefix of the prompt, capped so that at least one
prompt token is evaluated. Span layers reach any position of it (rewind the live cache, then
append node snapshots); a state layer reaches a position only by rewinding its live state there
(``Cache.can_rewind_to``) or from a node that ends exactly there with its state. The restore
target is the deepest position every layer reaches, so all layers sit at one offset.

Captures, scheduled with ``Cache.prepare_snapshots`` so the prefill writes capture them for free:
the branch point (the match length, when the restore had to stop short of it), every
``capture_interval`` tokens, and ``pre_end`` tokens before the end of the prompt (so a
regenerated reply or an edited last message skips the prompt). The end of each generated
segment is recorded at ``commit`` from the live caches.

Budgets. After each step the least recently used copies move down a tier: device -> host ->
disk -> dropped; the live conversation's path goes last. A running request locks the path it
restored (``begin`` .. ``commit``): a locked node is never dropped, and loses a copy only when
another tier holds one or the live caches do (then it becomes free views of them). Budgets are
exact bytes (``nbytes`` of arrays, file sizes) and are never exceeded between steps.

Faults. The cache is an optimization and never fails a turn. Each public operation is a fault
boundary (``fault_boundary``, ``recovery.py``): whatever raises inside it (a cache, the disk, a bug), the
operation ends in a consistent state (``_recover``: the live caches dropped, no request left
running, no lock held, every node that lost its data or a part of it forgotten with its
subtree, the counters rebuilt), says so in one log line per kind of failure, and answers as a
cache that had nothing: ``begin`` restores nothing (the engine prefills the whole prompt),
``prefetch`` brings nothing, ``commit`` and ``persist`` store nothing. Misuse by the caller
(``begin`` while a request runs, an empty prompt, ``commit`` with none) still raises
``PrefixCacheMisuse``. The disk tier has its own boundary (``disk.py``).
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

from backend.api import CacheStats
from backend.memory.budgets import CacheBudgets
from backend.memory.disk import DiskStore
from backend.memory.read_ahead import NOT_READ, ReadAhead
from backend.memory.recovery import FaultRecovery, PrefixCacheMisuse, fault_boundary
from backend.memory.records import LayerRecords
from backend.memory.tiers import TIERS, NodeData, TierLedger, close_all
from backend.memory.trie import PrefixTrie, TokenIds, TrieNode, as_ids, common_prefix_length

log = logging.getLogger(__name__)

CAPTURE_INTERVAL = 4096
PRE_END = 4


@dataclass(frozen=True)
class Resume:
    """What ``begin`` restored: ``cached`` prompt tokens are in the live caches."""

    cached: int
    by_tier: dict[str, int]  # tokens per source: "live" (already there), device, host, disk
    restore_s: float


@dataclass
class _Request:
    prompt: array
    cached: int
    offsets: list[int] = field(default_factory=list)  # scheduled capture offsets, ascending
    attached: bool = False


class LiveSlot:
    """One sequence's live caches (one per layer) and what they hold: ``live``, the token ids
    (always a prefix of something the trie stores, or empty), the request writing them
    (``begin`` .. ``commit``) and the deepest node of the path that request pins. Several
    slots share one trie: each sequence that runs at the same time has its own."""

    __slots__ = ("caches", "live", "request", "locked")

    def __init__(self, caches: Sequence) -> None:
        self.caches = list(caches)
        self.live = array("i")
        self.request: _Request | None = None
        self.locked: TrieNode | None = None

    @property
    def running(self) -> bool:
        return self.request is not None


class PrefixCache(FaultRecovery):
    """See the module docstring. Used from one thread (the engine's)."""

    def __init__(self, caches: Sequence, budgets: CacheBudgets, disk: DiskStore | None = None,
                 evaluate: Callable[[Sequence], None] | None = None,
                 capture_interval: int = CAPTURE_INTERVAL, pre_end: int = PRE_END) -> None:
        self.slots = [LiveSlot(caches)]
        self._slot = self.slots[0]  # the slot the current operation works on
        self.kinds = [c.snapshot_kind for c in self.caches]
        self.budgets = budgets
        self.disk = disk  # kept while its budget is 0: a new budget may enable it again
        self._evaluate = evaluate or (lambda caches: None)
        self.capture_interval = capture_interval
        self.pre_end = pre_end
        self.trie = PrefixTrie()
        self.tiers = TierLedger(disk)
        self.read_ahead = ReadAhead(disk, len(self.caches)) if disk is not None else None
        self._unpersisted: list[TrieNode] = []
        self._guarding = False  # inside a public operation's fault boundary
        self._faults_logged: set[str] = set()
        self.faults = 0  # operations a fault ended early (tests and stats read this)
        if self.disk is not None:
            self._start_from_disk()

    @fault_boundary(lambda self: None)
    def _start_from_disk(self) -> None:
        self._load_disk_index(self.disk)

    # -- slots: one per sequence that runs at the same time -----------------------------------
    # The operations on one request (begin, attach_captures, commit, abort) take its slot (the
    # first slot when none is given) and make it the current one; ``caches``, ``live``,
    # ``_request`` and ``_locked`` below are the current slot's.
    @property
    def caches(self) -> list:
        return self._slot.caches

    @property
    def live(self) -> array:
        return self._slot.live

    @live.setter
    def live(self, ids: array) -> None:
        self._slot.live = ids

    @property
    def _request(self) -> _Request | None:
        return self._slot.request

    @_request.setter
    def _request(self, request: _Request | None) -> None:
        self._slot.request = request

    @property
    def _locked(self) -> TrieNode | None:
        return self._slot.locked

    @_locked.setter
    def _locked(self, node: TrieNode | None) -> None:
        self._slot.locked = node

    def _use(self, slot: LiveSlot | None) -> LiveSlot:
        slot = self.slots[0] if slot is None else slot
        if not any(slot is s for s in self.slots):
            raise PrefixCacheMisuse("a slot this prefix cache does not hold")
        self._slot = slot
        return slot

    def new_slot(self, caches: Sequence) -> LiveSlot:
        """Another sequence's live caches (the same layers and kinds as the first slot's)."""
        caches = list(caches)
        if [c.snapshot_kind for c in caches] != self.kinds:
            raise PrefixCacheMisuse("a slot's caches must have the first slot's kinds")
        slot = LiveSlot(caches)
        self.slots.append(slot)
        return slot

    def release_slot(self, slot: LiveSlot) -> None:
        """Forget an idle slot: its live caches are freed (stored views of them copy out)."""
        if slot is self.slots[0] or slot.running:
            raise PrefixCacheMisuse("only an idle slot other than the first can be released")
        self.slots = [s for s in self.slots if s is not slot]
        self._slot = self.slots[0]
        for cache in slot.caches:
            cache.free()
        slot.live = array("i")
        self._guarded_enforce_budgets()

    def choose_slot(self, prompt: TokenIds, slots: Sequence[LiveSlot]) -> LiveSlot:
        """Of ``slots`` (idle ones), the one whose live caches share the longest prefix with
        ``prompt``; on a tie the one holding the least (its state is the cheapest to lose)."""
        prompt = as_ids(prompt)
        return max(slots, key=lambda s: (common_prefix_length(s.live, prompt), -len(s.live)))

    # ============================================================================================
    # 1. begin: restore the longest stored prefix
    # ============================================================================================
    def begin(self, prompt: TokenIds, slot: LiveSlot | None = None) -> Resume:
        """Restore the longest stored prefix of ``prompt`` into the slot's live caches and
        schedule this prefill's captures. After a fault: nothing restored (``cached`` 0, the
        caches empty and ready for the whole prompt)."""
        self._use(slot)
        if self._request is not None:
            raise PrefixCacheMisuse("begin() while a request is running: commit or abort it "
                                    "first")
        prompt = as_ids(prompt)
        if not prompt:
            raise PrefixCacheMisuse("an empty prompt has no token to evaluate")
        return self._begin(prompt)

    def _cold_begin(self, prompt: array) -> Resume:
        """What ``begin`` answers after a fault: a request that restored nothing (the live
        caches were dropped by ``_recover``) and captures nothing."""
        self._request = _Request(prompt, 0)
        return Resume(0, dict.fromkeys(("live",) + TIERS, 0), 0.0)

    @fault_boundary(_cold_begin)
    def _begin(self, prompt: array) -> Resume:
        t0 = time.perf_counter()
        self.persist()
        while True:
            match = self.trie.match(prompt)
            limit = min(match.length, len(prompt) - 1)
            path = [n for n in match.path if n.start < limit]
            live_common = min(common_prefix_length(self.live, prompt), limit)
            target = self._deepest_reachable(path, limit, live_common)
            unreadable, sources = self._load_for_restore(path, target, live_common)
            if unreadable is None:
                break
            self._forget_unreadable(unreadable)
        by_tier = self._restore(path, target, live_common, sources)
        self.live = prompt[:target]
        self._relock(match.node_at(target - 1) if target else None)
        self._touch([n for n in path if n.start < target])
        request = _Request(prompt, target)
        request.offsets = self._capture_offsets(target, limit, len(prompt))
        for cache in self.caches:
            cache.prepare_snapshots(request.offsets)
        self._request = request
        self._enforce_budgets()
        for tier, n in by_tier.items():
            self.tiers.hits[tier] += n
        return Resume(target, by_tier, time.perf_counter() - t0)

    def _deepest_reachable(self, path: list[TrieNode], limit: int, live_common: int) -> int:
        ends = {n.end: n for n in path if n.end <= limit}
        for c in sorted({limit, 0, *ends}, reverse=True):
            if all(self._layer_reaches(j, c, ends, live_common) for j in range(len(self.caches))):
                return c
        return 0

    def _layer_reaches(self, j: int, c: int, ends: dict[int, TrieNode], live_common: int) -> bool:
        if c == 0 or self.kinds[j] == "span":
            return True
        if c <= live_common and self.caches[j].can_rewind_to(c):
            return True
        node = ends.get(c)
        return node is not None and node.data.layers[j]

    def _needed_nodes(self, path: list[TrieNode], target: int, live_common: int) -> list[TrieNode]:
        """Nodes whose snapshots the restore to ``target`` reads, root first."""
        rewind = min(live_common, target)
        needed: list[TrieNode] = []
        for j, cache in enumerate(self.caches):
            if target == 0 or (target <= live_common and cache.can_rewind_to(target)):
                continue
            if self.kinds[j] == "span":
                needed += [n for n in path if n.end > rewind and n.start < target]
            else:
                needed += [n for n in path if n.end == target]
        seen: set[int] = set()
        return [n for n in needed if not (id(n) in seen or seen.add(id(n)))]

    def _load_for_restore(self, path, target, live_common):
        """Bring the nodes the restore reads onto the device; (unreadable node, sources)."""
        sources: dict[int, str] = {}
        for node in sorted(self._needed_nodes(path, target, live_common), key=lambda n: n.start):
            source = self._load_device(node)
            if source is None:
                return node, sources
            sources[id(node)] = source
        return None, sources

    def _restore(self, path, target, live_common, sources) -> dict[str, int]:
        rewind = min(live_common, target)
        ends = {n.end: n for n in path}
        by_tier = dict.fromkeys(("live",) + TIERS, 0)
        paged = False
        for j, cache in enumerate(self.caches):
            if target == 0 or (target <= live_common and cache.can_rewind_to(target)):
                ok = cache.restore(None, target)
            elif self.kinds[j] == "span":
                ok = cache.restore(None, rewind)
                cache.reserve(target)
                for node in path:
                    if node.end > rewind and node.start < target:
                        ok = ok and cache.restore(node.data.device[j], min(node.end, target))
                paged = True
            else:
                ok = cache.restore(ends[target].data.device[j], target)
                paged = True
            if not ok or cache.offset != target:
                raise RuntimeError(f"restore of layer {j} to {target} failed "
                                   f"(offset {cache.offset}): the trie and the caches disagree")
        self._evaluate(self.caches)
        if not paged:
            by_tier["live"] = target
            return by_tier
        by_tier["live"] = rewind
        for node in path:
            lo, hi = max(node.start, rewind), min(node.end, target)
            if hi > lo:
                by_tier[sources.get(id(node), "device")] += hi - lo
            if node.data is not None and node.start < target:
                node.data.loaded_from = None  # a prefetch's source is credited once
        return by_tier

    def _capture_offsets(self, cached: int, limit: int, n: int) -> list[int]:
        offsets = {n - self.pre_end}
        offsets.update(range(self.capture_interval, n, self.capture_interval))
        if cached < limit:
            offsets.add(limit)  # the branch point this restore could not reach exactly
        return sorted(o for o in offsets if cached < o < n)

    # ============================================================================================
    # 2. attach_captures: keep the states the prefill crossed
    # ============================================================================================
    def attach_captures(self, held: TokenIds, slot: LiveSlot | None = None) -> None:
        """Take the scheduled captures from every cache and store the ones the writes crossed
        (``held``: the ids the caches hold now). Also right after a cancelled prefill. After a
        fault nothing is stored and the request goes on (the live caches are untouched)."""
        self._use(slot)
        request = self._require_request()
        if request.attached:
            return
        request.attached = True
        self._attach_captures(request, as_ids(held))

    @fault_boundary(lambda self, request, held: None)
    def _attach_captures(self, request: _Request, held: array) -> None:
        rows = [cache.take_snapshots() for cache in self.caches]
        for cache in self.caches:
            cache.cancel_snapshots()
        if len({len(r) for r in rows}) > 1:
            raise RuntimeError(f"caches captured different numbers of snapshots: "
                               f"{[len(r) for r in rows]}")
        for i, offset in enumerate(request.offsets[:len(rows[0]) if rows else 0]):
            row = [r[i] for r in rows]
            if offset > len(held):
                close_all(row)
                continue
            self._attach(held, offset, row)

    def _attach(self, held: array, offset: int, row: list) -> None:
        node = self._node_ending_at(held, offset)
        if node is None:
            close_all(row)
            return
        if node.data is None:  # a new node: the captures are its data
            clipped = [self._clip(j, snap, node.start) for j, snap in enumerate(row)]
            if any(snap is None for j, snap in enumerate(clipped) if self.kinds[j] == "span"):
                close_all(clipped)  # a capture did not cover the whole edge: leave no node
                self.trie.remove_leaf(node)
                return
            self._new_data(node, clipped)
            return
        extra = {}
        for j, snap in enumerate(row):
            if node.data.layers[j] or self.kinds[j] == "span":
                snap.close()  # keep what is stored
            else:
                extra[j] = self._clip(j, snap, node.start)
        self._add_layers(node, extra)

    def _clip(self, j: int, snap, start: int):
        """The capture restricted to a node starting at ``start`` (None: it does not cover it)."""
        if snap is None or snap.start == start:
            return snap
        if snap.start > start:
            if self.kinds[j] == "span":
                snap.close()
                return None
            return snap  # a state is the state at its end, wherever its range began
        head, tail = self.caches[j].split(snap, start)
        if head is not None:
            head.close()
        return tail

    # ============================================================================================
    # 3. commit: record the generated segment; abort
    # ============================================================================================
    def commit(self, held: TokenIds, slot: LiveSlot | None = None) -> None:
        """End the request: the caches hold ``held`` (prompt + what was generated and fed).
        After a fault the request ends with nothing recorded and the live caches dropped."""
        self._use(slot)
        self._require_request()
        self._commit(as_ids(held))

    @fault_boundary(lambda self, held: None)
    def _commit(self, held: array) -> None:
        self.attach_captures(held, self._slot)
        if any(cache.offset != len(held) for cache in self.caches):
            raise RuntimeError(f"commit({len(held)} tokens) but the caches are at "
                               f"{[c.offset for c in self.caches]}")
        node = self._record_segment(held)
        self._request = None
        self.live = held
        self._relock(None)
        if node is not None:
            self._touch(node.path())
            self._unpersisted.append(node)
        self._enforce_budgets()

    def _record_segment(self, held: array) -> TrieNode | None:
        """Make a node end at ``len(held)`` holding the live caches' state there."""
        end = len(held)
        if end == 0:
            return None
        match = self.trie.match(held)
        has_state = "state" in self.kinds
        if match.length < end:
            parent = self._node_ending_at(held, match.length) if match.length else self.trie.root
            if parent is None:
                return None
            node = self.trie.add_child(parent, held[match.length:])
            self._new_data(node, [c.snapshot(node.start) for c in self.caches])
            return node
        node = match.path[-1]
        if node.end > end:
            if not has_state:
                return node
            node = self._node_ending_at(held, end)
            if node is None:
                return None
        missing = {j: self.caches[j].snapshot(node.start) for j, kind in enumerate(self.kinds)
                   if kind == "state" and not node.data.layers[j]}
        self._add_layers(node, missing)
        return node

    def abort(self, slot: LiveSlot | None = None) -> None:
        """The request failed while writing: drop the live caches (a half-written cache is never
        reused) and its captures. Stored nodes are untouched (lazy views copy out first)."""
        self._use(slot)
        self._abort()

    @fault_boundary(lambda self: None)
    def _abort(self) -> None:
        for cache in self.caches:
            close_all(cache.take_snapshots())
            cache.cancel_snapshots()
            cache.free()
        self._request = None
        self.live = array("i")
        self._relock(None)
        self._enforce_budgets()

    # ============================================================================================
    # Trie edits that carry data
    # ============================================================================================
    def _node_ending_at(self, held: array, offset: int) -> TrieNode | None:
        """The node of ``held``'s path that ends exactly at ``offset`` (cut or created; a new
        node has ``data is None``), or None if a stored node there turned out unreadable."""
        match = self.trie.match(held[:offset])
        if match.length == offset:
            node = match.path[-1]
            return node if node.end == offset else self._split(node, offset, held)
        if match.path and match.path[-1].end > match.length:
            parent = self._split(match.path[-1], match.length, held)
            if parent is None:
                return None
        else:
            parent = match.path[-1] if match.path else self.trie.root
        return self.trie.add_child(parent, held[match.length:offset])

    def _split(self, node: TrieNode, at: int, held: array) -> TrieNode | None:
        """Cut ``node`` at ``at`` (inside ``held``'s path); returns the part ending at ``at``.

        The current request's pinned position (its last restored token) lies before ``at``, so
        its lock on ``node`` moves to the upper part; another slot's pin moves only when it too
        lies before ``at``."""
        readable = self._load_device(node) is not None
        parts = self._split_snapshots(node, at) if readable else []
        try:
            upper = self.trie.split(node, at)
        except BaseException:
            close_all(p for pair in parts for p in pair)
            raise
        for slot in self.slots:  # a pin before ``at`` moves up; one at or after it stays
            if slot.locked is node and slot.request.cached <= at:
                self._relock(upper, slot)
        if not readable:
            # Its data is gone; the upper part is still in the live caches (it lies in held).
            self._forget_subtree(node)
            self._new_data(upper, [c.snapshot(upper.start, at) if k == "span" else None
                                   for c, k in zip(self.caches, self.kinds)])
            return upper
        self.tiers.drop_host(node)
        self.tiers.drop_disk(node)
        self.tiers.set_device(node, [b for _, b in parts])
        self._new_data(upper, [a for a, _ in parts])
        self._unpersisted.append(node)
        return upper

    def _split_snapshots(self, node: TrieNode, at: int) -> list[tuple]:
        """The node's device snapshots cut at ``at``: span snapshots in two, a state goes with
        the lower part's end. They leave the node first (a split consumes its snapshot), so a
        fault half way never leaves the node holding one that is gone."""
        snaps = node.data.device
        self.tiers.drop_device(node)
        parts: list[tuple] = []
        try:
            for j, snap in enumerate(snaps):
                parts.append((None, None) if snap is None
                             else self.caches[j].split(snap, at) if self.kinds[j] == "span"
                             else (None, snap))
        except BaseException:
            close_all(p for pair in parts for p in pair)
            close_all(snaps[len(parts) + 1:])  # never handed to a split
            raise
        return parts

    def _new_data(self, node: TrieNode, snaps: list) -> None:
        node.data = NodeData([s is not None for s in snaps])
        self.tiers.set_device(node, snaps)
        self._unpersisted.append(node)

    def _add_layers(self, node: TrieNode, snaps: dict[int, object]) -> None:
        """Give an existing node the state snapshots it lacked (its other copies go stale)."""
        snaps = {j: s for j, s in snaps.items() if s is not None}
        if not snaps:
            return
        if self._load_device(node) is None:  # its only copy was unreadable: forget it
            close_all(snaps.values())
            self._forget_unreadable(node)
            return
        device = list(node.data.device)
        for j, snap in snaps.items():
            device[j] = snap
        self.tiers.drop_host(node)
        self.tiers.drop_disk(node)
        self.tiers.set_device(node, device, tuple(s is not None for s in device))
        self._unpersisted.append(node)

    def _forget_unreadable(self, node: TrieNode) -> None:
        """A node's data could not be read: forget it and everything below it (what the live
        caches hold stays valid: they are the truth for ``self.live``). Running requests'
        locks inside it go too: what they pinned is gone."""
        for slot in self.slots:
            locked = slot.locked
            while locked is not None and locked is not node:
                locked = locked.parent
            if locked is node:
                self._relock(None, slot)
        self._forget_subtree(node)

    def _forget_subtree(self, node: TrieNode) -> None:
        for child in list(node.children.values()):
            self._forget_subtree(child)
        self._drop_node(node)

    def _drop_node(self, node: TrieNode) -> None:
        self.tiers.clear(node)
        self.trie.remove_leaf(node)

    # ============================================================================================
    # Locks: the running request pins the path it restored (begin .. commit)
    # ============================================================================================
    def _relock(self, node: TrieNode | None, slot: LiveSlot | None = None) -> None:
        """Make ``node`` the slot's (the current one's) pinned path end (None: pin nothing)."""
        slot = self._slot if slot is None else slot
        if node is not None:
            self.trie.lock(node)
        if slot.locked is not None and slot.locked.parent is not None:
            self.trie.unlock(slot.locked)
        slot.locked = node

    # -- moves between tiers (built on the transitions) ------------------------------------------
    def _records(self, node: TrieNode) -> LayerRecords | None:
        """The node's data as host records, from whichever tier is fastest; None if unreadable."""
        data = node.data
        if data.on_host:
            return data.host
        if data.on_device:
            return [None if s is None else self.caches[j].export_snapshot(s)
                    for j, s in enumerate(data.device)]
        if data.on_disk and self.disk is not None:
            if self.read_ahead is not None:
                records = self.read_ahead.take(data.id, data.disk)
                if records is not NOT_READ:
                    return records
            return self.disk.read(data.disk, len(self.caches))
        return None

    def _load_device(self, node: TrieNode, prefetch: bool = False) -> str | None:
        """Make sure the node has a device copy; the tier it came from (for a copy a prefetch
        brought, the tier the prefetch read), None if unreadable. ``prefetch``: remember the
        source for the restore that uses the copy."""
        data = node.data
        if data.on_device:
            return data.loaded_from or "device"
        source = "host" if data.on_host else "disk"
        records = self._records(node)
        if records is None or [r is not None for r in records] != list(data.layers):
            if source == "disk":
                self.tiers.drop_disk(node)
            return None
        self.tiers.set_device(node, [None if r is None else self.caches[j].import_snapshot(r)
                                     for j, r in enumerate(records)])
        if prefetch:
            data.loaded_from = source
        return source

    def _write_disk(self, node: TrieNode) -> bool:
        if self.disk is None or node.data.on_disk or self.budgets.disk_bytes <= 0:
            return node.data.on_disk
        if not self.disk.writable():
            if self.disk.retrying:
                self._unpersisted.append(node)  # written once the disk takes writes again
            return False
        records = self._records(node)
        if records is None:
            return False
        parent = node.parent
        parent_id = parent.data.id if parent is not None and parent.data is not None else None
        entry = self.disk.write(node.data.id, parent_id, node.start, node.tokens.tolist(),
                                records, node.last_used)
        if entry is None:
            if self.disk.retrying:
                self._unpersisted.append(node)
            return False
        self.tiers.set_disk(node, entry)
        for child in node.children.values():  # children stored before a split name the old id
            if child.data is not None and child.data.on_disk:
                self.disk.set_parent(child.data.id, node.data.id)
        return True

    # ============================================================================================
    # 4. persistence and budgets
    # ============================================================================================
    @fault_boundary(lambda self: None)
    def persist(self) -> None:
        """Write nodes created since the last call to disk (parents first)."""
        pending, self._unpersisted = self._unpersisted, []
        for node in sorted({id(n): n for n in pending}.values(), key=lambda n: n.start):
            if node.data is not None and node.parent is not None:
                self._write_disk(node)
        self._enforce_budgets()

    def _enforce_budgets(self) -> None:
        self.tiers.refresh_lazy()
        self._shrink("device", self.budgets.device_bytes, self._evict_device)
        self._shrink("host", self.budgets.host_bytes, self._evict_host)
        self._shrink("disk", self.budgets.disk_bytes if self.disk else 0, self._evict_disk)

    def _shrink(self, tier: str, budget: int, evict: Callable[[TrieNode], bool]) -> None:
        if self.tiers.bytes[tier] <= budget:
            return
        live = {id(n) for slot in self.slots for n in self.trie.match(slot.live).path}
        resident = [n for n in self.trie.nodes() if getattr(n.data, f"{tier}_bytes") > 0]
        # The live conversations' paths last, then oldest first, deeper first on ties.
        resident.sort(key=lambda n: (id(n) in live, n.last_used, -n.start))
        for node in resident:
            if self.tiers.bytes[tier] <= budget:
                break
            if node.parent is not None and evict(node):  # still in the trie, and moved
                self.tiers.evictions[tier] += 1

    def _evict_device(self, node: TrieNode) -> bool:
        data = node.data
        if self.budgets.host_bytes > 0 and not data.on_host:
            self.tiers.set_host(node, self._records(node))  # the next tier down, even if on disk
        elif not (data.on_host or data.on_disk):
            self._write_disk(node)
        if data.on_host or data.on_disk:
            snaps = data.device
            self.tiers.drop_device(node)
            close_all(snaps)
            return True
        return self._shed(node)

    def _evict_host(self, node: TrieNode) -> bool:
        data = node.data
        if not data.on_disk:
            self._write_disk(node)
        if data.on_disk or data.on_device:
            self.tiers.drop_host(node)
            return True
        return self._shed(node)

    def _evict_disk(self, node: TrieNode) -> bool:
        data = node.data
        if data.on_device or data.on_host:
            self.tiers.drop_disk(node)
            return True
        return self._shed(node)

    def _shed(self, node: TrieNode) -> bool:
        """No tier can take the node's only copy: drop it if it is an unlocked leaf; if the
        live caches hold its tokens, keep it as free views of them (span layers only; its own
        states are optional restore points); else drop its whole (unlocked) subtree."""
        if node.locks == 0 and node.is_leaf:
            self._drop_node(node)
            return True
        holder = self._slot_holding(node)
        if holder is not None:
            views = [c.snapshot(node.start, node.end) if k == "span" else None
                     for c, k in zip(holder.caches, self.kinds)]
            self.tiers.clear(node)
            self.tiers.set_device(node, views, tuple(v is not None for v in views))
            return True
        if node.locks == 0:
            self._forget_subtree(node)
            return True
        return False

    def _slot_holding(self, node: TrieNode) -> LiveSlot | None:
        """A slot whose live caches hold the node's whole path (None: no slot does)."""
        for slot in self.slots:
            if node.end <= len(slot.live) and \
                    self.trie.match(slot.live[:node.end]).node_at(node.end - 1) is node:
                return slot
        return None

    # ============================================================================================
    # Restart: rebuild the trie from the disk index
    # ============================================================================================
    def _load_disk_index(self, disk: DiskStore) -> None:
        rows = disk.load_index()
        by_parent: dict[str | None, list] = {}
        for row in rows:
            by_parent.setdefault(row.parent_id, []).append(row)
        placed = 0
        stack: list[tuple[TrieNode, str | None]] = [(self.trie.root, None)]
        clock = 0
        while stack:
            parent, parent_id = stack.pop()
            for row in sorted(by_parent.pop(parent_id, []), key=lambda r: -r.last_used):
                if (row.start != parent.end or not row.tokens or row.tokens[0] in parent.children
                        or len(row.layers) != len(self.caches)
                        or not all(row.layers[j] for j, k in enumerate(self.kinds) if k == "span")):
                    disk.delete(row.node_id)
                    continue
                node = self.trie.add_child(parent, row.tokens)
                node.data = NodeData(row.layers, row.node_id)
                node.last_used = row.last_used
                clock = max(clock, row.last_used)
                self.tiers.set_disk(node, row.entry)
                placed += 1
                stack.append((node, row.node_id))
        for orphans in by_parent.values():  # parents that were never stored or were dropped
            for row in orphans:
                disk.delete(row.node_id)
        self.trie._clock = clock
        log.info("prefix cache: %d stored nodes loaded from %s", placed, disk.dir)

    # ============================================================================================
    # Prefetch, clear, stats, checks
    # ============================================================================================
    def prefetch(self, prompt: TokenIds, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Bring the stored part of ``prompt`` onto the device without running the model;
        returns how many of its tokens are now there (0 after a fault). Other sequences may be
        running meanwhile: their pinned paths stay."""
        return self._prefetch(as_ids(prompt), should_stop)

    @fault_boundary(lambda self, prompt, should_stop: 0)
    def _prefetch(self, prompt: array, should_stop: Callable[[], bool]) -> int:
        match = self.trie.match(prompt)
        ready = 0
        for node in match.path:
            if should_stop():
                break
            if self._load_device(node, prefetch=True) is None:
                self._forget_unreadable(node)
                break
            ready = min(node.end, match.length)
        self._touch([n for n in match.path if n.start < ready])
        self._enforce_budgets()
        return ready

    def read_ahead_for(self, prompt: TokenIds) -> int:
        """Start reading, on the read-ahead thread, the files a restore of ``prompt`` would
        read (the nodes of its stored path that only the disk holds), so that a request waiting
        in the queue finds them read when it begins; how many reads started."""
        return self._read_ahead_for(as_ids(prompt))

    @fault_boundary(lambda self, prompt: 0)
    def _read_ahead_for(self, prompt: array) -> int:
        if self.read_ahead is None or self.disk is None:
            return 0
        started = 0
        for node in self.trie.match(prompt).path:
            data = node.data
            if data.on_disk and not (data.on_device or data.on_host):
                started += self.read_ahead.start(data.id, data.disk)
        return started

    def drop_reads_ahead(self) -> None:
        """Reads ahead that no request took (the engine calls this when idle)."""
        if self.read_ahead is not None:
            self.read_ahead.discard()

    def set_budgets(self, budgets: CacheBudgets) -> None:
        """New budgets, enforced at once (running requests keep their pinned paths)."""
        self.budgets = budgets
        self._guarded_enforce_budgets()

    def enforce_budgets(self) -> None:
        """Move copies down until every tier fits again: running sequences' writes copy lazy
        views of their live buffers out (they then cost bytes), so the engine calls this after
        each step, keeping the budgets between steps."""
        self._guarded_enforce_budgets()

    @fault_boundary(lambda self: None)
    def _guarded_enforce_budgets(self) -> None:
        self._enforce_budgets()

    def clear(self) -> None:
        """Forget every stored prefix (all tiers) and every slot's live caches."""
        self._require_idle()
        self._clear()

    @fault_boundary(lambda self: self._drop_everything())
    def _clear(self) -> None:
        for slot in self.slots:
            for cache in slot.caches:
                cache.free()
            slot.live = array("i")
        for node in list(self.trie.root.children.values()):
            self._forget_subtree(node)
        if self.disk is not None:
            self.disk.clear()
        if self.read_ahead is not None:
            self.read_ahead.discard()
        self._unpersisted.clear()

    def close(self) -> None:
        """Write what is pending and release the disk store (its writer lock). The cache keeps
        working from memory; what only the disk held is forgotten here (the files stay for the
        next process)."""
        if not self.running:
            self.persist()
        if self.disk is None:
            return
        try:
            self._forget_disk_copies()
        finally:
            if self.read_ahead is not None:
                self.read_ahead.close()
                self.read_ahead = None
            self.disk.close()
            self.disk = self.tiers.disk = None

    @fault_boundary(lambda self: None)
    def _forget_disk_copies(self) -> None:
        for node in list(self.trie.nodes()):
            self.tiers.drop_disk(node, delete=False)
        stack = list(self.trie.root.children.values())
        while stack:
            node = stack.pop()
            if node.data.tiers() == 0 and node.locks == 0:
                self._forget_subtree(node)
            else:
                stack.extend(node.children.values())

    def stats(self) -> CacheStats:
        self.tiers.refresh_lazy()
        budgets = (self.budgets.device_bytes, self.budgets.host_bytes,
                   self.budgets.disk_bytes if self.disk else 0)
        disk = self.disk
        return CacheStats(tiers=self.tiers.tier_stats(budgets), nodes=len(self.trie),
                          live_tokens=sum(len(slot.live) for slot in self.slots), live_hits=self.tiers.hits["live"],
                          disk_read_only=disk is not None and disk.read_only,
                          disk_mode=disk.mode if disk is not None else "off",
                          disk_note=disk.note if disk is not None else "no disk tier")

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (tests call this after every
        operation): trie structure, node data per tier, counter identities, the one lock."""
        self.trie.check()
        self.tiers.refresh_lazy()
        for node in self.trie.nodes():
            data = node.data
            assert data is not None, f"{node} has no data"
            assert data.tiers() >= 1, f"{node} is on no tier"
            assert len(data.layers) == len(self.caches)
            for j, kind in enumerate(self.kinds):
                assert data.layers[j] or kind == "state", f"{node} lacks span layer {j}"
            if data.on_device:
                assert [s is not None for s in data.device] == list(data.layers), \
                    f"{node}: device snapshots do not match its layers"
                for s in data.device:
                    if s is not None:
                        assert s.end == node.end, f"{node}: snapshot ends at {s.end}"
                for j, s in enumerate(data.device):
                    if s is not None and self.kinds[j] == "span":
                        assert s.start == node.start, f"{node}: span snapshot starts {s.start}"
            if data.on_host:
                assert [r is not None for r in data.host] == list(data.layers)
        total, count = self.tiers.stored(self.trie.nodes())
        assert total == self.tiers.bytes, f"byte counters {self.tiers.bytes} != stored {total}"
        assert count == self.tiers.entries, f"entry counters {self.tiers.entries} != stored {count}"
        locked = sum(c.locks for c in self.trie.root.children.values())
        pinned = [slot for slot in self.slots if slot.locked is not None]
        assert locked == len(pinned), f"{locked} locked paths, {len(pinned)} pinned by slots"
        for slot in pinned:
            assert slot.request is not None, "a lock outlived its request"
            cached = slot.request.cached
            assert slot.locked.start < cached <= slot.locked.end, \
                f"lock {slot.locked} vs restored {cached}"

    def within_budgets(self) -> bool:
        """Every tier fits its budget, not counting the paths running requests pin (those
        stay whatever the budgets say until their requests end)."""
        self.tiers.refresh_lazy()
        pinned = [n for n in self.trie.nodes() if n.locks > 0]
        return all(self.tiers.bytes[tier] - sum(getattr(n.data, f"{tier}_bytes") for n in pinned)
                   <= budget for tier, budget in (
                       ("device", self.budgets.device_bytes), ("host", self.budgets.host_bytes),
                       ("disk", self.budgets.disk_bytes if self.disk else 0)))

    def _touch(self, nodes: list[TrieNode]) -> None:
        self.trie.touch(nodes)
        if self.disk is not None:
            self.disk.touch([(n.last_used, n.data.id) for n in nodes if n.data.on_disk])

    @property
    def running(self) -> bool:
        """True while any slot's request runs (between ``begin`` and ``commit`` / ``abort``)."""
        return any(slot.running for slot in self.slots)

    def _require_request(self) -> _Request:
        if self._request is None:
            raise PrefixCacheMisuse("no request is running: call begin() first")
        return self._request

    def _require_idle(self) -> None:
        if self.running:
            raise PrefixCacheMisuse("a request is running")

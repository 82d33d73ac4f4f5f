"""The prefix cache's fault boundary: every public operation of ``PrefixCache`` runs inside
``fault_boundary``, and a fault anywhere in it (a cache, the disk, a bug) ends in ``_recover``,
which brings the trie, the tiers' counters, the locks and the live slots back to a consistent
state (see "Faults" in ``prefix_cache.py``'s docstring for what each operation answers then).

``FaultRecovery`` is the part of ``PrefixCache`` that does this; it reads and repairs the
cache's own state: ``slots`` and ``_slot``, ``trie``, ``tiers``, ``caches`` and ``kinds``,
``disk``, ``_unpersisted``, ``_relock`` and ``_enforce_budgets``, and counts ``faults``.
Misuse by the caller is not a fault: ``PrefixCacheMisuse`` passes through.
"""

from __future__ import annotations

import functools
import logging
from array import array
from typing import Callable

from backend.memory.tiers import NodeData, close_all
from backend.memory.trie import PrefixTrie, TrieNode

log = logging.getLogger("backend.memory.prefix_cache")  # one logger for the cache's lines


#: The operations on one slot's request; a fault in any other one leaves every request running.
SLOT_OPERATIONS = ("_begin", "_attach_captures", "_commit", "_abort")


class PrefixCacheMisuse(RuntimeError, ValueError):
    """The caller broke the protocol (not a fault of the cache): this one is raised."""


def fault_boundary(on_fault: Callable):
    """Run a public operation so that a fault inside it leaves the cache consistent
    (``_recover``) and the operation answers ``on_fault(self, *args)``. Calls from inside
    another guarded operation run unguarded: the outer one recovers."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            if self._guarding:
                return method(self, *args, **kwargs)
            self._guarding = True
            try:
                return method(self, *args, **kwargs)
            except PrefixCacheMisuse:
                raise
            except Exception as exc:
                self._recover(method.__name__, exc)
                return on_fault(self, *args, **kwargs)
            finally:
                self._guarding = False

        return guarded

    return wrap


class FaultRecovery:
    """Back to a consistent state after a fault (mixed into ``PrefixCache``)."""

    def _recover(self, operation: str, exc: Exception) -> None:
        """After ``exc`` ended ``operation`` early: no capture left scheduled, the trie without
        any node whose data is missing or torn, no lock but the running request's own, the
        counters rebuilt. The live caches are kept only while a request still writes them
        (a fault while attaching captures) or, when idle, while the trie still holds what
        they hold; otherwise they are dropped and the next request restores or recomputes."""
        self.faults += 1
        kind = f"{operation.strip('_')}: {type(exc).__name__}"
        if kind not in self._faults_logged:
            self._faults_logged.add(kind)
            log.error("prefix cache: a fault in %s (%s); the cache recovered and the turn goes "
                      "on without it", operation.strip("_"), exc, exc_info=exc)
        own = self._slot if operation in SLOT_OPERATIONS else None
        writing = own is not None and own.running and operation == "_attach_captures"
        if own is not None:
            for cache in own.caches:
                try:
                    close_all(cache.take_snapshots())
                    cache.cancel_snapshots()
                except Exception:
                    pass  # its captures are lost; the request still writes its caches
            if writing:
                own.request.offsets = []
            else:
                own.request = None  # a fault while restoring or ending it: the caches in doubt
        try:
            self._repair_trie()
            for slot in self.slots:
                if slot.running:
                    self._relock_restored(slot)
                elif slot is own or not self._trie_holds(slot.live):
                    self._drop_live_caches(slot)
            self._enforce_budgets()
        except Exception as again:  # the trie itself is beyond repair: start it afresh
            log.error("prefix cache: recovery failed (%s); every stored prefix is dropped",
                      again, exc_info=again)
            self._drop_everything()
            for slot in self.slots:
                if not slot.running:
                    self._drop_live_caches(slot)

    def _repair_trie(self) -> None:
        """Forget every node (with its subtree) whose data is missing, on no tier, or whose
        copies disagree with its layers; clear every lock; rebuild the counters."""
        for node in self.trie.nodes():
            node.locks = 0
        for slot in self.slots:
            slot.locked = None
        for node in list(self.trie.nodes()):  # parents first
            if node.parent is not None and not self._intact(node):
                self._drop_subtree_quietly(node)
        self._unpersisted = [n for n in self._unpersisted
                             if n.parent is not None and n.data is not None]
        self.tiers.recount(list(self.trie.nodes()))

    def _intact(self, node: TrieNode) -> bool:
        data = node.data
        if not isinstance(data, NodeData) or data.tiers() == 0:
            return False
        layers = list(data.layers)
        if len(layers) != len(self.caches):
            return False
        if not all(layers[j] for j, kind in enumerate(self.kinds) if kind == "span"):
            return False
        if data.on_device:
            if [s is not None for s in data.device] != layers:
                return False
            for j, snap in enumerate(data.device):
                if snap is not None and (snap.end != node.end or (
                        self.kinds[j] == "span" and snap.start != node.start)):
                    return False
        return not data.on_host or [r is not None for r in data.host] == layers

    def _drop_subtree_quietly(self, node: TrieNode) -> None:
        """Forget a subtree whose data may be torn: snapshots closed where they still can be,
        stored files deleted, the counters left to ``recount``."""
        for child in list(node.children.values()):
            self._drop_subtree_quietly(child)
        data = node.data
        if isinstance(data, NodeData):
            for snap in data.device or ():
                try:
                    if snap is not None:
                        snap.close()
                except Exception:
                    pass  # already closed, or handed on before the fault
            if data.on_disk and self.disk is not None:
                self.disk.delete(data.id)
            data.device = data.host = data.disk = None
        self.tiers.lazy.discard(node)
        node.locks = 0
        self.trie.remove_leaf(node)

    def _relock_restored(self, slot: LiveSlot) -> None:
        """Pin a running request's restored path again, where the repair left it."""
        request = slot.request
        if request.cached == 0:
            return
        match = self.trie.match(request.prompt[:request.cached])
        if match.length == request.cached:
            self._relock(match.node_at(request.cached - 1), slot)

    def _trie_holds(self, ids: array) -> bool:
        return not ids or self.trie.match(ids).length == len(ids)

    def _drop_live_caches(self, slot: LiveSlot) -> None:
        for cache in slot.caches:
            cache.free()
        slot.live = array("i")

    def _drop_everything(self) -> None:
        """The last resort: a fresh trie (device snapshots closed where they can be)."""
        for node in list(self.trie.root.children.values()):
            try:
                self._drop_subtree_quietly(node)
            except Exception:
                pass
        self.trie = PrefixTrie()
        for slot in self.slots:
            slot.locked = None
        self._unpersisted = []
        self.tiers.recount([])

"""Where each trie node's data lives (device / host / disk), and the counters per tier.

Scope: residency bookkeeping only. ``NodeData`` holds one node's copies; ``TierLedger`` is the
one place that changes them and the byte, entry, hit and eviction counters, one method per
transition (``set_device``, ``drop_device``, ``set_host``, ``drop_host``, ``set_disk``,
``drop_disk``). Which copy to move when (matching, capture schedule, LRU order) is the prefix
cache's policy (``prefix_cache.py``), not this module's.

Every transition computes what it needs (sizes, the disk delete) before it changes anything, so
a fault inside one leaves the node and the counters as they were. After a fault elsewhere the
prefix cache may still call ``recount`` to rebuild the counters from the nodes themselves.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from backend.api import TierStats
from backend.memory.disk import DiskEntry, DiskStore, new_node_id
from backend.memory.records import LayerRecords, records_nbytes
from backend.memory.trie import TrieNode

TIERS = ("device", "host", "disk")


class NodeData:
    """What a node stores, and on which tiers. ``loaded_from``: the tier a prefetch brought
    the device copy from (the next restore credits that tier, not the device)."""

    __slots__ = ("id", "layers", "device", "host", "disk", "device_bytes", "host_bytes",
                 "loaded_from")

    def __init__(self, layers: Sequence[bool], node_id: str | None = None) -> None:
        self.id = node_id or new_node_id()
        self.layers = tuple(layers)  # which layers have a snapshot at this node
        self.device: list | None = None
        self.host: LayerRecords | None = None
        self.disk: DiskEntry | None = None
        self.device_bytes = 0
        self.host_bytes = 0
        self.loaded_from: str | None = None

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def on_host(self) -> bool:
        return self.host is not None

    @property
    def on_disk(self) -> bool:
        return self.disk is not None

    @property
    def disk_bytes(self) -> int:
        return 0 if self.disk is None else self.disk.nbytes

    def tiers(self) -> int:
        return self.on_device + self.on_host + self.on_disk


def _device_nbytes(snaps: Iterable) -> int:
    return sum(s.nbytes for s in snaps if s is not None)


def _has_lazy(snaps: Iterable) -> bool:
    return any(s is not None and s.is_lazy for s in snaps)


def close_all(snaps) -> None:
    for snap in snaps:
        if snap is not None:
            snap.close()


class TierLedger:
    """See the module docstring. ``disk``: the store a dropped disk copy is deleted from
    (None: no disk tier, or it was released)."""

    def __init__(self, disk: DiskStore | None) -> None:
        self.disk = disk
        self.bytes = dict.fromkeys(TIERS, 0)
        self.entries = dict.fromkeys(TIERS, 0)
        self.hits = dict.fromkeys(("live",) + TIERS, 0)
        self.evictions = dict.fromkeys(TIERS, 0)
        self.lazy: set[TrieNode] = set()  # nodes with device snapshots still viewing live buffers

    # -- transitions -----------------------------------------------------------------------------
    def set_device(self, node: TrieNode, snaps: list, layers: tuple | None = None) -> None:
        data = node.data
        snaps = list(snaps)
        nbytes, lazy = _device_nbytes(snaps), _has_lazy(snaps)
        self.drop_device(node)
        if layers is not None:
            data.layers = layers
        data.device, data.device_bytes = snaps, nbytes
        self.bytes["device"] += nbytes
        self.entries["device"] += 1
        if lazy:
            self.lazy.add(node)

    def drop_device(self, node: TrieNode) -> None:
        """Forget the device copy (the caller closed or handed on its snapshots)."""
        data = node.data
        if data is None or not data.on_device:
            return
        self.bytes["device"] -= data.device_bytes
        self.entries["device"] -= 1
        data.device, data.device_bytes, data.loaded_from = None, 0, None
        self.lazy.discard(node)

    def set_host(self, node: TrieNode, records: LayerRecords) -> None:
        nbytes = records_nbytes(records)
        self.drop_host(node)
        node.data.host, node.data.host_bytes = records, nbytes
        self.bytes["host"] += nbytes
        self.entries["host"] += 1

    def drop_host(self, node: TrieNode) -> None:
        data = node.data
        if data is None or not data.on_host:
            return
        self.bytes["host"] -= data.host_bytes
        self.entries["host"] -= 1
        data.host, data.host_bytes = None, 0

    def set_disk(self, node: TrieNode, entry: DiskEntry) -> None:
        self.drop_disk(node, delete=False)
        node.data.disk = entry
        self.bytes["disk"] += entry.nbytes
        self.entries["disk"] += 1

    def drop_disk(self, node: TrieNode, delete: bool = True) -> None:
        data = node.data
        if data is None or not data.on_disk:
            return
        if delete and self.disk is not None:
            self.disk.delete(data.id)
        self.bytes["disk"] -= data.disk_bytes
        self.entries["disk"] -= 1
        data.disk = None

    def clear(self, node: TrieNode) -> None:
        """Drop every copy of the node's data (device snapshots closed)."""
        data = node.data
        if data is None:
            return
        if data.on_device:
            snaps = data.device
            self.drop_device(node)  # first: a fault while closing leaves no node holding them
            close_all(snaps)
        self.drop_host(node)
        self.drop_disk(node)

    def refresh_lazy(self) -> None:
        """Lazy views that the live caches copied out since now cost their bytes."""
        for node in list(self.lazy):
            data = node.data
            if data is None or not data.on_device:
                self.lazy.discard(node)
                continue
            now = _device_nbytes(data.device)
            self.bytes["device"] += now - data.device_bytes
            data.device_bytes = now
            if not _has_lazy(data.device):
                self.lazy.discard(node)

    # -- checks and repair -----------------------------------------------------------------------
    def stored(self, nodes: Iterable[TrieNode]) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes and entries per tier as the nodes themselves hold them."""
        total = dict.fromkeys(TIERS, 0)
        count = dict.fromkeys(TIERS, 0)
        for node in nodes:
            data = node.data
            for tier in TIERS:
                total[tier] += getattr(data, f"{tier}_bytes")
                count[tier] += getattr(data, f"on_{tier}")
        return total, count

    def recount(self, nodes: Sequence[TrieNode]) -> None:
        """Rebuild the byte and entry counters and the lazy set from the nodes (after a fault
        interrupted an operation; the transitions keep them exact otherwise)."""
        self.lazy = {n for n in nodes if n.data.on_device and _has_lazy(n.data.device)}
        for node in nodes:
            if node.data.on_device:
                node.data.device_bytes = _device_nbytes(node.data.device)
        self.bytes, self.entries = self.stored(nodes)

    def tier_stats(self, budgets: tuple[int, int, int]) -> dict[str, TierStats]:
        return {t: TierStats(self.bytes[t], budget, self.entries[t], self.hits[t],
                             self.evictions[t]) for t, budget in zip(TIERS, budgets)}

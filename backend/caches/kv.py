"""KVCache: full-attention keys/values in a growing buffer, with lazy snapshots.

Storage is logical order: slot i holds position i, so attention takes MLX's fused causal and
no-mask paths. The buffer grows in ``STEP``-token blocks so decode appends in place.

Lazy snapshots: a ``KVSnapshot`` taken from the live cache is only an index range ``[start,
end)``; it owns no memory while the live buffer still holds those positions unchanged. Before a
write would overwrite part of a lazy range (a write at an offset below ``end``, i.e. after a
rewind) and when the cache is freed, the cache copies the range out into a compact array of its
own (``mx.contiguous`` allocates exactly the slice: a test pins that the big buffer is released).
This makes speculative rejection free: rewinding is an offset move and nothing is copied unless
the rejected slots are actually rewritten while a snapshot still needs them.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from backend.caches.base import SnapshotSchedule
from backend.caches.export import make_record, read_record
from backend.memory.records import SnapshotRecord

STEP = 256


def grown(buffer: mx.array | None, like: mx.array, needed: int) -> mx.array | None:
    """``buffer`` (``(B, H, slots, D)``, or None) with room for ``needed`` slots: grown by zeros
    shaped like ``like`` in ``STEP``-token blocks, or itself when it has the room already."""
    capacity = 0 if buffer is None else buffer.shape[2]
    if needed <= capacity:
        return buffer
    blocks = (needed - capacity + STEP - 1) // STEP
    b, h, _, d = like.shape
    grow = mx.zeros((b, h, blocks * STEP, d), like.dtype)
    return grow if buffer is None else mx.concatenate([buffer, grow], axis=2)


class ContiguousHistory:
    """KV history: slot i holds logical position ``key_start + i``."""

    __slots__ = ("keys", "values", "query_start", "num_queries", "key_start")

    def __init__(self, keys: mx.array, values: mx.array, query_start: int, num_queries: int,
                 key_start: int = 0):
        self.keys = keys
        self.values = values
        self.query_start = query_start
        self.num_queries = num_queries
        self.key_start = key_start


class KVSnapshot:
    """Keys/values of positions ``[lo, end)`` as they stood at ``end``, covering the tokens
    ``[start, end)`` (``lo == start`` for a full-attention cache; a sliding window's snapshot
    also carries the window before ``start``). Lazy (a view ``owner._view(lo, end)``) until
    ``_copy_out``, then owned arrays."""

    def __init__(self, owner: "KVCache | None", start: int, end: int,
                 keys: mx.array | None = None, values: mx.array | None = None,
                 lo: int | None = None):
        self.start = start
        self.end = end
        self.lo = start if lo is None else lo
        self._owner = owner
        self._keys = keys
        self._values = values

    @property
    def is_lazy(self) -> bool:
        return self._owner is not None

    @property
    def nbytes(self) -> int:
        if self._keys is None:
            return 0
        return self._keys.nbytes + self._values.nbytes

    def arrays(self) -> tuple[mx.array, mx.array]:
        """Keys and values ``(B, H, end - lo, D)`` in position order; views while lazy."""
        if self._owner is not None:
            return self._owner._view(self.lo, self.end)
        if self._keys is None:
            raise ValueError(f"snapshot [{self.start}, {self.end}) was closed")
        return self._keys, self._values

    def _copy_out(self) -> None:
        copy_out([self])

    def _detach(self) -> list[mx.array]:
        """Own (lazy) copies of the viewed range, returned for ``copy_out`` to evaluate."""
        keys, values = self._owner._view(self.lo, self.end)
        # contiguous allocates exactly this range (a slice alone would keep the buffer alive).
        self._keys, self._values = mx.contiguous(keys), mx.contiguous(values)
        self._owner = None
        return [self._keys, self._values]

    def close(self) -> None:
        if self._owner is not None:
            self._owner._forget(self)
        self._owner = None
        self._keys = self._values = None


def copy_out(snapshots: Sequence) -> None:
    """Give lazy snapshots (any kind with ``_detach``) copies of their own before their buffer
    is written, evaluated together (a restore overwrites dozens at once; one evaluation each
    was a host sync each)."""
    mx.eval([a for snap in snapshots for a in snap._detach()])


class LazyKVStorage:
    """What the attention caches share: key/value buffers, the write offset, the lazy snapshots
    still viewing the buffers, and the snapshot schedule. A subclass provides ``_view(lo, end)``
    (positions in order, as views) and ``_new_snapshot(start, end)``."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None  # (B, H, slots, D)
        self.values: mx.array | None = None
        self._offset = 0
        self._lazy: list[KVSnapshot] = []
        self._schedule = SnapshotSchedule()

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def _forget(self, snapshot: KVSnapshot) -> None:
        self._lazy = [s for s in self._lazy if s is not snapshot]

    def _new_snapshot(self, start: int, end: int) -> KVSnapshot:
        raise NotImplementedError

    def _lazy_snapshot(self, start: int, end: int) -> KVSnapshot:
        snap = self._new_snapshot(start, end)
        self._lazy.append(snap)
        return snap

    def _capture_due(self, old: int, new: int) -> None:
        for offset in self._schedule.due(old, new):
            snap = self._lazy_snapshot(self._schedule.segment_start(), offset)
            self._schedule.mark_taken(offset, snap)

    def prepare_snapshots(self, offsets: Sequence[int]) -> None:
        self._schedule.prepare(offsets, self._offset)
        self._capture_due(self._offset, self._offset)  # an offset equal to the current one

    def take_snapshots(self) -> list[KVSnapshot]:
        return self._schedule.take()

    def cancel_snapshots(self) -> None:
        self._schedule.discard_pending()

    # -- records (host / disk tiers) -------------------------------------------------------------
    _record_kind = "kv"

    def export_snapshot(self, snapshot: KVSnapshot) -> SnapshotRecord:
        keys, values = snapshot.arrays()
        return make_record(self._record_kind, snapshot.start, snapshot.end,
                           {"keys": keys, "values": values}, lo=snapshot.lo)

    def import_snapshot(self, record: SnapshotRecord) -> KVSnapshot:
        arrays = read_record(record, self._record_kind)
        meta = record.meta
        return self._owned_snapshot(meta["start"], meta["end"], meta["lo"],
                                    arrays["keys"], arrays["values"])

    def _owned_snapshot(self, start: int, end: int, lo: int, keys: mx.array,
                        values: mx.array) -> KVSnapshot:
        raise NotImplementedError


class SpanKVStorage(LazyKVStorage):
    """Lazy storage in logical order (slot i holds position i) whose snapshots are spans
    ``[start, end)`` of it: what the full-attention and latent caches share (rewind, snapshot,
    restore, merge, split, free). A subclass names its ``_snapshot_type`` and provides
    ``_replay(snapshot, n)`` (write the snapshot's first ``n`` positions at the offset) and
    ``_joined`` / ``_cut`` (merge, split snapshots that own their arrays)."""

    can_rewind = True
    snapshot_kind = "span"
    _snapshot_type: type  # what restore takes
    _cache_name: str  # in restore's error

    def can_rewind_to(self, target: int) -> bool:
        return 0 <= target <= self._offset

    def _protect_from(self, position: int) -> None:
        """Copy out every lazy snapshot that a write starting at ``position`` would overwrite."""
        overwritten = [snap for snap in self._lazy if snap.end > position]
        if overwritten:
            copy_out(overwritten)
            self._lazy = [snap for snap in self._lazy if snap.end <= position]

    def snapshot(self, start: int, end: int | None = None):
        """A lazy snapshot of ``[start, end)`` of the live state (``end`` defaults to offset)."""
        end = self._offset if end is None else end
        if not 0 <= start <= end <= self._offset:
            raise ValueError(f"snapshot range [{start}, {end}) outside [0, {self._offset})")
        return self._lazy_snapshot(start, end)

    def restore(self, snapshot, target: int) -> bool:
        if target < 0:
            raise ValueError(f"restore target {target} is negative")
        if snapshot is None:
            if target > self._offset:
                raise ValueError(f"cannot rewind forward: target {target} > offset {self._offset}")
            self._offset = target
            return True
        if type(snapshot) is not self._snapshot_type:  # not a sliding window's (a subclass)
            raise TypeError(f"{self._cache_name} cannot restore a {type(snapshot).__name__}")
        if not snapshot.start <= target <= snapshot.end:
            raise ValueError(
                f"target {target} outside snapshot range [{snapshot.start}, {snapshot.end}]")
        if snapshot.start > self._offset:
            return False  # the prefix before the snapshot is not in the live cache
        if snapshot._owner is self:
            # Still lazy here: the live buffer holds exactly these positions; move the offset.
            self._offset = target
            return True
        self._offset = snapshot.start
        if target > snapshot.start:
            self._replay(snapshot, target - snapshot.start)
        return True

    def merge(self, first, second):
        if first.end != second.start:
            raise ValueError(f"snapshots [{first.start}, {first.end}) and "
                             f"[{second.start}, {second.end}) are not adjacent")
        if first._owner is not None and first._owner is second._owner:
            merged = first._owner._lazy_snapshot(first.start, second.end)
        else:
            merged = self._joined(first, second)
        first.close()
        second.close()
        return merged

    def split(self, snapshot, at: int) -> tuple:
        if not snapshot.start < at < snapshot.end:
            raise ValueError(f"split point {at} not inside [{snapshot.start}, {snapshot.end})")
        if snapshot._owner is not None:
            owner = snapshot._owner
            parts = owner._lazy_snapshot(snapshot.start, at), owner._lazy_snapshot(at, snapshot.end)
        else:
            parts = self._cut(snapshot, at)
        snapshot.close()
        return parts

    def free(self) -> None:
        """Release the live buffer, first copying out every lazy snapshot that still needs it."""
        self._protect_from(0)
        self.keys = self.values = None
        self._offset = 0

    def _replay(self, snapshot, n: int) -> None:
        raise NotImplementedError

    def _joined(self, first, second):
        raise NotImplementedError

    def _cut(self, snapshot, at: int) -> tuple:
        raise NotImplementedError


class KVCache(SpanKVStorage):
    """Full-attention cache; see the module docstring and ``caches.base`` for the contract."""

    _snapshot_type = KVSnapshot
    _cache_name = "KVCache"

    def _view(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        return self.keys[..., start:end, :], self.values[..., start:end, :]

    def reserve(self, tokens: int) -> None:
        if self.keys is not None:
            self._reserve(self.keys[..., :0, :], self.values[..., :0, :], tokens)

    def _owned_snapshot(self, start, end, lo, keys, values) -> KVSnapshot:
        if lo != start or keys.shape[2] != end - start:
            raise ValueError(f"a full-attention record must hold exactly [{start}, {end})")
        return KVSnapshot(None, start, end, keys, values)

    # -- writing -------------------------------------------------------------------------------
    def _reserve(self, keys: mx.array, values: mx.array, needed: int) -> None:
        self.keys = grown(self.keys, keys, needed)
        self.values = grown(self.values, values, needed)

    def update(self, keys: mx.array, values: mx.array) -> ContiguousHistory:
        """Append ``keys``/``values`` ``(B, H, N, D)`` at the current offset."""
        start, n = self._offset, keys.shape[2]
        self.append(keys, values)
        return ContiguousHistory(self.keys[..., : self._offset, :],
                                 self.values[..., : self._offset, :], start, n)

    def visible_keys(self, position: int) -> ContiguousHistory:
        """The keys and values a query at stored ``position`` sees, itself included: positions
        ``[0, position]`` (a drafter reading this layer's keys; nothing changes)."""
        if not 0 <= position < self._offset:
            raise ValueError(f"keys visible at {position} of a cache holding {self._offset}")
        return ContiguousHistory(self.keys[..., :position + 1, :],
                                 self.values[..., :position + 1, :], position, 1)

    def append(self, keys: mx.array, values: mx.array) -> None:
        """``update`` without the history views: afterwards the buffers ``self.keys`` /
        ``self.values`` hold positions ``0 .. offset - 1`` (a kernel reading the buffers in
        place needs no slices of them; models/fused_layer.py)."""
        start, n = self._offset, keys.shape[2]
        if self._lazy:
            self._protect_from(start)
        self._reserve(keys, values, start + n)
        self.keys[:, :, start:start + n] = keys  # (B, H, L, D): cheaper to parse than [..., :]
        self.values[:, :, start:start + n] = values
        self._offset = start + n
        self._capture_due(start, self._offset)

    def holds_float32(self) -> bool:
        """Whether ``append`` keeps float32 buffers: empty, or float32 already."""
        return self.keys is None or (self.keys.dtype == mx.float32
                                     and self.values.dtype == mx.float32)

    # -- snapshots -----------------------------------------------------------------------------
    def _new_snapshot(self, start: int, end: int) -> KVSnapshot:
        return KVSnapshot(self, start, end)

    def _replay(self, snapshot: KVSnapshot, n: int) -> None:
        keys, values = snapshot.arrays()
        self.append(keys[..., :n, :], values[..., :n, :])

    def _joined(self, first: KVSnapshot, second: KVSnapshot) -> KVSnapshot:
        k1, v1 = first.arrays()
        k2, v2 = second.arrays()
        keys = mx.concatenate([k1, k2], axis=2)
        values = mx.concatenate([v1, v2], axis=2)
        mx.eval(keys, values)
        return KVSnapshot(None, first.start, second.end, keys, values)

    def _cut(self, snapshot: KVSnapshot, at: int) -> tuple[KVSnapshot, KVSnapshot]:
        keys, values = snapshot.arrays()
        cut = at - snapshot.start
        k1, v1 = mx.contiguous(keys[..., :cut, :]), mx.contiguous(values[..., :cut, :])
        k2, v2 = mx.contiguous(keys[..., cut:, :]), mx.contiguous(values[..., cut:, :])
        mx.eval(k1, v1, k2, v2)
        return (KVSnapshot(None, snapshot.start, at, k1, v1),
                KVSnapshot(None, at, snapshot.end, k2, v2))

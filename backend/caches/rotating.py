"""RotatingKVCache: sliding-window keys/values in a ring, with lazy snapshots.

A sliding-window layer with window ``w`` lets the query at position ``p`` see keys at positions
``(p - w, p]``, so after ``offset`` tokens only positions ``[offset - w + 1, offset)`` matter for
what comes next. Storage layout (``S`` slots, ``first`` = the position stored in slot 0 when the
layout was last made linear)::

    slot(p) = (p - first) mod S          positions [lo, offset) are stored, offset - lo <= S

* Single-token writes (decode) go into the ring: the buffer grows in ``STEP`` blocks up to ``w``
  slots, then each write overwrites the position ``w`` back.
* Multi-token writes (prefill chunks, verify blocks) first lay the ring out in logical order
  (linearize when it has wrapped, drop the stale tail when it has not), keep the last ``w - 1``
  old positions and append all new ones, so the first query of the batch still sees its whole
  window. The buffer then holds ``w - 1 + n`` slots until the next single-token write trims it.

The history returned to attention is the stored positions ``[lo, offset)`` in logical order (a
wrapped ring is unrolled with one copy of the window), so attention reads the same keys in the
same order whatever layout a restore, a rewind or step-by-step writes left behind: replies do
not depend on how the cache got to its state, bit for bit.

Rewind (``restore(None, t)``) is an offset move whenever the window before ``t`` is still stored
(always before the first wrap, and anywhere inside the last multi-token write, e.g. a verify
block); otherwise it returns False and a snapshot is needed.

Snapshots: the snapshot at ``end`` is the window ``[max(0, end - w + 1), end)``. It starts *lazy*
(positions of the live buffer, zero bytes) and is copied out into compact arrays of its own just
before a write would overwrite or drop any of its positions, before the buffer is replaced, and
when the cache is freed.
"""

from __future__ import annotations


import mlx.core as mx

from backend.caches.kv import ContiguousHistory, KVSnapshot, LazyKVStorage, copy_out

STEP = 256


class RotatingSnapshot(KVSnapshot):
    """The window ``[lo, end)`` as it stood at ``end`` (covering tokens ``[start, end)``)."""

    def __init__(self, owner: "RotatingKVCache | None", start: int, end: int, lo: int,
                 keys: mx.array | None = None, values: mx.array | None = None):
        super().__init__(owner, start, end, keys, values, lo=lo)


class RotatingKVCache(LazyKVStorage):
    """Sliding-window cache; see the module docstring and ``caches.base`` for the contract."""

    can_rewind = True  # within the stored window; restore says False beyond it
    snapshot_kind = "state"
    _record_kind = "rotating"

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__()
        self.window = window
        self._first = 0  # position stored in slot 0 of the current layout
        self._lo = 0  # lowest position still stored

    # -- state ---------------------------------------------------------------------------------
    @property
    def _slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def stored_range(self) -> tuple[int, int]:
        """Positions ``[lo, offset)`` the live buffer holds."""
        return self._lo, self._offset

    def _window_start(self, position: int) -> int:
        """First position the window before ``position`` needs."""
        return max(0, position - self.window + 1)

    def _view(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Positions ``[start, end)`` (stored) in logical order, as lazy slices of the buffer."""
        if end <= start:
            empty = self.keys[..., :0, :], self.values[..., :0, :]
            return empty
        s = self._slots
        first_slot = (start - self._first) % s
        n = end - start
        if first_slot + n <= s:
            return (self.keys[..., first_slot:first_slot + n, :],
                    self.values[..., first_slot:first_slot + n, :])
        split = s - first_slot
        keys = mx.concatenate([self.keys[..., first_slot:, :], self.keys[..., :n - split, :]], 2)
        values = mx.concatenate([self.values[..., first_slot:, :],
                                 self.values[..., :n - split, :]], 2)
        return keys, values

    def _protect(self, overwrite_from: int, new_lo: int) -> None:
        """Copy out lazy snapshots that need a position >= ``overwrite_from`` (about to be
        rewritten) or < ``new_lo`` (about to be dropped)."""
        due, keep = [], []
        for snap in self._lazy:
            (due if snap.end > overwrite_from or snap.lo < new_lo else keep).append(snap)
        if due:
            copy_out(due)
            self._lazy = keep

    def _relayout(self, keep: int, extra: int, keys: mx.array | None = None,
                  values: mx.array | None = None) -> None:
        """New linear buffer: the last ``keep`` stored positions, then ``keys``/``values`` (or
        ``extra`` empty slots)."""
        start = self._offset - keep
        parts_k, parts_v = [], []
        if keep:
            old_k, old_v = self._view(start, self._offset)
            parts_k.append(old_k)
            parts_v.append(old_v)
        if keys is not None:
            parts_k.append(keys)
            parts_v.append(values)
        elif extra:
            b, h, _, dk = self.keys.shape
            parts_k.append(mx.zeros((b, h, extra, dk), self.keys.dtype))
            parts_v.append(mx.zeros((b, h, extra, self.values.shape[3]), self.values.dtype))
        self.keys = parts_k[0] if len(parts_k) == 1 else mx.concatenate(parts_k, axis=2)
        self.values = parts_v[0] if len(parts_v) == 1 else mx.concatenate(parts_v, axis=2)
        self._first = self._lo = start

    # -- writing -------------------------------------------------------------------------------
    def update(self, keys: mx.array, values: mx.array) -> ContiguousHistory:
        """Write ``keys``/``values`` ``(B, H, N, D)`` at the current offset."""
        start, n = self._offset, keys.shape[2]
        if n == 1 and self.keys is not None:
            self._write_one(keys, values)
        else:
            keep = min(self.window - 1, start - self._lo)
            self._protect(start, start - keep)
            self._relayout(keep, 0, keys, values)
        self._offset = start + n
        self._capture_due(start, self._offset)
        return self._history(start, n)

    def _write_one(self, keys: mx.array, values: mx.array) -> None:
        p, s = self._offset, self._slots
        if p - self._first >= s and s != self.window:
            keep = min(self.window - 1, p - self._lo)
            if s > self.window:  # after a long multi-token write: trim to the window
                self._protect(p, p - keep)
                self._relayout(keep, self.window - keep)
            else:  # still filling the first window: grow in place
                self._relayout(p - self._first, min(self.window, s + STEP) - s)
            s = self._slots
        new_lo = max(self._lo, p - s + 1)
        self._protect(p, new_lo)
        slot = (p - self._first) % s
        self.keys[..., slot:slot + 1, :] = keys
        self.values[..., slot:slot + 1, :] = values
        self._lo = new_lo

    def _history(self, start: int, n: int) -> ContiguousHistory:
        keys, values = self._view(self._lo, self._offset)  # logical order, one copy if wrapped
        return ContiguousHistory(keys, values, start, n, key_start=self._lo)

    def visible_keys(self, position: int) -> ContiguousHistory:
        """The keys and values a query at stored ``position`` sees, itself included, as far as
        they are still stored: ``[max(position - window + 1, lo), position]`` in logical order
        (``key_start`` says where they begin; a drafter reading this layer's keys; nothing
        changes). A single-token write overwrites the window's oldest position: a reader that
        needs it keeps it from before (``speculation/assistant.py``)."""
        if not self._lo <= position < self._offset:
            raise ValueError(f"keys visible at {position} of a window holding "
                             f"[{self._lo}, {self._offset})")
        lo = max(self._window_start(position), self._lo)
        keys, values = self._view(lo, position + 1)
        return ContiguousHistory(keys, values, position, 1, key_start=lo)

    # -- snapshots -----------------------------------------------------------------------------
    def _new_snapshot(self, start: int, end: int) -> RotatingSnapshot:
        return RotatingSnapshot(self, start, end, self._window_start(end))

    def snapshot(self, start: int = 0, end: int | None = None) -> RotatingSnapshot:
        """A lazy snapshot of the live window, covering ``[start, offset)``."""
        if not 0 <= start <= self._offset or end not in (None, self._offset):
            raise ValueError(f"snapshot [{start}, {end}) of a window at {self._offset}: only the "
                             f"window at the offset exists")
        return self._lazy_snapshot(start, self._offset)

    def _can_rewind_to(self, target: int) -> bool:
        return target <= self._offset and self._window_start(target) >= self._lo

    def can_rewind_to(self, target: int) -> bool:
        return target == 0 or (0 <= target and self._can_rewind_to(target))

    def reserve(self, tokens: int) -> None:
        pass  # a window never grows past its size

    def _owned_snapshot(self, start, end, lo, keys, values) -> RotatingSnapshot:
        if keys.shape[2] != end - lo or lo != self._window_start(end):
            raise ValueError(f"a window record [{lo}, {end}) does not fit window {self.window}")
        return RotatingSnapshot(None, start, end, lo, keys, values)

    def restore(self, snapshot: RotatingSnapshot | None, target: int) -> bool:
        if target < 0:
            raise ValueError(f"restore target {target} is negative")
        if snapshot is None:
            if target > self._offset:
                raise ValueError(f"cannot rewind forward: target {target} > offset {self._offset}")
            if target == 0:
                self._reset()
                return True
            if not self._can_rewind_to(target):
                return False  # the window before target was overwritten
            self._offset = target
            return True
        if not isinstance(snapshot, RotatingSnapshot):
            raise TypeError(f"RotatingKVCache cannot restore a {type(snapshot).__name__}")
        if not snapshot.start <= target <= snapshot.end:
            raise ValueError(
                f"target {target} outside snapshot range [{snapshot.start}, {snapshot.end}]")
        if target == snapshot.end and snapshot._owner is self:
            self._offset = target  # still lazy here: the live buffer holds that window
            return True
        if target == snapshot.end or snapshot.lo == 0:
            # The snapshot alone holds the window before target.
            self._load(snapshot, target)
            return True
        if snapshot.lo <= snapshot.start and self._can_rewind_to(snapshot.start):
            # Window before target = live positions before start + the snapshot's [start, target).
            keys, values = snapshot.arrays()
            cut = slice(snapshot.start - snapshot.lo, target - snapshot.lo)
            keys, values = keys[..., cut, :], values[..., cut, :]
            self._offset = snapshot.start
            if target > snapshot.start:
                self.update(keys, values)
            return True
        return False

    def _load(self, snapshot: RotatingSnapshot, target: int) -> None:
        keys, values = snapshot.arrays()
        lo = self._window_start(target)
        keys = keys[..., lo - snapshot.lo:target - snapshot.lo, :]
        values = values[..., lo - snapshot.lo:target - snapshot.lo, :]
        if snapshot.is_lazy:  # views of a live buffer: take compact copies
            keys, values = mx.contiguous(keys), mx.contiguous(values)
        self._protect(-1, 0)  # the buffer is replaced: every lazy snapshot copies out
        self.keys, self.values = keys, values
        self._first = self._lo = lo
        self._offset = target

    def _reset(self) -> None:
        self._protect(-1, 0)
        self.keys = self.values = None
        self._offset = self._first = self._lo = 0

    def merge(self, first: RotatingSnapshot, second: RotatingSnapshot) -> RotatingSnapshot:
        if first.end != second.start:
            raise ValueError(f"snapshots [{first.start}, {first.end}) and "
                             f"[{second.start}, {second.end}) are not adjacent")
        merged = self._rebased(second, first.start)
        first.close()
        second.close()
        return merged

    def split(self, snapshot: RotatingSnapshot, at: int) -> tuple[None, RotatingSnapshot]:
        """The window at ``at`` is not held by the snapshot: the first part is ``None``."""
        if not snapshot.start < at < snapshot.end:
            raise ValueError(f"split point {at} not inside [{snapshot.start}, {snapshot.end})")
        second = self._rebased(snapshot, at)
        snapshot.close()
        return None, second

    def _rebased(self, snapshot: RotatingSnapshot, start: int) -> RotatingSnapshot:
        """The same window under a new start (shares the owner or the arrays)."""
        if snapshot._owner is not None:
            owner = snapshot._owner
            rebased = RotatingSnapshot(owner, start, snapshot.end, snapshot.lo)
            owner._lazy.append(rebased)
            return rebased
        keys, values = snapshot.arrays()
        return RotatingSnapshot(None, start, snapshot.end, snapshot.lo, keys, values)

    def free(self) -> None:
        """Release the live buffer, first copying out every lazy snapshot that still needs it."""
        self._reset()

"""RecurrentCache: the conv state and gated-delta state of one linear-attention layer.

The state after ``offset`` tokens is two arrays: ``conv`` ``(B, K-1, C)`` (the last inputs of the
causal convolution, activation dtype) and ``delta`` ``(B, Hv, Dv, Dk)`` (always float32, whatever
the activations: low-precision accumulation over long prompts drifts). ``delta`` may be None
throughout: a conv-only state, like the target hidden state the MTP drafter carries to the
next position (``speculation/mtp.py``).

A recurrent state cannot be rewound: ``can_rewind`` is False and ``restore`` succeeds only at an
exact snapshot offset (or the current one). Snapshots are cheap to take because MLX arrays are
immutable: a snapshot holds the state arrays the scan produced at that boundary, nothing is
copied, and each one is its own compact buffer (the segmented scans in ``scan.py`` guarantee
that), so a snapshot never keeps a larger buffer alive.

Writing, from the layer's side::

    bounds = cache.boundaries(n)          # token counts in (0, n] where a state is needed
    y, conv_states = causal_conv1d(x, w, cache.conv, bounds)
    y, delta_states = gated_delta(q, k, v, log_g, beta, cache.delta, bounds)
    cache.advance(n, conv_states, delta_states)
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from backend.caches.base import SnapshotSchedule
from backend.caches.export import make_record, read_record
from backend.memory.records import SnapshotRecord


class RecurrentSnapshot:
    """The recurrent state at ``end`` (covering tokens ``[start, end)`` of the sequence)."""

    def __init__(self, start: int, end: int, conv: mx.array | None, delta: mx.array | None):
        self.start = start
        self.end = end
        self._conv = conv
        self._delta = delta
        self._closed = False

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self._conv, self._delta) if a is not None)

    @property
    def is_lazy(self) -> bool:
        return False  # it holds the scan's own immutable state arrays

    def state(self) -> tuple[mx.array | None, mx.array | None]:
        if self._closed:
            raise ValueError(f"snapshot [{self.start}, {self.end}) was closed")
        return self._conv, self._delta

    def arrays(self) -> list[mx.array]:
        return [a for a in (self._conv, self._delta) if a is not None]

    def close(self) -> None:
        self._conv = self._delta = None
        self._closed = True


class RecurrentCache:
    """Conv + gated-delta state; see the module docstring and ``caches.base`` for the contract."""

    can_rewind = False
    snapshot_kind = "state"

    def __init__(self) -> None:
        self.conv: mx.array | None = None  # (B, K-1, C), None before the first write
        self.delta: mx.array | None = None  # (B, Hv, Dv, Dk) float32
        self._offset = 0
        self._schedule = SnapshotSchedule()

    # -- state ---------------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self._offset

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.delta) if a is not None)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.conv, self.delta) if a is not None]

    # -- writing -------------------------------------------------------------------------------
    def boundaries(self, n: int) -> list[int]:
        """Token counts in ``(0, n]`` after which a write of ``n`` tokens must report its state:
        the scheduled snapshot offsets it crosses, then ``n`` (the new live state)."""
        if n < 1:
            raise ValueError(f"a write needs at least one token, got {n}")
        due = [o - self._offset for o in self._schedule.due(self._offset + 1, self._offset + n)]
        return due if due and due[-1] == n else due + [n]

    def advance(self, n: int, conv_states: Sequence[mx.array],
                delta_states: Sequence[mx.array]) -> None:
        """Record a write of ``n`` tokens given the states at ``boundaries(n)`` (same order)."""
        bounds = self.boundaries(n)
        if not len(conv_states) == len(delta_states) == len(bounds):
            raise ValueError(f"advance({n}) needs states at {bounds}: got "
                             f"{len(conv_states)} conv and {len(delta_states)} delta states")
        if delta_states[-1] is not None and delta_states[-1].dtype != mx.float32:
            raise ValueError(f"the delta state must be float32, got {delta_states[-1].dtype}")
        start = self._offset
        for rel, conv, delta in zip(bounds[:-1], conv_states, delta_states):
            self._capture(start + rel, conv, delta)
        self.conv, self.delta = conv_states[-1], delta_states[-1]
        self._offset = start + n
        if bounds[-1] in [o - start for o in self._schedule.pending()]:
            self._capture(self._offset, self.conv, self.delta)

    # -- snapshots -----------------------------------------------------------------------------
    def _capture(self, offset: int, conv: mx.array | None, delta: mx.array | None) -> None:
        snap = RecurrentSnapshot(self._schedule.segment_start(), offset, conv, delta)
        self._schedule.mark_taken(offset, snap)

    def prepare_snapshots(self, offsets: Sequence[int]) -> None:
        self._schedule.prepare(offsets, self._offset)
        if self._offset in self._schedule.pending():
            self._capture(self._offset, self.conv, self.delta)

    def take_snapshots(self) -> list[RecurrentSnapshot]:
        return self._schedule.take()

    def cancel_snapshots(self) -> None:
        self._schedule.discard_pending()

    def snapshot(self, start: int = 0, end: int | None = None) -> RecurrentSnapshot:
        """The live state as a snapshot covering ``[start, offset)``."""
        if not 0 <= start <= self._offset or end not in (None, self._offset):
            raise ValueError(f"snapshot [{start}, {end}) of a recurrent state at {self._offset}:"
                             f" only the state at the offset exists")
        return RecurrentSnapshot(start, self._offset, self.conv, self.delta)

    def can_rewind_to(self, target: int) -> bool:
        return target in (0, self._offset)

    def reserve(self, tokens: int) -> None:
        pass  # a recurrent state has a fixed size

    def export_snapshot(self, snapshot: RecurrentSnapshot) -> SnapshotRecord:
        conv, delta = snapshot.state()
        arrays = {name: a for name, a in (("conv", conv), ("delta", delta)) if a is not None}
        return make_record("recurrent", snapshot.start, snapshot.end, arrays)

    def import_snapshot(self, record: SnapshotRecord) -> RecurrentSnapshot:
        arrays = read_record(record, "recurrent")
        return RecurrentSnapshot(record.meta["start"], record.meta["end"], arrays.get("conv"),
                                 arrays.get("delta"))

    def restore(self, snapshot: RecurrentSnapshot | None, target: int) -> bool:
        if target < 0:
            raise ValueError(f"restore target {target} is negative")
        if snapshot is None:
            if target > self._offset:
                raise ValueError(f"cannot rewind forward: target {target} > offset {self._offset}")
            if target == 0:
                self.free()  # the empty state is always known
                return True
            return target == self._offset  # otherwise a recurrent state only moves forward
        if not isinstance(snapshot, RecurrentSnapshot):
            raise TypeError(f"RecurrentCache cannot restore a {type(snapshot).__name__}")
        if not snapshot.start <= target <= snapshot.end:
            raise ValueError(
                f"target {target} outside snapshot range [{snapshot.start}, {snapshot.end}]")
        if target != snapshot.end:
            return False  # only the state at the snapshot's end exists
        self.conv, self.delta = snapshot.state()
        self._offset = target
        return True

    def merge(self, first: RecurrentSnapshot, second: RecurrentSnapshot) -> RecurrentSnapshot:
        if first.end != second.start:
            raise ValueError(f"snapshots [{first.start}, {first.end}) and "
                             f"[{second.start}, {second.end}) are not adjacent")
        conv, delta = second.state()
        merged = RecurrentSnapshot(first.start, second.end, conv, delta)
        first.close()
        second.close()
        return merged

    def split(self, snapshot: RecurrentSnapshot,
              at: int) -> tuple[None, RecurrentSnapshot]:
        """The state at ``at`` was never captured: the first part is ``None`` (recompute it)."""
        if not snapshot.start < at < snapshot.end:
            raise ValueError(f"split point {at} not inside [{snapshot.start}, {snapshot.end})")
        conv, delta = snapshot.state()
        second = RecurrentSnapshot(at, snapshot.end, conv, delta)
        snapshot.close()
        return None, second

    def free(self) -> None:
        self.conv = self.delta = None
        self._offset = 0

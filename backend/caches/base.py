"""The cache contract: what every cache kind promises to models, the prefix trie and speculation.

A *cache* holds one layer's attention state for one sequence (batch size 1 unless stated).
Its ``offset`` is the number of tokens it has consumed. Four kinds implement this protocol:
``KVCache`` (full attention, ``kv.py``), ``RotatingKVCache`` (sliding window, ``rotating.py``),
``RecurrentCache`` (conv + gated-delta state, ``recurrent.py``) and ``LatentCache`` (multi-head
latent attention's latent and rotary key per token, ``latent.py``).

Writing
    Attention layers call ``update(keys, values) -> KVHistory``; models never read cache buffers
    directly, they hand the history to ``caches.attention.scaled_dot_product_attention``.

Snapshots (who owns what)
    A *snapshot* captures the cache's contribution for the token range ``[start, end)``: for KV
    caches the keys/values of those positions; for a recurrent cache the state *at* ``end``; for a
    rotating cache the window as it stood at ``end``. Snapshots are created only by the cache
    (``take_snapshots``, ``split``, ``merge``) and belong to the caller afterwards, who must
    ``close()`` each one exactly once (or keep it). A snapshot never keeps a larger buffer alive
    than its own bytes (KV snapshots start *lazy*: an index range into the live buffer that owns
    nothing until the cache is about to overwrite or free that range, at which point the cache
    copies the range out into compact memory).

Scheduling
    ``prepare_snapshots(offsets)`` before a (possibly batched or chunked) write asks the cache to
    capture its state as its offset crosses each of ``offsets`` (strictly increasing and
    ``>= offset``; anything else is a broken contract and raises ``ValueError``). Schedules persist
    across writes until ``take_snapshots()`` returns the captures made so far, in order; snapshot
    ``i`` covers ``[offsets[i-1], offsets[i])`` with ``offsets[-1]`` being the offset at scheduling.

Restoring (three error tiers)
    ``restore(None, target)`` rewinds the live state to ``target``; ``restore(snapshot, target)``
    sets it from ``snapshot`` (the live cache must already hold ``[0, snapshot.start)`` of the same
    sequence, which the caller guarantees). Both return ``False`` when the target is not reachable
    (a rotating cache that has wrapped past it, a recurrent cache not exactly at it); the caller
    then falls back to recomputing. Broken contracts (negative targets, a target beyond what the
    cache or snapshot holds, a foreign snapshot kind) raise with the offending values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence, runtime_checkable

import mlx.core as mx

from backend.memory.records import SnapshotRecord


@dataclass(frozen=True)
class AttentionMask:
    """The mask a model asks for, in logical token positions.

    ``causal``: query at position p sees keys at positions <= p; ``window``: additionally only the
    last ``window`` positions (p - window < k <= p); ``none``: every stored key.
    """

    kind: Literal["causal", "none"] = "causal"
    window: int | None = None


CAUSAL = AttentionMask("causal")
NO_MASK = AttentionMask("none")


def sliding_window(window: int) -> AttentionMask:
    return AttentionMask("causal", window)


@runtime_checkable
class KVHistory(Protocol):
    """Keys and values after an update, plus how stored slots map to logical positions.

    ``keys``/``values`` are ``(B, n_kv_heads, S, head_dim)`` in *logical* order: slot ``i`` holds
    position ``key_start + i``, whatever the cache's storage layout (a ring is presented
    unrolled), so attention reads the same keys in the same order however the cache got there
    (restored, rewound or written step by step). ``query_start`` is the logical position of the
    first query of this write and ``num_queries`` their count.
    """

    keys: mx.array
    values: mx.array
    query_start: int
    num_queries: int
    key_start: int


@runtime_checkable
class Snapshot(Protocol):
    start: int
    end: int

    @property
    def nbytes(self) -> int: ...

    @property
    def is_lazy(self) -> bool:
        """True while it is only a view of a live buffer (``nbytes`` is 0 until copied out)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Cache(Protocol):
    """See the module docstring for the contract."""

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    #: True when ``restore(None, target)`` can move backwards from the current state.
    can_rewind: bool

    #: ``"span"``: a snapshot holds the contribution of each token of ``[start, end)`` (restorable
    #: at any point inside, given the prefix); ``"state"``: the whole state at ``end`` only.
    snapshot_kind: Literal["span", "state"]

    def can_rewind_to(self, target: int) -> bool:
        """Would ``restore(None, target)`` succeed now? (A query: nothing changes.)"""
        ...

    def prepare_snapshots(self, offsets: Sequence[int]) -> None: ...

    def take_snapshots(self) -> list[Snapshot]: ...

    def cancel_snapshots(self) -> None:
        """Drop scheduled offsets that no write has crossed yet."""
        ...

    def snapshot(self, start: int, end: int | None = None) -> Snapshot:
        """A snapshot of the live state covering ``[start, end)`` (``end`` defaults to the
        offset; a state kind only has the state at its offset)."""
        ...

    def export_snapshot(self, snapshot: Snapshot) -> SnapshotRecord:
        """An owned numpy copy of ``snapshot`` (exact, for the host and disk tiers)."""
        ...

    def import_snapshot(self, record: SnapshotRecord) -> Snapshot:
        """A snapshot of this kind from a record (owned MLX arrays); ValueError if foreign."""
        ...

    def reserve(self, tokens: int) -> None:
        """Capacity hint before restoring ``tokens`` positions (avoids repeated growth)."""
        ...

    def restore(self, snapshot: Snapshot | None, target: int) -> bool: ...

    def merge(self, first: Snapshot, second: Snapshot) -> Snapshot: ...

    def split(self, snapshot: Snapshot, at: int) -> tuple[Snapshot | None, Snapshot]:
        """``snapshot`` cut at ``at`` into ``[start, at)`` (None for a state kind) and
        ``[at, end)``. It consumes ``snapshot``, also when it raises: the caller never uses or
        closes it again."""
        ...

    def arrays(self) -> list[mx.array]:
        """The arrays holding the live state, for ``mx.eval`` after a write."""
        ...

    def free(self) -> None: ...


class SnapshotSchedule:
    """Shared bookkeeping for scheduled snapshot offsets (composed by every cache kind).

    The owning cache calls ``due(old, new)`` around each write to learn which scheduled offsets
    the write crosses, captures them, and records them with ``add_taken``.
    """

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._taken: list[Snapshot] = []
        self._segment_start = 0

    def prepare(self, offsets: Sequence[int], current: int) -> None:
        offsets = list(offsets)
        last = self._pending[-1] if self._pending else current
        floor = max(last, current)
        for o in offsets:
            if o < floor or (self._pending and o == floor):
                raise ValueError(
                    f"snapshot offsets must be increasing and >= the cache offset {current}: "
                    f"got {offsets} with {self._pending} already pending"
                )
            floor = o
        if not self._pending and not self._taken:
            self._segment_start = current
        self._pending.extend(offsets)

    def pending(self) -> list[int]:
        return list(self._pending)

    def due(self, old_offset: int, new_offset: int) -> list[int]:
        """Scheduled offsets in ``(old_offset, new_offset]`` (or == old when nothing written yet)."""
        hits = [o for o in self._pending if old_offset <= o <= new_offset]
        return hits

    def segment_start(self) -> int:
        return self._segment_start

    def mark_taken(self, offset: int, snapshot: Snapshot) -> None:
        self._pending.remove(offset)
        self._taken.append(snapshot)
        self._segment_start = offset

    def take(self) -> list[Snapshot]:
        taken, self._taken = self._taken, []
        return taken

    def discard_pending(self) -> None:
        """Forget scheduled offsets no write crossed (a cancelled or finished prefill)."""
        self._pending.clear()

    def clear_after(self, offset: int) -> None:
        """A rewind below pending offsets invalidates nothing scheduled ahead; keep them."""
        self._segment_start = min(self._segment_start, offset)

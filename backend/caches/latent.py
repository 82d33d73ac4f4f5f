"""LatentCache: what a multi-head latent attention (MLA) layer keeps per token, with lazy snapshots.

An MLA layer (DeepSeek-V2/V3, GLM-4.7-Flash; ``models/glm4_moe_lite.py``) never stores per-head
keys and values. Per token it keeps one compressed latent (``kv_lora_rank`` values, already
RMS-normed), from which every head's key and value are linear maps, and one rotary key shared by
all heads (``qk_rope_head_dim`` values, already rotated). For GLM-4.7-Flash that is 512 + 64
values per token and layer where its 20 heads' keys and values would take 20 x (256 + 256):
5.6% of the bytes, on every tier of the prefix cache.

Storage: one buffer ``(B, 1, slots, latent + rope)``, each slot ``[latent | rotary key]``,
slot i = position i, grown in ``STEP``-token blocks so decode appends in place. The history
handed to attention is two views of it (no copy): ``keys`` = whole entries ``(B, 1, S, latent +
rope)`` and ``values`` = their latent part ``(B, 1, S, latent)``. In the absorbed form a query
is ``[q_nope absorbed into the latent space | rotated q_rope]``, so its score against a
position is one dot product with the entry and the attention output stays in the latent space
(the layer maps it to each head's values afterwards): one shared "kv head", which the CPU
attention kernel and MLX's attention both take as grouped-query attention.

Snapshots follow ``KVCache`` (``caches/kv.py``): a ``LatentSnapshot`` of ``[start, end)`` is an
index range of the live buffer (zero bytes) until the cache is about to overwrite or free those
slots, when it is copied out into a compact array of exactly its range. The bookkeeping they
share (lazy snapshot list, schedule, offset, restore, merge, split) is ``SpanKVStorage``'s; the
buffer is this module's own, since an MLA entry is one array, not a key and a value.
"""

from __future__ import annotations

import mlx.core as mx

from backend.caches.export import make_record, read_record
from backend.caches.kv import ContiguousHistory, SpanKVStorage, copy_out, grown
from backend.memory.records import SnapshotRecord


class LatentSnapshot:
    """The entries of positions ``[start, end)``: a view ``owner._view(start, end)`` while lazy,
    then an owned ``(B, 1, end - start, latent + rope)`` array."""

    def __init__(self, owner: "LatentCache | None", start: int, end: int,
                 entries: mx.array | None = None):
        self.start = start
        self.end = end
        self._owner = owner
        self._entries = entries

    @property
    def is_lazy(self) -> bool:
        return self._owner is not None

    @property
    def nbytes(self) -> int:
        return 0 if self._entries is None else self._entries.nbytes

    def entries(self) -> mx.array:
        """The entries of ``[start, end)`` in position order (a view while lazy)."""
        if self._owner is not None:
            return self._owner._view(self.start, self.end)
        if self._entries is None:
            raise ValueError(f"snapshot [{self.start}, {self.end}) was closed")
        return self._entries

    def _copy_out(self) -> None:
        copy_out([self])

    def _detach(self) -> list[mx.array]:
        """An own (lazy) copy of the viewed range, returned for ``copy_out`` to evaluate."""
        # contiguous allocates exactly this range (a slice alone would keep the buffer alive).
        self._entries = mx.contiguous(self._owner._view(self.start, self.end))
        self._owner = None
        return [self._entries]

    def close(self) -> None:
        if self._owner is not None:
            self._owner._forget(self)
        self._owner = None
        self._entries = None


class LatentCache(SpanKVStorage):
    """An MLA layer's cache; see the module docstring and ``caches.base`` for the contract.

    ``latent_dims``: the latent's width (``kv_lora_rank``); the rest of an entry is the rotary
    key. ``self.keys`` is the entry buffer; ``self.values`` stays None (values are its latent
    part, a view)."""

    _record_kind = "latent"
    _snapshot_type = LatentSnapshot
    _cache_name = "LatentCache"

    def __init__(self, latent_dims: int) -> None:
        if latent_dims < 1:
            raise ValueError(f"latent_dims must be >= 1, got {latent_dims}")
        super().__init__()
        self.latent_dims = latent_dims

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys]

    def _view(self, start: int, end: int) -> mx.array:
        return self.keys[..., start:end, :]

    # -- writing -------------------------------------------------------------------------------
    def update(self, latent: mx.array, rope_keys: mx.array) -> ContiguousHistory:
        """Append ``latent`` ``(B, 1, N, latent_dims)`` and ``rope_keys`` ``(B, 1, N, rope)``
        at the current offset; the history's keys are the entries, its values their latent."""
        if latent.shape[-1] != self.latent_dims or latent.shape[:3] != rope_keys.shape[:3]:
            raise ValueError(f"latent {latent.shape} and rotary keys {rope_keys.shape} do not "
                             f"form entries of a {self.latent_dims}-dim latent cache")
        start, n = self._offset, latent.shape[2]
        self._append(mx.concatenate([latent, rope_keys], axis=-1))
        entries = self.keys[..., : self._offset, :]
        return ContiguousHistory(entries, entries[..., : self.latent_dims], start, n)

    def _append(self, entries: mx.array) -> None:
        start, n = self._offset, entries.shape[2]
        if self._lazy:
            self._protect_from(start)
        self._reserve(entries, start + n)
        self.keys[:, :, start:start + n] = entries
        self._offset = start + n
        self._capture_due(start, self._offset)

    def _reserve(self, like: mx.array, needed: int) -> None:
        self.keys = grown(self.keys, like, needed)

    def reserve(self, tokens: int) -> None:
        if self.keys is not None:
            self._reserve(self.keys[..., :0, :], tokens)

    # -- snapshots -----------------------------------------------------------------------------
    def _new_snapshot(self, start: int, end: int) -> LatentSnapshot:
        return LatentSnapshot(self, start, end)

    def _replay(self, snapshot: LatentSnapshot, n: int) -> None:
        self._append(snapshot.entries()[..., :n, :])

    def _joined(self, first: LatentSnapshot, second: LatentSnapshot) -> LatentSnapshot:
        entries = mx.concatenate([first.entries(), second.entries()], axis=2)
        mx.eval(entries)
        return LatentSnapshot(None, first.start, second.end, entries)

    def _cut(self, snapshot: LatentSnapshot, at: int) -> tuple[LatentSnapshot, LatentSnapshot]:
        entries, cut = snapshot.entries(), at - snapshot.start
        head = mx.contiguous(entries[..., :cut, :])
        tail = mx.contiguous(entries[..., cut:, :])
        mx.eval(head, tail)
        return (LatentSnapshot(None, snapshot.start, at, head),
                LatentSnapshot(None, at, snapshot.end, tail))

    # -- records (host / disk tiers) -------------------------------------------------------------
    def export_snapshot(self, snapshot: LatentSnapshot) -> SnapshotRecord:
        return make_record(self._record_kind, snapshot.start, snapshot.end,
                           {"entries": snapshot.entries()}, latent_dims=self.latent_dims)

    def import_snapshot(self, record: SnapshotRecord) -> LatentSnapshot:
        entries = read_record(record, self._record_kind)["entries"]
        meta = record.meta
        start, end = meta["start"], meta["end"]
        if meta.get("latent_dims") != self.latent_dims or entries.ndim != 4 \
                or entries.shape[2] != end - start or entries.shape[3] <= self.latent_dims:
            raise ValueError(f"a latent record of shape {entries.shape} for [{start}, {end}) "
                             f"(latent {meta.get('latent_dims')}) does not fit a cache with a "
                             f"{self.latent_dims}-dim latent")
        return LatentSnapshot(None, start, end, entries)

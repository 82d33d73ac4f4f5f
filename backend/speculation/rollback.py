"""A speculative write as a transaction on live caches: snapshots scheduled at every draft
offset before the batched write, then every cache restored to the accepted count.

    tx = SpeculativeWrite(caches, count=N)   # before the write: snapshots at o, o+1, .., o+N-1
    ... one batched forward of N tokens through the model ...
    tx.commit(keep)                          # caches hold o + keep tokens; snapshots closed

A KV cache rewinds by moving its offset (its lazy snapshots cost nothing); a rotating window
rewinds the same way inside the block it just wrote and otherwise restores the captured window;
a recurrent layer restores the state its segmented scan reported at that offset, in the same
batched pass. Unused snapshots are closed before restoring, so nothing copies out a window
about to be dropped. ``commit`` always drains the schedule, also when keeping everything, and
``abort`` (an exception during the write) drains it without restoring.
"""

from __future__ import annotations

from typing import Sequence

from backend.caches.base import Cache


class SpeculativeWrite:
    def __init__(self, caches: Sequence[Cache], count: int) -> None:
        if count < 1:
            raise ValueError(f"a speculative write needs at least one token, got {count}")
        self.caches = list(caches)
        self.count = count
        offsets = {c.offset for c in self.caches}
        if len(offsets) != 1:
            raise ValueError(f"caches are at different offsets {sorted(offsets)}")
        self.start = offsets.pop()
        for cache in self.caches:
            # The state after 0 .. N-1 tokens (after N is the live state itself).
            cache.prepare_snapshots(range(self.start, self.start + count))
        self._open = True

    def commit(self, keep: int) -> None:
        """Keep the first ``keep`` (0 .. N) tokens of the write."""
        if not self._open:
            raise RuntimeError("this speculative write was already committed")
        if not 0 <= keep <= self.count:
            raise ValueError(f"keep must be in [0, {self.count}], got {keep}")
        self._open = False
        target = self.start + keep
        for j, cache in enumerate(self.caches):
            snaps = cache.take_snapshots()
            cache.cancel_snapshots()
            if cache.offset != self.start + self.count or len(snaps) != self.count:
                for snap in snaps:
                    snap.close()
                raise RuntimeError(f"layer {j}: the speculative write of {self.count} tokens "
                                   f"ended at {cache.offset} with {len(snaps)} snapshots")
            chosen = snaps[keep] if keep < self.count else None
            for i, snap in enumerate(snaps):
                if snap is not chosen:
                    snap.close()
            if chosen is not None:
                ok = cache.restore(None, target) if cache.can_rewind_to(target) else \
                    cache.restore(chosen, target)
                chosen.close()
                if not ok:
                    raise RuntimeError(f"layer {j}: cannot roll back to {target}")

    def abort(self) -> None:
        """The write failed: drop the schedule and its captures (the caller frees the caches)."""
        if not self._open:
            return
        self._open = False
        for cache in self.caches:
            for snap in cache.take_snapshots():
                snap.close()
            cache.cancel_snapshots()

"""DFlashDrafter: drafts a whole block in one forward of a DFlash checkpoint
(``models/dflash.py``) paired with the target like a draft model.

The drafter reads the target's hidden states after the layers its checkpoint names: the engine
has the target capture them (``Backbone.capture``), and every target forward reports them
through ``observe(start, tokens, features)`` (prefill chunks, steps, verify blocks before their
rollback), kept by position until consumed (``mtp.Observed``). The drafter's caches hold the
context keys and values of committed positions only, one ``KVCache`` per drafter layer, at the
target's positions; the block itself is never written, so a rejected round leaves nothing to
roll back in them.

Proposing once the target holds ``held`` (the newest id c perhaps not fed yet): the context
must cover every position before c's and nothing after, so the caches advance to
``len(held) - 1`` (or rewind to it when a step already fed c and a catch-up took its position
in); the block ``[c, mask x n]`` at positions ``len(held) - 1 ..`` runs through the drafter
once, and the target's head scores rows 1..n. Each row's distribution depends on the context
alone, not on the drafts before it, so drafts are drawn row by row through the request's
sampler and judged by the rejection rule with those per-position distributions.

One position's features stay kept after it joins the context (``_advance``): a rewind to c's
position can take it in again later.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from backend.caches.kv import KVCache
from backend.sampling import Sampler
from backend.speculation.drafters import Draft, History, sample_chain
from backend.speculation.mtp import FLUSH_TOKENS, Observed

#: Most drafts one block may carry: the verify block (the anchor and the drafts) then has at
#: most 16 rows, the row-invariant limit (``scheduler.MAX_GROUP_ROWS``).
MAX_BLOCK_DRAFTS = 15


class DFlashDrafter:
    """Drafts with ``draft`` (a loaded ``models.dflash.Model``) for ``model``; see the module
    docstring. The engine makes ``model`` capture ``draft.args.target_layer_ids``."""

    kind = "dflash"

    def __init__(self, model, draft) -> None:
        self.model = model
        self.draft = draft
        self.max_drafts = min(draft.args.block_size - 1, MAX_BLOCK_DRAFTS)
        self.mask_id = draft.mask_id(model)
        self.caches: list[KVCache] = draft.make_caches()
        self._observed = Observed()

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    # -- the target's forwards -----------------------------------------------------------------
    def observe(self, start: int, tokens: mx.array, features: mx.array) -> None:
        self._observed.add(start, tokens.reshape(-1), features)
        if start - self.offset >= FLUSH_TOKENS:  # bound what long plain stretches keep
            self._advance(start)
            mx.async_eval([c.arrays() for c in self.caches])

    def feed(self, tokens: Sequence[int]) -> None:
        """A prefill chunk (already observed): into the context now, so the caches cross the
        prefix cache's capture offsets along with the target's."""
        self._advance(self._observed.end)
        mx.eval([c.arrays() for c in self.caches])

    def _advance(self, end: int) -> None:
        """Extend the context to positions ``[offset, end)``; keep the last one's features."""
        start = self.offset
        if end > start:
            self.draft.extend(self._observed.take(start, end)[1], self.caches)
        self._observed.drop_before(max(end - 1, 0))

    def _rewind(self, position: int) -> bool:
        """Context back to ``[0, position)``; False when the features to take the dropped
        positions in again are gone (a restored prefix)."""
        observed = self._observed.segments
        if not observed or observed[0][0] > position:
            return False
        for cache in self.caches:
            cache.restore(None, position)
        return True

    # -- drafting ------------------------------------------------------------------------------
    def propose(self, held: Sequence[int], n: int, sampler: Sampler,
                history: History) -> Draft | None:
        n = min(n, self.max_drafts)
        anchor = len(held) - 1
        if n < 1 or anchor < 1:
            return None
        if self.offset > anchor and not self._rewind(anchor):
            return None
        self._advance(anchor)
        block = mx.array([[held[-1]] + [self.mask_id] * n], dtype=mx.int32)
        rows = self.draft.block(self.model.model.embed(block), self.caches)[:, 1:]
        logits = self.model.logits(rows)[0]  # (n, vocab): one distribution per position
        following = iter(range(1, n))
        return sample_chain(logits[0], n, sampler, history,
                            lambda _draft: logits[next(following)])

    def settle(self, held: Sequence[int]) -> None:
        """Forget the features of rejected positions; a context beyond ``held`` (a conversation
        that went back) rewinds."""
        self._observed.drop_from(len(held))
        if self.offset > len(held):
            for cache in self.caches:
                cache.restore(None, len(held))

    def catch_up(self, held: Sequence[int]) -> None:
        self.settle(held)
        self._advance(len(held))
        if self.offset != len(held):
            raise RuntimeError(f"the DFlash context is at {self.offset}, the target holds "
                               f"{len(held)} ids")

    def close(self) -> None:
        for cache in self.caches:
            cache.free()
        self._observed = Observed()

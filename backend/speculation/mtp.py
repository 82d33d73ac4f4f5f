"""MTPDrafter: drafts with the multi-token-prediction head the checkpoint ships (``mtp.*`` of
Qwen3-Next and of Qwen3.5 / Qwen3.6, dense and MoE: one ``models/qwen3_next.MTPHead`` for all,
reached through ``model.draft_head()`` / ``draft_hidden()``, so nothing here is per family).

The head predicts the token after next: from token t + 1 and the target's hidden state at t it
gives the distribution of token t + 2, scored by the target's own ``lm_head``. So the pairs it
consumes lag the target by one position, and its caches are laid out to hide that lag:

* one ``HeadCache`` per head layer: slot p holds the pair (token p, target hidden at p - 1), so
  after the target consumed ids ``[0, T)`` the head has slots ``[0, T)`` too; slot 0 pairs
  nothing (zeros that attention never sees);
* the *carry*, a conv-only ``RecurrentCache`` (its conv state is one row): the target hidden at
  ``offset - 1``, which the next slot pairs with. A resumed prompt needs it (the target's hidden
  before the restored position is not recomputed), and as a state it is stored where the
  prefix cache stores the recurrent layers' states.

All of them are live caches the engine lists beside the target's, at the target's offset
whenever the prefix cache records them (``catch_up``).

The target's hidden states arrive through ``observe(start, tokens, hidden)``: every target
forward reports them (prefill chunks, the step feeding each token, verify blocks before their
rollback). They are kept by position until the head consumes them; a forward at ``start``
replaces what was observed from ``start`` on (the target rewound and recomputes those).

Proposing once the target holds ``T`` ids (the newest, c, already fed): the head consumes the
pending pairs through slot ``T - 1`` = (c, h_{T-2}) in one batched forward; its output row gives
draft 1 (without waiting for the target's step on c, which runs meanwhile). Draft i + 1 comes from
the pair (d_i, head output of step i), written at slot ``T - 1 + i`` of the head caches only
(never the carry) and rewound by ``settle``. Drafts are sampled through the request's sampler,
like a draft model's.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from backend.caches.base import Cache
from backend.caches.recurrent import RecurrentCache
from backend.sampling import Sampler
from backend.speculation.drafters import Draft, History, sample_chain

#: Pending target positions after which ``observe`` lets the head catch up (bounds the hidden
#: rows kept during long stretches of plain decoding).
FLUSH_TOKENS = 256


class Observed:
    """Target forwards not yet consumed by a drafter that reads the target's states (this
    head, ``dflash.DFlashDrafter``): ``(start, tokens (n,), states (1, n, H))`` segments in
    position order."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, mx.array, mx.array]] = []

    @property
    def end(self) -> int:
        """One past the last observed position (0 when nothing is held)."""
        if not self.segments:
            return 0
        start, tokens, _ = self.segments[-1]
        return start + tokens.shape[0]

    @property
    def positions(self) -> int:
        """How many positions' states are held."""
        return sum(tokens.shape[0] for _, tokens, _ in self.segments)

    @property
    def dtype(self) -> mx.Dtype:
        return self.segments[0][2].dtype

    def add(self, start: int, tokens: mx.array, hidden: mx.array) -> None:
        self.drop_from(start)
        self.segments.append((start, tokens, hidden))

    def drop_from(self, position: int) -> None:
        """Forget what was observed at ``position`` and after."""
        kept = []
        for start, tokens, hidden in self.segments:
            if start < position:
                cut = min(tokens.shape[0], position - start)
                kept.append((start, tokens[:cut], hidden[:, :cut]))
        self.segments = kept

    def drop_before(self, position: int) -> None:
        kept = []
        for start, tokens, hidden in self.segments:
            end = start + tokens.shape[0]
            if end > position:
                cut = max(0, position - start)
                kept.append((start + cut, tokens[cut:], hidden[:, cut:]))
        self.segments = kept

    def take(self, lo: int, hi: int) -> tuple[mx.array, mx.array]:
        """Tokens (hi - lo,) and hidden states (1, hi - lo, H) of positions ``[lo, hi)``."""
        tokens, hiddens, at = [], [], lo
        for start, toks, hidden in self.segments:
            end = start + toks.shape[0]
            if end <= at or start >= hi:
                continue
            if start > at:
                break
            a, b = at - start, min(end, hi) - start
            tokens.append(toks[a:b])
            hiddens.append(hidden[:, a:b])
            at = start + b
        if at != hi:
            raise RuntimeError(f"the drafter needs the target's states of positions "
                               f"[{lo}, {hi}) but was told only up to {at}")
        if len(tokens) == 1:
            return tokens[0], hiddens[0]
        return mx.concatenate(tokens), mx.concatenate(hiddens, axis=1)


class MTPDrafter:
    """Drafts with ``model.draft_head()``; see the module docstring."""

    kind = "mtp"

    def __init__(self, model) -> None:
        self.model = model
        self.head = model.draft_head()
        if self.head is None:
            raise ValueError("this model has no multi-token-prediction head")
        self.head_caches: list[Cache] = self.head.make_caches()
        self.carry = RecurrentCache()
        self.caches: list[Cache] = [*self.head_caches, self.carry]
        self._observed = Observed()
        self._lead = 0  # see ``paired``

    @property
    def paired(self) -> int:
        """Head slots holding pairs of the target's own ids: the carry's offset, plus one when
        the newest id was paired before the target consumed it (it then leads the next verify
        block). A restore by the prefix cache leaves the head at the carry's offset: no lead."""
        lead = self._lead if self.head_caches[0].offset >= self.carry.offset + self._lead else 0
        return self.carry.offset + lead

    # -- the target's forwards -----------------------------------------------------------------
    def observe(self, start: int, tokens: mx.array, hidden: mx.array) -> None:
        self._observed.add(start, tokens.reshape(-1), hidden)
        # Everything before ``start`` is the target's own: the target holds exactly those ids.
        if start - self.carry.offset >= FLUSH_TOKENS:
            self._advance(start)
            mx.async_eval([c.arrays() for c in self.caches])

    def feed(self, tokens: Sequence[int]) -> None:
        """A prefill chunk (already observed): consume it now, so the head crosses the prefix
        cache's capture offsets along with the target."""
        self._advance(self._observed.end)
        mx.eval([c.arrays() for c in self.caches])

    def _advance(self, end: int, held: Sequence[int] | None = None) -> mx.array | None:
        """Pair the target's ids up to ``end`` and carry the newest hidden state the target
        computed (at most ``end - 1``): writes the head slots ``[paired, end)`` (token p from
        ``held``, else from the observed forwards; hidden p - 1 observed or carried) and returns
        the head's output at slot ``end - 1`` (1, 1, H), or None when it wrote no pair."""
        start = self.paired
        for cache in self.head_caches:  # drop drafted slots left after the paired ones
            if cache.offset > start:
                cache.restore(None, start)
        out = None
        if end > start:
            if held is not None:
                tokens = mx.array(list(held[start:end]), dtype=mx.int32)
            else:
                tokens = self._observed.take(start, end)[0]
            if start == 0:
                self.head.open(self.head_caches, self._observed.dtype)
                tokens = tokens[1:]  # slot 0 pairs nothing
                previous = self._observed.take(0, end - 1)[1] if end > 1 else None
            elif start - 1 < self.carry.offset:  # the hidden before slot ``start`` is carried
                rows = [self.carry.conv] + ([self._observed.take(start, end - 1)[1]]
                                            if end - 1 > start else [])
                previous = mx.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]
            else:
                previous = self._observed.take(start - 1, end - 1)[1]
            if tokens.shape[0]:
                out = self.model.draft_hidden(tokens[None], previous, self.head_caches)[:, -1:]
        self._carry_to(min(end, self._observed.end))
        self._lead = max(end, start) - self.carry.offset
        return out

    def _carry_to(self, end: int) -> None:
        """Advance the carry to ``end``: it then holds the target's hidden at ``end - 1``."""
        start = self.carry.offset
        if end <= start:
            return
        hidden = self._observed.take(start, end)[1]  # (1, n, H)
        self._observed.drop_before(end)
        n = end - start
        # The carried row at each boundary b (after b of the n positions) is hidden b - 1, each
        # its own compact array: a slice would keep the whole chunk's hidden states alive.
        states = [mx.contiguous(hidden[:, b - 1:b]) for b in self.carry.boundaries(n)]
        self.carry.advance(n, states, [None] * len(states))

    # -- drafting ------------------------------------------------------------------------------
    def propose(self, held: Sequence[int], n: int, sampler: Sampler,
                history: History) -> Draft | None:
        """``held``: the target's ids, the newest (c) perhaps not consumed yet (then it leads
        the verify block). Draft 1 comes from the pair (c, hidden before c)."""
        if n < 1:
            return None
        previous = self._advance(len(held), held)
        if previous is None:
            return None  # nothing new to pair (or a one-token context: its slot pairs nothing)
        logits = self.model.logits(previous)[0, -1]

        def next_logits(token: mx.array) -> mx.array:
            nonlocal previous
            previous = self.model.draft_hidden(token.reshape(1, 1), previous, self.head_caches)
            return self.model.logits(previous)[0, -1]

        return sample_chain(logits, n, sampler, history, next_logits)

    def settle(self, held: Sequence[int]) -> None:
        """Rewind the drafted slots and forget the hidden states of rejected positions."""
        if self.carry.offset > len(held):
            raise RuntimeError(f"the MTP head carried {self.carry.offset} positions but the "
                               f"target holds {len(held)}")
        keep = min(self.paired, len(held))
        for cache in self.head_caches:
            if cache.offset > keep:
                cache.restore(None, keep)
        self._lead = keep - self.carry.offset
        self._observed.drop_from(len(held))

    def catch_up(self, held: Sequence[int]) -> None:
        self.settle(held)
        self._advance(len(held), held)
        if any(c.offset != len(held) for c in self.caches):
            raise RuntimeError(f"the MTP caches are at {[c.offset for c in self.caches]}, the "
                               f"target holds {len(held)} ids")

    def close(self) -> None:
        for cache in self.caches:
            cache.free()
        self._observed = Observed()
        self._lead = 0


def mtp_drafter(model) -> MTPDrafter | None:
    """The drafter for ``model``'s multi-token-prediction head; None when it ships none."""
    return MTPDrafter(model) if model.draft_head() is not None else None

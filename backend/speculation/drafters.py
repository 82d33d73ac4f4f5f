"""Drafters: who proposes the tokens a verify block judges.

One protocol for every kind:

* ``caches``: live caches the drafter keeps beside the target's (part of the prefix cache, so a
  resumed conversation does not re-prefill the drafter either); empty for prompt lookup.
* ``feed(tokens)``: the target consumed these ids (prefill chunks); keep the caches in step.
* ``observe(start, tokens, hidden)``: every target forward (prefill chunks, the step feeding
  each token, verify blocks before their rollback) reports the ids it fed at positions
  ``start ..`` and its final hidden states ``(1, n, hidden)``; a head that drafts from the
  target's hidden state (``speculation/mtp.py``) keeps them, the others ignore them.
* ``propose(held, n, sampler, history) -> Draft | None``: up to ``n`` tokens that may follow
  ``held`` (every id the target caches hold, the newest last), as lazy arrays, or None when there
  is nothing to propose; a sampling drafter draws through ``sampler`` with the penalty window
  ``history(drafts so far)``.
* ``settle(held)``: after a round the target holds ``held``; drop what the drafter fed beyond it.
* ``catch_up(held)``: feed whatever the drafter still lags behind ``held`` (before the prefix
  cache records the caches: they must all sit at one offset).
* ``close()``.

``PromptLookupDrafter`` (the default with no draft model): the longest recent n-gram of the
context that occurred before, and what followed it there; free, any model, point-mass drafts.
``ModelDrafter``: a small model with the same vocabulary, sampled through the request's own
sampler (penalties, temperature, filters), its caches lagging the target's and caught up lazily,
so a plain decoding stretch costs it nothing. ``MTPDrafter`` (``mtp.py``): the checkpoint's own
multi-token-prediction head, drafting from the target's hidden states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import mlx.core as mx

from backend.caches.base import Cache
from backend.models.cpu_setup import use_int8_inputs
from backend.sampling import Sampler


# What a model drafter lags between back-to-back rounds: the last draft and the bonus token.
STEADY_LAG = 2

History = Callable[["mx.array | None"], "mx.array | None"]


@dataclass
class Draft:
    tokens: mx.array  # (N,) int32, may be lazy
    logprobs: mx.array | None  # (N, V) the drafter's distributions; None: point masses
    known: list[int] | None = None  # the ids on the host already (prompt lookup)
    # Seconds ``propose`` spent catching the drafter up on a stretch of plain decoding: paid
    # once per stretch, not per round, so the depth controller does not price it into a depth.
    catch_up_s: float = 0.0


class Drafter(Protocol):
    caches: list[Cache]
    kind: str

    def feed(self, tokens: Sequence[int]) -> None: ...

    def observe(self, start: int, tokens: mx.array, hidden: mx.array) -> None: ...

    def propose(self, held: Sequence[int], n: int, sampler: Sampler,
                history: History) -> Draft | None: ...

    def settle(self, held: Sequence[int]) -> None: ...

    def catch_up(self, held: Sequence[int]) -> None: ...

    def close(self) -> None: ...


class PromptLookupDrafter:
    """Drafts by matching the latest n-gram (``max_ngram`` down to ``min_ngram`` tokens) against
    the prompt and the generation so far, preferring the most recent occurrence. One per reply:
    an index of every n-gram's last two end positions grows with the context (O(max_ngram) per
    token), so a lookup costs about the same at any context length. A context that does not
    extend the one indexed (shorter, or edited anywhere: one list comparison notices, at C
    speed) is indexed again from the start.

    ``cold_min_ngram``: the shortest match that proposes while the last proposal was rejected
    (or before any): in free text a two-token match ("of the") is nearly always a stray one,
    and each missed round costs about one and a half plain steps; once a proposal was kept (a
    passage being copied) ``min_ngram`` applies again. None: ``min_ngram`` always."""

    kind = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2,
                 cold_min_ngram: int | None = None) -> None:
        self.caches: list[Cache] = []
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.cold_min_ngram = min_ngram if cold_min_ngram is None else cold_min_ngram
        self._tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self._before: dict[tuple[int, ...], int] = {}  # ... and of the one before it
        self._copying = False  # the last proposal's first id was kept
        self._proposed: tuple[int, int] | None = None  # (where, first id) of the last proposal

    def feed(self, tokens: Sequence[int]) -> None:
        pass

    def observe(self, start: int, tokens: mx.array, hidden: mx.array) -> None:
        pass

    def _index(self, held: Sequence[int]) -> None:
        tokens = self._tokens
        if len(held) < len(tokens) or held[:len(tokens)] != tokens:  # not one growing context
            tokens.clear()
            self._last.clear()
            self._before.clear()
        for token in held[len(tokens):]:
            tokens.append(token)
            end = len(tokens)
            for size in range(1, min(self.max_ngram, end) + 1):
                key = tuple(tokens[end - size:])
                if key in self._last:
                    self._before[key] = self._last[key]
                self._last[key] = end

    def propose(self, held: Sequence[int], n: int, sampler: Sampler,
                history: History) -> Draft | None:
        self._index(held)
        end = len(self._tokens)
        shortest = self.min_ngram if self._copying else self.cold_min_ngram
        for size in range(min(self.max_ngram, end - 1), shortest - 1, -1):
            key = tuple(self._tokens[end - size:])
            start = self._before.get(key)  # the latest occurrence is the suffix itself
            if start is not None:
                ids = self._tokens[start:start + n]
                if ids:
                    self._proposed = (end, ids[0])
                    return Draft(mx.array(ids, dtype=mx.int32), None, ids)
        return None

    def settle(self, held: Sequence[int]) -> None:
        if self._proposed is not None:
            at, first = self._proposed
            self._copying = len(held) > at and held[at] == first
            self._proposed = None

    def catch_up(self, held: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


def lookup(context: Sequence[int], n: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``n`` tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram of ``context`` (``max_ngram`` .. ``min_ngram`` tokens); [] if none. The plain
    search ``PromptLookupDrafter`` must agree with (tests compare them)."""
    tokens = list(context)
    end = len(tokens)
    for size in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix = tokens[end - size:]
        first = suffix[0]
        for start in range(end - size - 1, -1, -1):  # most recent occurrence first
            if tokens[start] == first and tokens[start:start + size] == suffix:
                follow = tokens[start + size:start + size + n]
                if follow:
                    return follow
    return []


def sample_chain(logits: mx.array, n: int, sampler: Sampler, history: History,
                 next_logits: Callable[[mx.array], mx.array]) -> Draft:
    """``n`` drafts sampled one after another through the request's sampler: draft 1 from
    ``logits`` (vocab,), each next one from ``next_logits(previous draft)``, the penalty window
    holding the drafts so far. Each draft starts computing as soon as its graph is built:
    ``async_eval`` returns once all but the last few ops of the step are dispatched (MLX
    bounds the tasks in flight), so building the next step's graph, or the verify block's,
    overlaps the step's tail, its output projection (~7% of a depth-2 round here)."""
    tokens, logprobs = [], []
    for i in range(n):
        window = history(mx.stack(tokens) if tokens else None)
        dist = sampler.distributions(logits[None], [window])[0]
        token = dist.sample()
        mx.async_eval(token)
        tokens.append(token)
        logprobs.append(dist.logprobs)
        if i + 1 < n:
            logits = next_logits(token)
    return Draft(mx.stack(tokens), mx.stack(logprobs))


class ModelDrafter:
    """A small model with the target's vocabulary; see the module docstring."""

    kind = "model"

    def __init__(self, model, name: str = "draft") -> None:
        self.model = model
        self.name = name
        # Its products may be approximate (4-bit weights against int8 inputs: ~20% less time
        # per step): the target verifies every draft, so replies cannot change.
        use_int8_inputs(model)
        self.caches: list[Cache] = model.make_caches()
        self._fed = 0  # ids the draft caches hold (a prefix of the target's held ids)

    @property
    def offset(self) -> int:
        return self.caches[0].offset if self.caches else self._fed

    def feed(self, tokens: Sequence[int]) -> None:
        if tokens:
            hidden = self.model.hidden(mx.array(list(tokens), dtype=mx.int32)[None], self.caches)
            mx.eval(hidden, [c.arrays() for c in self.caches])

    def observe(self, start: int, tokens: mx.array, hidden: mx.array) -> None:
        pass  # it runs its own model on the ids

    def propose(self, held: Sequence[int], n: int, sampler: Sampler,
                history: History) -> Draft | None:
        """Feed what lags (ending with the newest held id), then sample ``n`` drafts (lazy
        arrays whose computation has started)."""
        pending = list(held[self.offset:])
        if not pending or n < 1:
            return None
        caught_up = 0.0
        if len(pending) > STEADY_LAG:  # after plain steps: feed the stretch on its own
            mx.synchronize()  # the target's queued step is the round's; time only the feed
            start = time.perf_counter()
            self.feed(pending[:-1])
            pending, caught_up = pending[-1:], time.perf_counter() - start
        logits = self._logits(mx.array(pending, dtype=mx.int32))
        draft = sample_chain(logits, n, sampler, history, lambda t: self._logits(t.reshape(1)))
        draft.catch_up_s = caught_up
        return draft

    def _logits(self, tokens: mx.array) -> mx.array:
        hidden = self.model.hidden(tokens[None], self.caches)
        return self.model.logits(hidden[:, -1:, :])[0, -1]

    def settle(self, held: Sequence[int]) -> None:
        """Rewind the drafts the target did not keep (the draft caches are rewindable KV)."""
        keep = min(self.offset, len(held))
        if keep < self.offset:
            for cache in self.caches:
                if not cache.restore(None, keep):
                    self._reset()  # a non-rewindable draft state: recompute from scratch
                    return

    def catch_up(self, held: Sequence[int]) -> None:
        self.settle(held)
        self.feed(list(held[self.offset:]))

    def _reset(self) -> None:
        for cache in self.caches:
            cache.free()

    def close(self) -> None:
        self._reset()

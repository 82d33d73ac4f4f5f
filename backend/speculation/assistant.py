"""AssistantDrafter: drafts with a Gemma 4 assistant checkpoint (``models/gemma4_assistant``)
paired with its target.

The assistant keeps no state of its own: each round it reads what the target already has.
When the target holds ids ``[0, p)`` in its caches and has chosen ``c`` for position ``p``
(``held`` ends with ``c``; the target may have queued the step feeding it already), draft
step 1 takes

* ``c`` through the target's own scaled embedding,
* the target's final hidden state at ``p - 1`` (the row whose logits chose ``c``), and
* per attention type, the keys and values of the target's last layer computing its own that a
  query at ``p - 1`` sees: positions ``[0, p)`` (full attention), ``[p - window, p)``
  (sliding, read through the ring however it wrapped),

with its query at ``p - 1`` (the last position the target committed, as mlx-vlm's and
ollama's assistants anchor it); each next step takes the previous draft and the previous
step's projected state, at the same position over the same keys. So the drafter's caches are
the target's (``caches`` is empty): the prefix cache's copy of the target's caches is all a
resumed conversation needs, and rejected drafts leave nothing of the drafter's to roll back.
Drafts are sampled through the request's sampler, like a draft model's.

A one-token step of the target writes its key over the oldest position of a full ring
(``p - window`` once the step feeding ``c`` is queued), so after each target forward and each
rollback (``settle``) the drafter keeps that position's keys and values (one row, copied) for
the next round.

The target's hidden states arrive through ``observe`` (every forward: prefill chunks, steps,
verify blocks before their rollback); the last ``KEEP`` positions are kept, copied so that a
prefill chunk's hidden states are not held alive.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from backend.caches.base import Cache, KVHistory
from backend.caches.kv import ContiguousHistory
from backend.caches.rotating import RotatingKVCache
from backend.models.gemma3 import SLIDING
from backend.models.cpu_setup import use_int8_inputs
from backend.sampling import Sampler
from backend.speculation.drafters import Draft, History, sample_chain

#: Target positions whose hidden states are kept: a verify block's rows (the accepted one is
#: any of them) and the row before it.
KEEP = 40


class AssistantDrafter:
    """Drafts with ``assistant`` for ``target`` over ``target_caches`` (module docstring)."""

    kind = "assistant"

    def __init__(self, target, assistant, target_caches: list[Cache],
                 name: str = "assistant") -> None:
        self.target, self.assistant, self.name = target, assistant, name
        use_int8_inputs(assistant)  # approximate products are fine: the target verifies
        self.sources = target.shared_key_caches(target_caches)
        missing = set(assistant.layer_types) - set(self.sources)
        if missing:
            raise ValueError(f"the target has no {', '.join(sorted(missing))} layer computing "
                             f"keys for the assistant")
        self.caches: list[Cache] = []
        self._rows: list[tuple[int, mx.array]] = []  # (start, hidden (1, n, H)) in order
        # The sliding source's oldest window position after each forward: position -> its
        # (keys, values), (1, heads, 1, D) each.
        self._edges: dict[int, tuple[mx.array, mx.array]] = {}

    # -- the target's forwards -----------------------------------------------------------------
    def observe(self, start: int, tokens: mx.array, hidden: mx.array) -> None:
        """Keep the hidden states of the last ``KEEP`` positions (a forward at ``start``
        replaces what was observed from there on)."""
        self._drop_from(start)
        n = hidden.shape[1]
        if n > KEEP:
            hidden, start = mx.contiguous(hidden[:, n - KEEP:]), start + n - KEEP
        self._rows.append((start, hidden))
        floor = start + hidden.shape[1] - KEEP
        self._rows = [(s, h) for s, h in self._rows if s + h.shape[1] > floor]
        self._keep_edge()

    def _keep_edge(self) -> None:
        """Copy the sliding source's oldest window position, which the target's next
        one-token step overwrites (module docstring)."""
        ring = self.sources.get(SLIDING)
        if ring is None or ring.offset < 1:
            return
        end = ring.offset
        seen = ring.visible_keys(end - 1)
        edge = end - ring.window
        if edge >= 0 and seen.key_start == edge:
            row = (seen.keys[..., :1, :] + 0, seen.values[..., :1, :] + 0)  # own memory
            mx.async_eval(row)
            self._edges[edge] = row
        self._edges = {p: row for p, row in self._edges.items() if p > edge - KEEP}

    def _drop_from(self, position: int) -> None:
        """Forget what target forwards wrote at ``position`` and after: hidden rows, and the
        edges copied after a forward that ended past ``position`` (another conversation's,
        or rejected drafts')."""
        ring = self.sources.get(SLIDING)
        if ring is not None:
            self._edges = {p: row for p, row in self._edges.items()
                           if p + ring.window <= position}
        kept = []
        for start, hidden in self._rows:
            if start < position:
                kept.append((start, hidden[:, :position - start]
                             if start + hidden.shape[1] > position else hidden))
        self._rows = kept

    def _hidden_at(self, position: int) -> mx.array | None:
        """(1, 1, H) observed at ``position``, or None."""
        for start, hidden in reversed(self._rows):
            if start <= position < start + hidden.shape[1]:
                return hidden[:, position - start:position - start + 1]
        return None

    def feed(self, tokens: Sequence[int]) -> None:
        pass  # nothing of its own to keep in step

    # -- drafting ------------------------------------------------------------------------------
    def propose(self, held: Sequence[int], n: int, sampler: Sampler,
                history: History) -> Draft | None:
        """Up to ``n`` drafts after ``held[-1]`` (module docstring); None before the target
        has a hidden state to draft from."""
        position = len(held) - 1  # where the newest id goes
        if n < 1 or position < 1:
            return None
        previous = self._hidden_at(position - 1)
        if previous is None:
            return None
        histories = {kind: self._visible(cache, position - 1)
                     for kind, cache in self.sources.items()}
        token = mx.array([[held[-1]]], dtype=mx.int32)

        def next_logits(token: mx.array) -> mx.array:
            nonlocal previous
            embedded = self.target.model.embed(token.reshape(1, 1))
            logits, previous = self.assistant.step(embedded, previous, histories)
            return logits

        return sample_chain(next_logits(token), n, sampler, history, next_logits)

    def _visible(self, cache: Cache, anchor: int) -> KVHistory:
        """What the target's query at ``anchor`` would see in ``cache``; a ring's oldest
        position from the kept edges when a step has overwritten it."""
        seen = cache.visible_keys(anchor)
        want = max(0, anchor + 1 - cache.window) if isinstance(cache, RotatingKVCache) else 0
        edge = self._edges.get(want)
        if seen.key_start == want + 1 and edge is not None:
            return ContiguousHistory(mx.concatenate([edge[0], seen.keys], axis=2),
                                     mx.concatenate([edge[1], seen.values], axis=2),
                                     anchor, 1, key_start=want)
        return seen  # (after a restore that kept no edge: the window less its oldest key)

    def settle(self, held: Sequence[int]) -> None:
        """Forget the hidden states of rejected positions (the target recomputes them); keep
        the ring's oldest position as the rollback left it (the next one-token step
        overwrites it, and the forward that wrote it ended elsewhere)."""
        self._drop_from(len(held))
        self._keep_edge()

    def catch_up(self, held: Sequence[int]) -> None:
        self.settle(held)

    def close(self) -> None:
        self._rows, self._edges = [], {}

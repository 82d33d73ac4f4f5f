"""What a sequence asks of the scheduler: a ``Feed`` (token ids into its caches, the rows it
wants logits of), answered with ``(hidden (1, n, hidden), logits (rows, vocab) or None)``.

The per-request code (``sequence.py``, ``decoding.py``) never runs the target model itself:
it yields a feed where it needs a forward (``yield from forward(feed)``), so the scheduler can
answer the feeds of many sequences with one batched forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator

import mlx.core as mx

Answer = tuple  # (hidden (1, n, hidden), logits (rows, vocab) | None)
LOGIT_ROWS = ("none", "last", "all")


@dataclass
class Feed:
    """``tokens`` (n,) int ids (possibly lazy) into ``caches`` (the sequence's target caches,
    one per layer); ``logits``: "none", "last" (one row) or "all" (n rows)."""

    tokens: mx.array
    caches: list
    logits: str = "last"

    def __post_init__(self) -> None:
        if self.logits not in LOGIT_ROWS:
            raise ValueError(f"logits must be one of {LOGIT_ROWS}, not {self.logits!r}")
        self.tokens = self.tokens.reshape(-1)

    @property
    def rows(self) -> int:
        return int(self.tokens.size)

    @property
    def logit_rows(self) -> int:
        return {"none": 0, "last": 1, "all": self.rows}[self.logits]


def forward(feed: Feed, observe: Callable[[int, mx.array, mx.array], None] | None = None
            ) -> Generator[Feed, Answer, Answer]:
    """``yield from`` this to have ``feed`` answered; ``observe(start, ids, hidden)`` is told
    (a drafter that drafts from the target's hidden states keeps them)."""
    start = feed.caches[0].offset
    hidden, logits = yield feed
    if observe is not None:
        observe(start, feed.tokens, hidden)
    return hidden, logits

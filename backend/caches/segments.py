"""Several sequences in one forward: a layer's caches of each, and which rows are whose.

A batched step stacks the rows of every sequence it runs (a decode token, a verify block, a
prefill chunk) along the token axis of one ``(1, N, hidden)`` input, so every row-wise part of
the model (norms, projections, MLPs, experts) runs once over all of them. What is not
row-wise, a layer's cache and what reads it (RoPE at the cache's offset, attention, a
recurrent scan), runs per sequence: the layer hands ``Segments.map`` a function of one
sequence's rows and cache, and gets the results back in row order.

Row invariance makes this exact: the native kernels compute each row alike whatever the
other rows are (at most ``kernels.MAX_KERNEL_ROWS`` per product), and every sequence's
attention and recurrence see only its own rows and cache, so a sequence's outputs in a batch
equal, bit for bit, its outputs alone.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from backend.caches.base import Cache


class Segments:
    """One layer's caches of the sequences in a step, and each one's row count (in order)."""

    __slots__ = ("caches", "lengths")

    def __init__(self, caches: Sequence[Cache], lengths: Sequence[int]) -> None:
        if len(caches) != len(lengths) or not caches:
            raise ValueError(f"{len(caches)} caches for {len(lengths)} segments")
        if any(n < 1 for n in lengths):
            raise ValueError(f"every segment needs a row: {list(lengths)}")
        self.caches = list(caches)
        self.lengths = list(lengths)

    @property
    def rows(self) -> int:
        return sum(self.lengths)

    def split(self, x: mx.array, axis: int) -> list[mx.array]:
        """``x`` cut along ``axis`` into the segments' rows."""
        return split_rows(x, self.lengths, axis)

    def map(self, fn: Callable[..., mx.array], arrays: Sequence[mx.array],
            axis: int) -> mx.array:
        """``fn(*rows_of_one_segment, cache)`` for every segment, results joined along
        ``axis`` in row order (each result has that segment's rows along ``axis``)."""
        parts = [self.split(a, axis) for a in arrays]
        outs = [fn(*(p[i] for p in parts), cache) for i, cache in enumerate(self.caches)]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=axis)


def split_rows(x: mx.array, lengths: Sequence[int], axis: int) -> list[mx.array]:
    """``x`` cut along ``axis`` into consecutive parts of ``lengths`` rows."""
    if x.shape[axis] != sum(lengths):
        raise ValueError(f"{x.shape[axis]} rows along axis {axis}, segments hold "
                         f"{sum(lengths)}")
    bounds, at = [], 0
    for n in lengths[:-1]:
        at += n
        bounds.append(at)
    return mx.split(x, bounds, axis=axis) if bounds else [x]


def layer_segments(per_sequence: Sequence[Sequence[Cache]], lengths: Sequence[int]
                   ) -> list[Cache | Segments]:
    """Per layer, what the model gets as its cache for a step over several sequences
    (``per_sequence[i]``: sequence i's caches, one per layer); one sequence gets its own caches
    (the single-sequence paths, e.g. the fused layer forward, apply as before)."""
    if len(per_sequence) == 1:
        return list(per_sequence[0])
    return [Segments([caches[j] for caches in per_sequence], lengths)
            for j in range(len(per_sequence[0]))]

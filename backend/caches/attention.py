"""One scaled-dot-product-attention helper for every model and cache kind.

Models describe their mask logically (``AttentionMask``: causal, sliding window, none); the cache's
``KVHistory`` holds its keys in logical order from position ``key_start``. This helper composes the two
(plus optional key padding) and takes MLX's fused paths whenever the result is equivalent:

* no mask at all   when every stored key is visible to every query (e.g. one-token decode on a
                   contiguous cache inside its window);
* ``"causal"``     when the keys end at the last query and no window cuts in (MLX's causal
                   mask is lower-right aligned, which is exactly "query i sees keys <= its position");
* a boolean mask   otherwise, built from logical query and key positions.

On the CPU, MLX's attention materializes the whole (queries x keys) score matrix and spends
most of its time in the softmax's exponentials, so a long causal prefill wastes the masked half
(and a sliding window most of it). There, runs of more than ``QUERY_BLOCK`` queries are cut into
blocks that each attend only to the keys their mask can reach (same result, less work).
"""

from __future__ import annotations

import mlx.core as mx

from backend import kernels
from backend.caches.base import AttentionMask, KVHistory


def logical_mask(mask: AttentionMask, query_positions: mx.array,
                 key_positions: mx.array) -> mx.array:
    """Boolean ``(Q, K)``: may the query at each position attend to the key at each position."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    if mask.kind != "causal":
        return mx.ones((q.shape[0], k.shape[1]), dtype=mx.bool_)
    allowed = k <= q
    if mask.window is not None:
        allowed = allowed & (k > q - mask.window)
    return allowed


def attention_mask(history: KVHistory, mask: AttentionMask,
                   key_padding: mx.array | None = None) -> mx.array | str | None:
    """The cheapest mask argument for ``mx.fast.scaled_dot_product_attention``.

    ``key_padding``: optional boolean ``(B, S)``, False for padded key slots.
    """
    n_q, start, first = history.num_queries, history.query_start, history.key_start
    n_keys = history.keys.shape[2]
    if key_padding is None:
        # The last query's window reaches back to the first stored key?  Then it never cuts in.
        window_irrelevant = mask.window is None or start + n_q - 1 - mask.window < first
        if mask.kind == "none" or (window_irrelevant and n_q == 1 and
                                   n_keys == start + 1 - first):
            return None
        if window_irrelevant and n_keys == start + n_q - first:
            return "causal"  # MLX's causal mask is lower-right aligned: exactly this
    positions = mx.arange(first, first + n_keys, dtype=mx.int32)
    queries = mx.arange(start, start + n_q, dtype=mx.int32)
    allowed = logical_mask(mask, queries, positions)  # (Q, S)
    if key_padding is not None:
        allowed = allowed[None, None] & key_padding[:, None, None, :]
    return allowed


QUERY_BLOCK = 256


class _KeyRange:
    """A block of queries with the slice of the history its mask can reach (a KVHistory)."""

    __slots__ = ("keys", "values", "query_start", "num_queries", "key_start")

    def __init__(self, keys: mx.array, values: mx.array, query_start: int, num_queries: int,
                 key_start: int):
        self.keys, self.values = keys, values
        self.query_start, self.num_queries = query_start, num_queries
        self.key_start = key_start


def query_blocks(history: KVHistory, mask: AttentionMask) -> list[_KeyRange] | None:
    """Cut a long causal run of queries into blocks with their reachable key slices, or None
    when blocking does not apply (short runs, no causal mask, non-CPU device)."""
    n_q, start = history.num_queries, history.query_start
    if n_q <= QUERY_BLOCK or mask.kind != "causal" or mx.default_device() != mx.cpu:
        return None
    first = history.key_start  # slot i holds position first + i
    n_keys = history.keys.shape[2]
    blocks = []
    for s in range(0, n_q, QUERY_BLOCK):
        e = min(n_q, s + QUERY_BLOCK)
        hi = min(start + e, first + n_keys)  # keys after the block's last query are masked
        lo = first if mask.window is None else max(first, start + s - mask.window + 1)
        keys = history.keys[..., lo - first:hi - first, :]
        values = history.values[..., lo - first:hi - first, :]
        blocks.append(_KeyRange(keys, values, start + s, e - s, lo))
    return blocks


def _native_attention(queries: mx.array, history: KVHistory, mask: AttentionMask,
                      scale: float) -> mx.array | None:
    """The native path: the per-query kernel for up to MAX_ATTENTION_QUERIES queries (each
    reduced over exactly its visible keys, so a verify block equals one-token steps bit for
    bit); longer runs (prefill) in blocks of QUERY_BLOCK queries, each against the keys up to
    its last query: scores and values through BLAS, the masked softmax in one vectorized pass
    (MLX's CPU softmax evaluates its exponentials one by one)."""
    n_q = queries.shape[2]
    if mask.kind == "none":
        if n_q > kernels.MAX_ATTENTION_QUERIES:
            return None
        return kernels.attention(queries, history.keys, history.values, scale, causal=False)
    first = history.key_start
    if history.keys.shape[2] != history.query_start + n_q - first:
        return None  # keys beyond the last query: not the kernels' causal alignment
    if n_q <= kernels.MAX_ATTENTION_QUERIES:
        return kernels.attention(queries, history.keys, history.values, scale, causal=True,
                                 window=mask.window)
    outs = []
    for s in range(0, n_q, QUERY_BLOCK):
        e = min(n_q, s + QUERY_BLOCK)
        end = history.query_start + e - first  # keys through this block's last query
        lo = 0 if mask.window is None else max(0, history.query_start + s - mask.window + 1 - first)
        out = _blas_attention(queries[..., s:e, :], history.keys[..., lo:end, :],
                              history.values[..., lo:end, :], scale, mask.window)
        if out is None:
            return None
        outs.append(out)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _blas_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                    window: int | None) -> mx.array | None:
    """q (B, Hq, M, D) against k, v (B, Hkv, L, D|Dv) whose last key is q's last query."""
    b, hq, m, d = q.shape
    hkv, n_keys = k.shape[1], k.shape[2]
    g = hq // hkv  # query head h reads kv head h // g
    # The g query heads of a kv head as one (g * M)-row matrix: one product per kv head, with
    # no copy of k and v broadcast to every query head (that copy grew with the context).
    rows = (q * scale).reshape(b, hkv, g * m, d)
    scores = (rows @ k.swapaxes(-1, -2)).reshape(b, hkv, g, m, n_keys)
    probs = kernels.causal_softmax(scores, window)
    if probs is None:
        return None
    return (probs.reshape(b, hkv, g * m, n_keys) @ v).reshape(b, hq, m, v.shape[-1])


def scaled_dot_product_attention(queries: mx.array, history: KVHistory, mask: AttentionMask,
                                 scale: float, key_padding: mx.array | None = None,
                                 native: bool = False) -> mx.array:
    """``queries`` (B, n_heads, Q, D) against the cache history -> (B, n_heads, Q, Dv).

    ``native``: a few float32 queries (decode, verification) go to the native CPU attention
    kernel when it is built and the keys end at the last query (always, for a cache's own
    history); it reduces each query over exactly its visible keys, so a verify block's rows
    equal one-token decode steps bit for bit, sliding windows included.
    """
    if native and key_padding is None:
        out = _native_attention(queries, history, mask, scale)
        if out is not None:
            return out
    blocks = None if key_padding is not None else query_blocks(history, mask)
    if blocks is not None:
        outs = []
        for block in blocks:
            q0 = block.query_start - history.query_start
            outs.append(mx.fast.scaled_dot_product_attention(
                queries[..., q0:q0 + block.num_queries, :], block.keys, block.values,
                scale=scale, mask=attention_mask(block, mask)))
        return mx.concatenate(outs, axis=2)
    return mx.fast.scaled_dot_product_attention(
        queries, history.keys, history.values, scale=scale,
        mask=attention_mask(history, mask, key_padding))

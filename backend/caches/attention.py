"""One scaled-dot-product-attention helper for every model and cache kind.

Models describe their mask logically (``AttentionMask``: causal, sliding window, none); the cache's
``KVHistory`` says where each stored slot sits in the sequence. This helper composes the two
(plus optional key padding) and takes MLX's fused paths whenever the result is equivalent:

* no mask at all   when every stored key is visible to every query (e.g. one-token decode on a
                   contiguous cache inside its window);
* ``"causal"``     when storage is contiguous from position 0 and no window cuts in (MLX's causal
                   mask is lower-right aligned, which is exactly "query i sees keys <= its position");
* a boolean mask   otherwise, built from logical query and key positions.
"""

from __future__ import annotations

import mlx.core as mx

from backend.caches.base import AttentionMask, KVHistory


def logical_mask(mask: AttentionMask, query_positions: mx.array,
                 key_positions: mx.array) -> mx.array:
    """Boolean ``(Q, K)``: may the query at each position attend to the key at each position."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    allowed = k >= 0  # -1 marks an empty slot
    if mask.kind == "causal":
        allowed = allowed & (k <= q)
        if mask.window is not None:
            allowed = allowed & (k > q - mask.window)
    return allowed


def attention_mask(history: KVHistory, mask: AttentionMask,
                   key_padding: mx.array | None = None) -> mx.array | str | None:
    """The cheapest mask argument for ``mx.fast.scaled_dot_product_attention``.

    ``key_padding``: optional boolean ``(B, S)``, False for padded key slots.
    """
    n_q, start = history.num_queries, history.query_start
    positions = history.key_positions()
    if key_padding is None and positions is None:
        n_keys = history.keys.shape[2]
        last = start + n_q - 1
        # All keys visible to the first query's window?  Then the window never cuts in.
        window_irrelevant = mask.window is None or last < mask.window
        if mask.kind == "none" or (window_irrelevant and n_q == 1):
            return None
        if window_irrelevant and n_keys == start + n_q:
            return "causal"
    if positions is None:
        positions = mx.arange(history.keys.shape[2], dtype=mx.int32)
    queries = mx.arange(start, start + n_q, dtype=mx.int32)
    allowed = logical_mask(mask, queries, positions)  # (Q, S)
    if key_padding is not None:
        allowed = allowed[None, None] & key_padding[:, None, None, :]
    return allowed


def scaled_dot_product_attention(queries: mx.array, history: KVHistory, mask: AttentionMask,
                                 scale: float, key_padding: mx.array | None = None) -> mx.array:
    """``queries`` (B, n_heads, Q, D) against the cache history -> (B, n_heads, Q, Dv)."""
    return mx.fast.scaled_dot_product_attention(
        queries, history.keys, history.values, scale=scale,
        mask=attention_mask(history, mask, key_padding))

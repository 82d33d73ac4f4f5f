"""Segmented scans for recurrent layers: causal depthwise conv and the gated delta rule.

Both scans take ``boundaries``: strictly increasing token counts in ``(0, N]`` of a write of
``N`` tokens, and return the layer state *after* each boundary (the last one is normally ``N``,
the state the cache keeps). A batched forward (a chunked prefill, a speculative verify block)
can so capture the state at every scheduled snapshot offset without re-running anything. The
outputs never depend on the boundaries: they are identical whatever split points are asked for.

Gated delta rule (per value head, state ``S`` of shape ``(Dv, Dk)``, float32)::

    S_t = g_t * S_{t-1} + beta_t * (v_t - g_t * S_{t-1} k_t) k_t^T        y_t = S_t q_t

Two evaluation orders give the same outputs and states (up to float rounding):

* ``gated_delta_recurrent``: the per-token loop above (decode, short verify blocks);
* ``gated_delta_chunked``: the chunked parallel (WY) form for prefill. Inside a chunk of ``C``
  tokens with cumulative log decay ``b`` the pseudo-values ``U = T (beta*V)`` and
  ``W = T (beta*exp(b)*K)`` with ``T = (I + strict_tril(beta K K^T * exp(b_i - b_j)))^-1`` turn the
  chunk into a few matrix products; only the state is carried from chunk to chunk, so a 4k
  prompt needs 64 sequential steps instead of 4096.

The delta state is float32 whatever the activation dtype (bf16 accumulation over thousands of
tokens drifts); outputs come back in float32 and callers cast them.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from backend import kernels

#: Tokens per chunk of the parallel form. 64 is the usual choice (FLA, transformers): large
#: enough that the per-chunk matmuls amortise their launch cost, small enough that the intra-
#: chunk C x C work stays below the state work.
CHUNK = 64

#: Writes of at most this many tokens use the per-token recurrence (decode, verify blocks,
#: exact-prefill chunks: as many rows as the row-invariant kernels take): the same compiled
#: step as one-token writes, so their states and outputs equal decode steps bit for bit (the
#: chunked form reduces in another order).
RECURRENT_MAX_TOKENS = kernels.MAX_KERNEL_ROWS

#: Writes of at least this many tokens split a layer's heads over ``CPU_STREAMS`` streams.
PARALLEL_MIN_TOKENS = 64

#: MLX's CPU backend runs the non-BLAS ops of a stream on one thread, so a long scan leaves
#: the second core of a small machine idle. Independent head groups submitted on separate CPU
#: streams run concurrently (about 1.4x faster for a 2k-token gated-delta layer on 2 cores).
CPU_STREAMS = 2

_side_streams: list[mx.Stream] = []


def parallel_groups(heads: int, tokens: int) -> int:
    """How many head groups a write of ``tokens`` tokens should run as (1: no split)."""
    if mx.default_device() != mx.cpu or tokens < PARALLEL_MIN_TOKENS:
        return 1
    groups = min(CPU_STREAMS, heads)
    while heads % groups:
        groups -= 1
    return groups


def run_on_streams(fn, items: Sequence) -> list:
    """``[fn(item) for item in items]`` with item ``i`` built on CPU stream ``i`` (the default
    stream first). MLX orders cross-stream dependencies itself; results are ordinary arrays."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    while len(_side_streams) < len(items) - 1:
        _side_streams.append(mx.new_stream(mx.cpu))
    streams = [mx.default_stream(mx.cpu)] + _side_streams[:len(items) - 1]
    results = []
    for item, stream in zip(items, streams):
        with mx.stream(stream):
            results.append(fn(item))
    return results


def _check_boundaries(boundaries: Sequence[int], n: int) -> list[int]:
    bounds = list(boundaries)
    if any(b <= a for a, b in zip(bounds, bounds[1:])) or (bounds and not 0 < bounds[0]) or (
            bounds and bounds[-1] > n):
        raise ValueError(f"scan boundaries must increase inside (0, {n}]: got {bounds}")
    return bounds


# -- causal depthwise convolution -------------------------------------------------------------

def causal_conv1d(x: mx.array, weight: mx.array, state: mx.array | None,
                  boundaries: Sequence[int]) -> tuple[mx.array, list[mx.array]]:
    """Depthwise causal convolution of ``x`` ``(B, N, C)`` with ``weight`` ``(C, K)``.

    ``state`` ``(B, K-1, C)`` holds the K-1 inputs before ``x`` (None: zeros). Returns the
    pre-activation output ``(B, N, C)`` and, for each boundary ``s``, the conv state after ``s``
    tokens (the last K-1 inputs), each a compact array of its own.
    """
    b, n, c = x.shape
    k = weight.shape[1]
    bounds = _check_boundaries(boundaries, n)
    if state is None:
        state = mx.zeros((b, k - 1, c), x.dtype)
    padded = mx.concatenate([state.astype(x.dtype), x], axis=1)  # (B, N + K - 1, C)
    w = weight.astype(x.dtype)
    y = padded[:, 0:n, :] * w[:, 0]
    for j in range(1, k):
        y = y + padded[:, j:j + n, :] * w[:, j]
    # A slice would keep all of `padded` alive; contiguous copies exactly K-1 rows.
    states = [mx.contiguous(padded[:, s:s + k - 1, :]) for s in bounds]
    return y, states


# -- gated delta rule: per-token recurrence ---------------------------------------------------

def _repeat_heads(x: mx.array, heads: int) -> mx.array:
    """(B, N, Hk, D) -> (B, N, heads, D): value head h reads key head h // (heads // Hk)."""
    factor = heads // x.shape[2]
    return x if factor == 1 else mx.repeat(x, factor, axis=2)


@mx.compile
def _delta_step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                state: mx.array) -> tuple[mx.array, mx.array]:
    """One token for all heads: q, k (B, H, Dk); v (B, H, Dv); g, beta (B, H); state (B, H, Dv, Dk).

    The decay is a scalar per head, so ``(g S) x == g (S x)``: one matmul reads the old state
    for both k and q, and one fused pass writes the new state.
    """
    kq = mx.stack([k, q], axis=-1)  # (B, H, Dk, 2)
    sk_sq = state @ kq  # (B, H, Dv, 2)
    g_ = g[..., None]
    delta = (v - g_ * sk_sq[..., 0]) * beta[..., None]  # (B, H, Dv)
    y = g_ * sk_sq[..., 1] + delta * (k * q).sum(axis=-1, keepdims=True)
    new_state = state * g_[..., None] + delta[..., :, None] * k[..., None, :]
    return y, new_state


def gated_delta_recurrent(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array,
                          beta: mx.array, state: mx.array | None,
                          boundaries: Sequence[int]) -> tuple[mx.array, list[mx.array]]:
    """Per-token gated delta rule.

    ``q``, ``k``: ``(B, N, Hk, Dk)`` (normalised; q carries the 1/sqrt(Dk) readout scale);
    ``v``: ``(B, N, Hv, Dv)``; ``log_g``, ``beta``: ``(B, N, Hv)``; ``state``: ``(B, Hv, Dv, Dk)``
    float32 or None (zeros). Returns ``y`` ``(B, N, Hv, Dv)`` float32 and the state after each
    boundary.
    """
    b, n, _, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    bounds = set(_check_boundaries(boundaries, n))
    f32 = mx.float32
    q, k = _repeat_heads(q, hv).astype(f32), _repeat_heads(k, hv).astype(f32)
    v, g, beta = v.astype(f32), mx.exp(log_g.astype(f32)), beta.astype(f32)
    if state is None:
        state = mx.zeros((b, hv, dv, dk), f32)
    ys, states = [], []
    for t in range(n):
        y, state = _delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        if t + 1 in bounds:
            states.append(state)
    return mx.stack(ys, axis=1), states


# -- gated delta rule: chunked parallel form --------------------------------------------------

def _diagonal_blocks(m: mx.array, size: int) -> mx.array:
    """(..., C, C) -> (..., C // size, size, size): the diagonal blocks of ``m``."""
    c = m.shape[-1]
    grid = m.reshape(*m.shape[:-2], c // size, size, c // size, size)
    return mx.diagonal(grid, axis1=-4, axis2=-2).moveaxis(-1, -3)


def unit_lower_inverse(m: mx.array) -> mx.array:
    """Inverse of unit lower-triangular ``(..., C, C)`` matrices, ``C`` a power of two.

    Block recursion ``[[A, 0], [X, B]]^-1 = [[A^-1, 0], [-B^-1 X A^-1, B^-1]]`` from 1 x 1
    blocks up: the arithmetic of forward substitution (stable for the delta rule's WY matrices,
    unlike a Neumann series whose terms grow combinatorially), batched into log2(C) levels of
    small matmuls that run on any device.
    """
    c = m.shape[-1]
    if c & (c - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two size, got {c}")
    lead = m.shape[:-2]
    inv = mx.ones((*lead, c, 1, 1), m.dtype)  # inverses of the 1 x 1 diagonal blocks
    size = 1
    while size < c:
        lower_left = _diagonal_blocks(m, 2 * size)[..., size:, :size]  # (..., nb, s, s)
        pairs = inv.reshape(*lead, c // (2 * size), 2, size, size)
        top, bottom = pairs[..., 0, :, :], pairs[..., 1, :, :]
        off = -(bottom @ (lower_left @ top))
        inv = mx.concatenate([mx.concatenate([top, mx.zeros_like(off)], axis=-1),
                              mx.concatenate([off, bottom], axis=-1)], axis=-2)
        size *= 2
    return inv.reshape(*lead, c, c)


def gated_delta_chunked(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array,
                        beta: mx.array, state: mx.array | None, boundaries: Sequence[int],
                        chunk: int = CHUNK) -> tuple[mx.array, list[mx.array]]:
    """Chunked parallel gated delta rule; same arguments and results as ``gated_delta_recurrent``.

    The chunk grid starts at the first token of this write, so outputs do not depend on
    ``boundaries``; a boundary inside a chunk gets its state from that chunk's start state and
    the chunk's own pseudo-values (a side product, the main scan is unchanged).
    """
    b, n, _, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    bounds = _check_boundaries(boundaries, n)
    f32 = mx.float32
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def heads_first(x: mx.array) -> mx.array:  # (B, N, H, ...) -> (B, H, n, C, ...)
        x = x.astype(f32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.swapaxes(1, 2)
        return x.reshape(x.shape[0], x.shape[1], n_chunks, chunk, *x.shape[3:])

    # Padded tokens have k = v = beta = 0 and log_g = 0: they leave the state unchanged.
    q = heads_first(_repeat_heads(q, hv))  # (B, H, n, C, Dk)
    k = heads_first(_repeat_heads(k, hv))
    v = heads_first(v)  # (B, H, n, C, Dv)
    beta = heads_first(beta)  # (B, H, n, C)
    decay = mx.cumsum(heads_first(log_g), axis=-1)  # b_i: cumulative log decay in the chunk

    rows = mx.arange(chunk)
    causal = rows[:, None] >= rows[None, :]
    # exp(b_i - b_j) for j <= i, else 0 (masked before exp so nothing overflows).
    gaps = mx.where(causal, decay[..., :, None] - decay[..., None, :], -mx.inf)
    pair_decay = mx.exp(gaps)  # (B, H, n, C, C)
    k_beta = k * beta[..., None]
    strict = (k_beta @ k.swapaxes(-1, -2)) * mx.where(rows[:, None] > rows[None, :],
                                                      pair_decay, 0.0)
    t_inv = unit_lower_inverse(strict + mx.eye(chunk, dtype=f32))
    w = t_inv @ (k_beta * mx.exp(decay)[..., None])  # (B, H, n, C, Dk)
    u = t_inv @ (v * beta[..., None])  # (B, H, n, C, Dv)
    attn = (q @ k.swapaxes(-1, -2)) * pair_decay  # (B, H, n, C, C), causal incl. diagonal
    out_local = attn @ u  # intra-chunk part of the output
    q_state = q * mx.exp(decay)[..., None] - attn @ w  # what reads the chunk-start state
    wq = mx.concatenate([w, q_state], axis=-2)  # (B, H, n, 2C, Dk)
    last = decay[..., -1:]  # (B, H, n, 1)
    k_tail = k * mx.exp(last - decay)[..., None]  # decay from each token to the chunk end
    chunk_decay = mx.exp(last)[..., None]  # (B, H, n, 1, 1)

    s = (mx.zeros((b, hv, dk, dv), f32) if state is None
         else state.astype(f32).swapaxes(-1, -2))  # k-major (B, H, Dk, Dv) inside the loop
    wanted = {}
    for pos in bounds:
        wanted.setdefault((pos - 1) // chunk, []).append(pos)
    outs, states = [], []
    for i in range(n_chunks):
        read = wq[:, :, i] @ s  # (B, H, 2C, Dv)
        v_new = u[:, :, i] - read[..., :chunk, :]
        outs.append(out_local[:, :, i] + read[..., chunk:, :])
        start = s
        s = s * chunk_decay[:, :, i] + k_tail[:, :, i].swapaxes(-1, -2) @ v_new
        for pos in wanted.get(i, ()):
            r = pos - i * chunk
            if r == chunk:
                states.append(s)
                continue
            # State after r tokens of this chunk: decay the start state to r, add rows < r.
            b_r = decay[:, :, i, r - 1:r]  # (B, H, 1)
            k_r = k[:, :, i, :r] * mx.exp(b_r[..., None] - decay[:, :, i, :r, None])
            states.append(start * mx.exp(b_r)[..., None]
                          + k_r.swapaxes(-1, -2) @ v_new[..., :r, :])
    y = mx.stack(outs, axis=2).reshape(b, hv, n_chunks * chunk, dv)[:, :, :n]
    return y.swapaxes(1, 2), [mx.contiguous(st.swapaxes(-1, -2)) for st in states]


def gated_delta(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array,
                state: mx.array | None,
                boundaries: Sequence[int]) -> tuple[mx.array, list[mx.array]]:
    """The gated delta rule in the cheaper evaluation order for this write's length."""
    if q.shape[1] <= RECURRENT_MAX_TOKENS:
        return gated_delta_recurrent(q, k, v, log_g, beta, state, boundaries)
    return gated_delta_chunked(q, k, v, log_g, beta, state, boundaries)

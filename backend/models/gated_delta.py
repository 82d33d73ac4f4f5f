"""The gated-delta linear-attention mixer shared by Qwen3-Next and Qwen3.5.

``GatedDeltaMixer`` holds everything after the input projections: a causal depthwise conv
(kernel ``linear_conv_kernel_dim``) and SiLU over [q | k | v], L2-normalised q and k, the gated
delta rule (``caches/scan.py``: chunked in parallel for prefill, per token for decode and
verify blocks, the state captured at every scheduled snapshot offset) on a ``RecurrentCache``
(float32 state), then an RMS norm per value head gated by SiLU(z) and the output projection.
Long writes split the key heads over CPU streams (``scan.parallel_groups``).

The families differ only in how the projections are stored: Qwen3-Next fuses them
(``in_proj_qkvz``, ``in_proj_ba``), Qwen3.5 keeps four; each family's subclass owns its
projections and says how they split (``_split_projections``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backend.caches.recurrent import RecurrentCache
from backend.caches.scan import causal_conv1d, gated_delta, parallel_groups, run_on_streams
from backend.caches.segments import Segments


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, then times SiLU(gate)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps) * nn.silu(gate.astype(mx.float32)
                                                                    ).astype(x.dtype)


class GatedDeltaMixer(nn.Module):
    """Linear attention with the gated delta rule; state in a ``RecurrentCache``.

    Subclasses own the input projections and implement ``_split_projections``; ``args`` is
    any family's arguments with ``hidden_size``, ``rms_norm_eps`` and the ``linear_*`` sizes.
    """

    def __init__(self, args: Any):
        super().__init__()
        self.num_k_heads, self.num_v_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = args.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim,
                                bias=False)  # weight (C, K, 1); applied by scan.causal_conv1d
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    def _split_projections(self, x: mx.array
                           ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``x`` (B, N, hidden) -> the conv input [all q | all k | all v] (B, N, conv_dim), the
        output gate z (B, N, Hv, Dv), and the beta and decay inputs (B, N, Hv) each."""
        raise NotImplementedError

    def __call__(self, x: mx.array, cache: RecurrentCache | Segments) -> mx.array:
        b, n, _ = x.shape
        mixed, z, beta_in, decay_in = self._split_projections(x)
        if isinstance(cache, Segments):  # several sequences' rows: each scans its own state
            y = cache.map(self._mix, (mixed, z, beta_in, decay_in), axis=1)
        else:
            y = self._mix(mixed, z, beta_in, decay_in, cache)
        return self.out_proj(y.reshape(b, n, -1))

    def _mix(self, mixed: mx.array, z: mx.array, beta_in: mx.array, decay_in: mx.array,
             cache: RecurrentCache) -> mx.array:
        """One sequence's rows through the conv and the gated delta scan on its cache:
        (B, N, Hv, Dv)."""
        n = mixed.shape[1]
        bounds = cache.boundaries(n)
        beta = mx.sigmoid(beta_in.astype(mx.float32))  # (B, N, Hv)
        log_g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(
            decay_in.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        groups = parallel_groups(self.num_k_heads, n)
        per_group = run_on_streams(
            lambda g: self._mix_heads(g, groups, mixed, z, beta, log_g, cache, bounds),
            range(groups))
        if groups == 1:
            y, conv_states, delta_states = per_group[0]
        else:
            y = mx.concatenate([r[0] for r in per_group], axis=2)
            conv_states = [self._join_conv_states([r[1][i] for r in per_group])
                           for i in range(len(bounds))]
            delta_states = [mx.concatenate([r[2][i] for r in per_group], axis=1)
                            for i in range(len(bounds))]
        cache.advance(n, conv_states, delta_states)
        return y

    def _group_columns(self, group: int, groups: int) -> list[tuple[int, int]]:
        """Conv channel ranges of key-head group ``group``: its q, k and v columns."""
        qk = self.key_dim // groups
        vv = self.value_dim // groups
        return [(group * qk, (group + 1) * qk),
                (self.key_dim + group * qk, self.key_dim + (group + 1) * qk),
                (2 * self.key_dim + group * vv, 2 * self.key_dim + (group + 1) * vv)]

    def _join_conv_states(self, parts: list[mx.array]) -> mx.array:
        """Per-group conv states ([q_g | k_g | v_g] each) -> [all q | all k | all v]."""
        groups = len(parts)
        qk, vv = self.key_dim // groups, self.value_dim // groups
        pieces = [p[..., :qk] for p in parts] + [p[..., qk:2 * qk] for p in parts] + [
            p[..., 2 * qk:2 * qk + vv] for p in parts]
        return mx.concatenate(pieces, axis=-1)

    def _mix_heads(self, group: int, groups: int, mixed: mx.array, z: mx.array, beta: mx.array,
                   log_g: mx.array, cache: RecurrentCache, bounds: list[int]):
        """Conv, normalisation, gated delta scan and gated norm for one group of key heads and
        their value heads: (y (B, N, Hv/groups, Dv), conv states, delta states) at ``bounds``."""
        b, n, _ = mixed.shape
        weight, state = self.conv1d.weight[..., 0], cache.conv  # (C, K), (B, K-1, C)
        if groups > 1:
            cols = self._group_columns(group, groups)
            mixed = mx.concatenate([mixed[..., lo:hi] for lo, hi in cols], axis=-1)
            weight = mx.concatenate([weight[lo:hi] for lo, hi in cols], axis=0)
            if state is not None:
                state = mx.concatenate([state[..., lo:hi] for lo, hi in cols], axis=-1)
        conv_out, conv_states = causal_conv1d(mixed, weight, state, bounds)
        conv_out = nn.silu(conv_out)
        hk, hv = self.num_k_heads // groups, self.num_v_heads // groups
        key_width = hk * self.head_k_dim
        q, k, v = mx.split(conv_out, [key_width, 2 * key_width], axis=-1)
        q = q.reshape(b, n, hk, self.head_k_dim)
        k = k.reshape(b, n, hk, self.head_k_dim)
        v = v.reshape(b, n, hv, self.head_v_dim)
        # L2-normalise (eps 1e-6 on the sum of squares) and fold the readout scale into q:
        # rms_norm with eps / D is sqrt(D) * l2norm.
        inv = self.head_k_dim ** -0.5
        q = mx.fast.rms_norm(q, None, 1e-6 * inv * inv) * (inv * inv)
        k = mx.fast.rms_norm(k, None, 1e-6 * inv * inv) * inv
        heads = slice(group * hv, (group + 1) * hv)
        delta = None if cache.delta is None else cache.delta[:, heads]
        y, delta_states = gated_delta(q, k, v, log_g[..., heads], beta[..., heads], delta, bounds)
        y = self.norm(y.astype(mixed.dtype), z[:, :, heads])  # (B, N, Hv/groups, Dv)
        return y, conv_states, delta_states

"""Building blocks shared by every architecture: attention, gated MLP, norms.

Attention owns its projections, optional per-head q/k norms and RoPE, and talks to its cache only
through ``cache.update(...) -> KVHistory`` and the shared SDPA helper (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from backend import kernels
from backend.caches.attention import scaled_dot_product_attention
from backend.caches.base import CAUSAL, AttentionMask, Cache
from backend.caches.segments import Segments
from backend.models.rope import RoPE


class RMSNorm(nn.Module):
    """RMSNorm; ``offset=1`` gives the Gemma form that scales by (1 + weight)."""

    #: Decode-sized float32 work through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False

    def __init__(self, dims: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = mx.zeros((dims,)) if offset else mx.ones((dims,))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: mx.array) -> mx.array:
        weight = self.weight + self.offset if self.offset else self.weight
        if self.native_ops:
            return kernels.rms_norm(x, weight, self.eps)
        return mx.fast.rms_norm(x, weight, self.eps)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) — SwiGLU (silu) or GeGLU (gelu_tanh)."""

    #: float32 SwiGLU gates through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False
    #: Projections of one input that ``use_cpu_kernels`` may stack into one matrix.
    stackable_projections = ("gate_proj", "up_proj")
    stacked = None  # their StackedProjections, when stacked

    def __init__(self, dims: int, hidden: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=bias)
        self.up_proj = nn.Linear(dims, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dims, bias=bias)
        self.activation = ACTIVATIONS[activation]
        self.is_swiglu = activation == "silu"

    def __call__(self, x: mx.array) -> mx.array:
        if self.stacked is not None:
            gate, up = self.stacked(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.native_ops and self.is_swiglu:
            return self.down_proj(kernels.silu_mul(gate, up))
        return self.down_proj(self.activation(gate) * up)


ACTIVATIONS = {
    "silu": nn.silu,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_tanh": nn.gelu_approx,
    "gelu": nn.gelu,
}


@dataclass(frozen=True)
class AttentionShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm_eps: float | None = None  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_offset: float = 0.0
    scale: float | None = None  # defaults to head_dim ** -0.5
    # q_proj also emits a per-head gate: out = o_proj(attn * sigmoid(gate)) (Qwen3-Next)
    output_gate: bool = False

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> "AttentionShape":
        """The shape most configs describe the same way (sizes, heads, ``attention_bias`` on
        every projection); ``overrides`` set the rest or replace any of these."""
        values = dict(hidden_size=args.hidden_size, num_heads=args.num_attention_heads,
                      num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                      qkv_bias=args.attention_bias, out_bias=args.attention_bias)
        return cls(**{**values, **overrides})


class Attention(nn.Module):
    #: Decode-sized float32 attention through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False
    #: Projections of one input that ``use_cpu_kernels`` may stack into one matrix.
    stackable_projections = ("q_proj", "k_proj", "v_proj")
    stacked = None  # their StackedProjections, when stacked

    def __init__(self, shape: AttentionShape, rope: RoPE, mask: AttentionMask = CAUSAL):
        super().__init__()
        s = shape
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.scale = s.scale if s.scale is not None else s.head_dim ** -0.5
        q_width = s.num_heads * s.head_dim * (2 if s.output_gate else 1)
        self.q_proj = nn.Linear(s.hidden_size, q_width, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.out_bias)
        if s.qk_norm_eps is not None:
            self.q_norm = RMSNorm(s.head_dim, s.qk_norm_eps, s.qk_norm_offset)
            self.k_norm = RMSNorm(s.head_dim, s.qk_norm_eps, s.qk_norm_offset)
        self.has_qk_norm = s.qk_norm_eps is not None
        self.output_gate = s.output_gate
        self.rope = rope
        self.mask = mask

    def __call__(self, x: mx.array, cache: Cache) -> mx.array:
        b, n, _ = x.shape  # x: (B, N, hidden)
        if self.stacked is not None:
            q, k, v = self.stacked(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.output_gate:  # per head: [query (head_dim) | gate (head_dim)]
            q, gate = mx.split(q.reshape(b, n, self.num_heads, 2 * self.head_dim), 2, axis=-1)
        q = q.reshape(b, n, self.num_heads, self.head_dim)
        k = k.reshape(b, n, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, n, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, heads, N, D)
        if isinstance(cache, Segments):  # several sequences' rows: each attends to its own
            out = cache.map(self._attend, (q, k, v), axis=2)
        else:
            out = self._attend(q, k, v, cache)  # (B, H, N, D)
        out = out.transpose(0, 2, 1, 3).reshape(b, n, -1)
        if self.output_gate:
            out = out * mx.sigmoid(gate.reshape(b, n, -1))
        return self.o_proj(out)

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, cache: Cache) -> mx.array:
        """One sequence: RoPE at its cache's offset, the cache written, attention over its
        history. q, k, v (B, heads, N, D) -> (B, H, N, D)."""
        offset = cache.offset
        q, k = self.rope(q, offset), self.rope(k, offset)
        history = cache.update(k, v)
        return scaled_dot_product_attention(q, history, self.mask, self.scale,
                                            native=self.native_ops)

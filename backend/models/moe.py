"""Sparse mixture-of-experts block shared by Qwen3-MoE and Qwen3-Next.

Experts are *stacked* per layer: one ``(experts, out, in)`` weight per projection. Two ways to
apply them, chosen by how many token-expert pairs a write has:

* few (decode, verify blocks): one product per pair — each pair reads only its expert's
  weights, no host round trip. With the CPU kernels (``native_ops``) the pairs of one expert
  share a pass over its weights (``kernels.gather_linear``); otherwise MLX's gather matmuls
  (``mx.gather_mm``, ``mx.gather_qmm`` once quantized);
* many (prefill chunks): sort the pairs by expert and run one dense matmul per expert over its
  tokens. On the CPU, gather_mm does a matrix-vector product per pair and re-reads an expert's
  weights for every token routed to it; grouping costs one host sync per MoE layer per chunk and
  is ~2x faster at 1k tokens.

Checkpoints that store one tensor per expert are stacked by the model's ``sanitize``
(``stack_experts``).

Quantization: ``SwitchLinear.to_quantized`` returns a ``QuantizedSwitchLinear`` (affine, 4 or
8 bits, stacked ``weight``/``scales``/``biases`` as mx.quantize lays them out per expert), so the
loader's ``nn.quantize(model, class_predicate=...)`` path quantizes stacked experts like any
linear layer whenever ``<path>.scales`` is in the checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from backend import kernels
from backend.errors import CheckpointError, ConfigError
from backend.models.layers import ACTIVATIONS, GatedMLP

#: Token-expert pairs (per expert, on average) from which a write runs each expert as one
#: dense matmul over its tokens. Below it, ``gather_mm`` runs one matrix-vector product per
#: pair, which re-reads an expert's weights for every token routed to it: fine for decode and
#: verify blocks, wasteful for prefill chunks. The grouped path needs the routing on the host
#: (one sync per MoE layer per prefill chunk).
GROUPED_PAIRS_PER_EXPERT = 2

#: Writes of at most this many tokens always take the per-pair path (see SwitchGLU): as many
#: as the row-invariant kernels take, so exact-prefill chunks compute like decode steps too.
VERIFY_ROWS = kernels.MAX_KERNEL_ROWS


def _pairs(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array]:
    """``x`` (..., 1, in) and ``indices`` (...) as ``gather_mm`` pairs them (leading dims
    broadcast) -> one row per pair (lead..., in) and its index (lead...)."""
    lead = mx.broadcast_shapes(x.shape[:-2], indices.shape)
    return mx.broadcast_to(x.squeeze(-2), (*lead, x.shape[-1])), mx.broadcast_to(indices, lead)


class SwitchLinear(nn.Module):
    """``experts`` stacked linear maps without bias: weight ``(experts, out, in)``. Also the
    per-head matrices of an attention layer (one "expert" per head)."""

    #: Products through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False

    def __init__(self, input_dims: int, output_dims: int, experts: int):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        # x (..., 1, in) gathers against weight[indices] -> (..., 1, out)
        if self.native_ops:
            rows, index = _pairs(x, indices)
            y = kernels.gather_linear(rows, self.weight, index)
            if y is not None:
                return mx.expand_dims(y, -2)
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices)

    def expert(self, x: mx.array, index: int) -> mx.array:
        """``x`` (M, in) through expert ``index`` alone -> (M, out)."""
        return x @ self.weight[index].T

    def to_quantized(self, group_size: int = 64, bits: int = 4,
                     mode: str = "affine") -> "QuantizedSwitchLinear":
        experts, out, inp = self.weight.shape
        q = QuantizedSwitchLinear(inp, out, experts, group_size, bits, mode)
        q.weight, q.scales, q.biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        return q


class QuantizedSwitchLinear(nn.Module):
    """Stacked experts quantized per expert row group: packed ``weight``, ``scales``, ``biases``.

    Groups of 16 (GGUF Q2_K/Q3_K/Q6_K experts, built by ``from_arrays``) are a layout MLX
    dequantizes but does not multiply: their products run on the native kernel (8-bit codes),
    else on the picked experts dequantized."""

    #: Products through the native CPU kernel (set by ``use_cpu_kernels``).
    native_ops = False

    def __init__(self, input_dims: int, output_dims: int, experts: int, group_size: int = 64,
                 bits: int = 4, mode: str = "affine"):
        super().__init__()
        if mode != "affine":
            raise ValueError(f"stacked experts support affine quantization only, got {mode!r}")
        self.group_size, self.bits, self.mode = group_size, bits, mode
        packed = input_dims * bits // 32
        self.weight = mx.zeros((experts, output_dims, packed), mx.uint32)
        self.scales = mx.zeros((experts, output_dims, input_dims // group_size))
        self.biases = mx.zeros((experts, output_dims, input_dims // group_size))
        self.freeze()

    @classmethod
    def from_arrays(cls, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                    bits: int) -> "QuantizedSwitchLinear":
        """The layer holding these arrays, in any layout MLX dequantizes (``to_quantized``
        goes through ``mx.quantize``, which takes groups of 32, 64 and 128 only)."""
        experts, out, words = weight.shape
        layer = cls(words * 32 // bits, out, experts, group_size, bits)
        layer.weight, layer.scales, layer.biases = weight, scales, biases
        return layer

    @property
    def _mlx_multiplies(self) -> bool:
        return self.group_size in kernels.MLX_MATMUL_GROUP_SIZES

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.native_ops:
            rows, index = _pairs(x, indices)
            y = kernels.gather_quantized_linear(rows, self.weight, self.scales, self.biases,
                                                index, self.group_size, self.bits)
            if y is not None:
                return mx.expand_dims(y, -2)
        if not self._mlx_multiplies:  # the picked experts only: (..., k, out, in)
            w = mx.dequantize(self.weight[indices], self.scales[indices], self.biases[indices],
                              self.group_size, self.bits)
            return x @ w.astype(x.dtype).swapaxes(-1, -2)
        return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices,
                             transpose=True, group_size=self.group_size, bits=self.bits)

    def expert(self, x: mx.array, index: int) -> mx.array:
        if not self._mlx_multiplies:
            return kernels.quantized_linear(x, self.weight[index], self.scales[index],
                                            self.biases[index], self.group_size, self.bits)
        return mx.quantized_matmul(x, self.weight[index], self.scales[index],
                                   self.biases[index], transpose=True,
                                   group_size=self.group_size, bits=self.bits)


class SwitchGLU(nn.Module):
    """Gated MLP per expert: down(act(gate(x)) * up(x)) with stacked weights."""

    def __init__(self, dims: int, hidden: int, experts: int, activation: str = "silu"):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, experts)
        self.up_proj = SwitchLinear(dims, hidden, experts)
        self.down_proj = SwitchLinear(hidden, dims, experts)
        self.activation = ACTIVATIONS[activation]

    @property
    def num_experts(self) -> int:
        return self.gate_proj.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """``x`` (..., D), ``indices`` (..., k) -> (..., k, D): each token through its k experts."""
        tokens = indices.size // indices.shape[-1]
        # Few tokens (decode, a verify block): one product per token-expert pair, computed
        # alike for every token, so a block's rows equal one-token steps bit for bit.
        if tokens > VERIFY_ROWS and indices.size >= GROUPED_PAIRS_PER_EXPERT * self.num_experts:
            return self._grouped(x, indices)
        h = mx.expand_dims(x, (-2, -3))  # (..., 1, 1, D)
        gate = self.gate_proj(h, indices)
        up = self.up_proj(h, indices)
        return self.down_proj(self.activation(gate) * up, indices).squeeze(-2)  # (..., k, D)

    def _grouped(self, x: mx.array, indices: mx.array) -> mx.array:
        lead, k = indices.shape[:-1], indices.shape[-1]
        flat = indices.flatten()  # token-expert pairs, token-major
        order = mx.argsort(flat)
        counts = np.bincount(np.array(flat), minlength=self.num_experts)  # syncs the router
        rows = x.reshape(-1, x.shape[-1])[order // k]  # (T*k, D), grouped by expert
        outs, start = [], 0
        for e in np.flatnonzero(counts):
            part = rows[start:start + counts[e]]
            start += counts[e]
            h = self.activation(self.gate_proj.expert(part, e)) * self.up_proj.expert(part, e)
            outs.append(self.down_proj.expert(h, e))
        y = mx.concatenate(outs, axis=0)[mx.argsort(order)]  # back to token-major pairs
        return y.reshape(*lead, k, -1)


class SparseMoE(nn.Module):
    """Top-k routed experts, optionally plus a sigmoid-gated shared expert (Qwen3-Next)."""

    def __init__(self, dims: int, expert_hidden: int, experts: int, top_k: int,
                 norm_topk_prob: bool, shared_hidden: int | None = None,
                 activation: str = "silu"):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dims, experts, bias=False)
        self.switch_mlp = SwitchGLU(dims, expert_hidden, experts, activation)
        self.has_shared = shared_hidden is not None
        if self.has_shared:
            self.shared_expert = GatedMLP(dims, shared_hidden, activation=activation)
            self.shared_expert_gate = nn.Linear(dims, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)  # (B, N, E)
        top = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., :self.top_k]
        scores = mx.take_along_axis(probs, top, axis=-1)  # (B, N, k)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, top)  # (B, N, k, D)
        y = (y * scores[..., None].astype(y.dtype)).sum(axis=-2)
        if self.has_shared:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


def stack_experts(weights: dict[str, mx.array], prefix: str, experts: int,
                  source: str = "experts", target: str = "switch_mlp") -> dict[str, mx.array]:
    """Stack ``{prefix}.{source}.{e}.{proj}.{weight,scales,biases}`` into
    ``{prefix}.{target}.{proj}.*`` and split a fused ``{source}.gate_up_proj`` ``(E, 2I, D)``
    (transformers' in-memory layout) into gate and up. Other names pass through.

    A checkpoint with some experts of a projection but not all, or with experts of different
    shapes, is a ``CheckpointError`` naming the tensors."""
    out = dict(weights)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for suffix in ("weight", "scales", "biases"):
            names = [f"{prefix}.{source}.{e}.{proj}.{suffix}" for e in range(experts)]
            missing = [n for n in names if n not in out]
            if len(missing) == len(names):
                continue
            if missing:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                raise CheckpointError(f"missing expert tensors {', '.join(missing[:3])}{more}")
            shapes = {tuple(out[n].shape) for n in names}
            if len(shapes) > 1:
                odd = next(n for n in names if out[n].shape != out[names[0]].shape)
                raise CheckpointError(f"tensor {odd} has shape {list(out[odd].shape)}, other "
                                      f"experts have {list(out[names[0]].shape)}")
            out[f"{prefix}.{target}.{proj}.{suffix}"] = mx.stack([out.pop(n) for n in names])
    fused = f"{prefix}.{source}.gate_up_proj"
    if fused in out:
        gate_up = out.pop(fused)  # (E, 2I, D)
        down = f"{prefix}.{source}.down_proj"
        if gate_up.ndim != 3 or gate_up.shape[1] % 2:
            raise CheckpointError(f"tensor {fused} has shape {list(gate_up.shape)}, "
                                  "expected (experts, 2 * intermediate, hidden)")
        if down not in out:
            raise CheckpointError(f"missing expert tensor {down}")
        half = gate_up.shape[1] // 2
        out[f"{prefix}.{target}.gate_proj.weight"] = gate_up[:, :half]
        out[f"{prefix}.{target}.up_proj.weight"] = gate_up[:, half:]
        out[f"{prefix}.{target}.down_proj.weight"] = out.pop(down)
    return out


def check_routing(num_experts: int, num_experts_per_tok: int) -> None:
    """A router must pick among the experts there are (``ConfigError`` otherwise)."""
    if num_experts_per_tok > num_experts:
        raise ConfigError(f"num_experts_per_tok {num_experts_per_tok} is more than "
                          f"num_experts {num_experts}")


def is_sparse_layer(layer: int, mlp_only_layers: list[int], num_experts: int,
                    sparse_step: int) -> bool:
    """Whether decoder layer ``layer`` uses the sparse MoE block (Qwen MoE config rules)."""
    return (layer not in mlp_only_layers and num_experts > 0
            and (layer + 1) % sparse_step == 0)


def layer_mlp(args: Any, layer: int, sparse: Callable[[], nn.Module]) -> nn.Module:
    """Decoder layer ``layer``'s MLP: ``sparse()`` where ``args.is_sparse(layer)``, else the
    dense gated MLP of ``intermediate_size``."""
    if args.is_sparse(layer):
        return sparse()
    return GatedMLP(args.hidden_size, args.intermediate_size, activation=args.hidden_act)

// Fused few-row forward blocks of a Llama-style decoder layer as MLX CPU
// primitives (layer_ops.cpp). A weight is a list of arrays with its bits: 0 for
// a dense matrix (one float32 / bfloat16 / float16 array), 4 or 8 for MLX's
// affine layout (wq, float32 scales, float32 biases; group_size 32/64/128).
#pragma once

#include <tuple>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace arbor {
namespace mx = mlx::core;

// (arrays, bits, group_size, int8_inputs) of one weight matrix; int8_inputs: its
// products round their inputs to int8 first (4-bit weights, groups of 64 or 128).
using WeightArg = std::tuple<std::vector<mx::array>, int, int, bool>;

// x (B, N, H) float32 -> [q (B, heads, N, D), k (B, kv_heads, N, D), v (B, kv_heads, N, D)]:
// rms_norm(x, norm_weight, eps) @ qkv.T (qkv: the q, k and v rows stacked), split by
// heads, q and k rotated (non-traditional RoPE of the first rope_dims of each head,
// positions offset + t, angle i = (position * rope_scale) * inv_freqs[i]).
std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight,
                                        float eps, const WeightArg& qkv, int heads, int kv_heads,
                                        int head_dim, int rope_dims, int64_t offset,
                                        float rope_scale, const mx::array& inv_freqs,
                                        mx::StreamOrDevice s = {});

// Attention over a full-attention cache's key / value buffers (B, Hkv, capacity, D),
// which hold positions 0 .. length - 1 (q (B, Hq, N, D): the last N of them; causal,
// the last `window` keys when window > 0), then h = x + attn_rows @ o.T (each position's
// heads side by side) and h + down(silu(g) * u) for [g | u] = rms_norm(h, norm_weight,
// eps) @ gate_up.T (gate_up: the gate rows, then the up rows) -> (B, N, H) float32.
mx::array attention_mlp(const mx::array& q, const mx::array& keys, const mx::array& values,
                        int64_t length, float scale, int64_t window, const mx::array& x,
                        const mx::array& norm_weight, float eps, const WeightArg& o,
                        const WeightArg& gate_up, const WeightArg& down,
                        mx::StreamOrDevice s = {});

}  // namespace arbor

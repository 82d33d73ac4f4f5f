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

// A step's rows by sequence: segment s is rows[s] consecutive rows of the token
// axis (several segments only for B == 1), each sequence's as it would run alone.

// x (B, N, H) float32 -> [q (B, heads, N, D), then k and v (B, kv_heads, n, D) of
// each segment of n rows]: rms_norm(x, norm_weight, eps) @ qkv.T (qkv: the q, k and
// v rows stacked), split by heads, q and k rotated (non-traditional RoPE of the
// first rope_dims of each head; segment s's rows at positions offsets[s] + t, angle
// i = (position * rope_scale) * inv_freqs[i]).
std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight,
                                        float eps, const WeightArg& qkv, int heads, int kv_heads,
                                        int head_dim, int rope_dims,
                                        const std::vector<int64_t>& offsets,
                                        const std::vector<int64_t>& rows, float rope_scale,
                                        const mx::array& inv_freqs, mx::StreamOrDevice s = {});

// Per segment s, attention over a full-attention cache's key / value buffers
// keys[s], values[s] (B, Hkv, capacity, D), which hold positions 0 .. lengths[s] - 1
// (the segment's queries in q (B, Hq, N, D) are the last rows[s] of them; causal,
// the last `window` keys when window > 0), then over every row h = x + attn_rows @
// o.T (each position's heads side by side) and h + down(silu(g) * u) for [g | u] =
// rms_norm(h, norm_weight, eps) @ gate_up.T (gate_up: the gate rows, then the up
// rows) -> (B, N, H) float32.
mx::array attention_mlp(const mx::array& q, const std::vector<mx::array>& keys,
                        const std::vector<mx::array>& values, const std::vector<int64_t>& lengths,
                        const std::vector<int64_t>& rows, float scale, int64_t window,
                        const mx::array& x, const mx::array& norm_weight, float eps,
                        const WeightArg& o, const WeightArg& gate_up, const WeightArg& down,
                        mx::StreamOrDevice s = {});

}  // namespace arbor

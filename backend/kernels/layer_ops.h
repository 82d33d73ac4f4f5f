// Fused few-row forward blocks of a Llama-style decoder layer as MLX CPU
// primitives (layer_ops.cpp). A weight is a list of arrays with its bits: 0 for
// a dense matrix (one float32 / bfloat16 / float16 array), 4 or 8 for MLX's
// affine layout (wq, float32 scales, float32 biases; group_size 32/64/128).
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace arbor {
namespace mx = mlx::core;

// x (B, N, H) float32 -> [q (B, heads, N, D), k (B, kv_heads, N, D), v (B, kv_heads, N, D)]:
// rms_norm(x, norm_weight, eps) @ qkv.T (qkv: the q, k and v rows stacked), split by
// heads, q and k rotated (non-traditional RoPE of the first rope_dims of each head,
// positions offset + t, angle i = (position * rope_scale) * inv_freqs[i]).
std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight,
                                        float eps, const std::vector<mx::array>& qkv, int bits,
                                        int group_size, int heads, int kv_heads, int head_dim,
                                        int rope_dims, int64_t offset, float rope_scale,
                                        const mx::array& inv_freqs, mx::StreamOrDevice s = {});

// h = x + attn_rows @ o.T (attn (B, Hq, N, D): each position's heads side by side), then
// h + down(silu(g) * u) for [g | u] = rms_norm(h, norm_weight, eps) @ gate_up.T
// (gate_up: the gate rows, then the up rows) -> (B, N, H) float32.
mx::array mlp_block(const mx::array& attn, const mx::array& x, const mx::array& norm_weight,
                    float eps, const std::vector<mx::array>& o, int o_bits, int o_group,
                    const std::vector<mx::array>& gate_up, int gate_up_bits, int gate_up_group,
                    const std::vector<mx::array>& down, int down_bits, int down_group,
                    mx::StreamOrDevice s = {});

}  // namespace arbor

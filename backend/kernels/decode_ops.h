// Decode-time attention, RMS norm and RoPE as MLX CPU primitives (decode_ops.cpp).
#pragma once

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace arbor {
namespace mx = mlx::core;

// softmax(scale * q k^T [causal, aligned to the last key; only the last
// `window` keys of each query when window > 0]) v for float32
// q (B, Hq, M, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv) -> (B, Hq, M, Dv).
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    bool causal, int64_t window = 0, mx::StreamOrDevice s = {});

// Causal softmax over the last axis of float32 scores (..., M, L): query m of the
// M sees keys 0 .. L - M + m (the last `window` of them when window > 0), others 0.
mx::array causal_softmax(const mx::array& x, int64_t window = 0, mx::StreamOrDevice s = {});

// mx.fast.rms_norm for float32 x (..., H) and weight (H,) or none.
mx::array rms_norm(const mx::array& x, const mx::array* weight, float eps,
                   mx::StreamOrDevice s = {});

// mx.fast.rope (non-traditional) for float32 x (N0, N1, T, D) at an integer
// offset, with inverse frequencies inv_freqs (dims / 2,) float32.
mx::array rope(const mx::array& x, int dims, int64_t offset, float scale,
               const mx::array& inv_freqs, mx::StreamOrDevice s = {});

// silu(g) * u for float32 g and u of the same shape.
mx::array silu_mul(const mx::array& g, const mx::array& u, mx::StreamOrDevice s = {});

}  // namespace arbor

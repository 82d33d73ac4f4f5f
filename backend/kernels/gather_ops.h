// Matrix-vector products that pick one matrix of a stack per row (gather_ops.cpp): the
// decode-time products of stacked MoE experts (a row per token and expert) and of per-head
// matrices (a row per token and head, e.g. multi-head latent attention's absorbed projections).
#pragma once

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace arbor {
namespace mx = mlx::core;

// out (..., N) float32: row r of x (..., K) float32 times the transpose of matrix indices[r]
// of w (E, N, K) float32 / bfloat16 / float16; indices int32 or uint32 of x's leading shape.
// Rows that pick the same matrix share one pass over it; every row is reduced as a one-row
// matvec would reduce it, whatever else the call holds (row invariance). A row whose index
// is outside [0, E) gives zeros.
mx::array gather_matvec(const mx::array& x, const mx::array& w, const mx::array& indices,
                        mx::StreamOrDevice s = {});

// The same for w in MLX's affine layout: wq uint32 (E, N, K * bits / 32), float32 scales and
// biases (E, N, K / group_size); bits 4 or 8, group_size 32, 64 or 128.
mx::array gather_matvec_q(const mx::array& x, const mx::array& wq, const mx::array& scales,
                          const mx::array& biases, const mx::array& indices, int group_size,
                          int bits, mx::StreamOrDevice s = {});

}  // namespace arbor

// Attention scores: float32 query rows against many short weight rows (the keys, K the head
// size), for an ISA whose V (see kernels_impl.h, included before this file) also provides
//   sums(s)         for W vectors s: lane i = V::sum(s[i])
//   store(p, v)     W floats to p
//   KEY_HELD_MAX    the largest K (1, 2 or 4 times U_F32 * W) whose query stays in registers
//
// dense_rows reduces each (x row, weight row) pair's partial vector to a float on its own. With
// K the head size (64 on AVX-512: four multiply-adds per pair) that reduction costs as much as
// the products. key_rows forms the same partial vectors (one chain per U-th vector of K, the
// chains added in order) for W weight rows, then reduces the W together: one
// transposed tree whose every lane takes the pairings of V::sum, so each output equals
// dense_rows' bit for bit and a row's scores still do not depend on the other rows
// (tests/test_decode_kernels.py holds it to matvec).

#define ARBOR_UNROLL _Pragma("GCC unroll 16")

// dense_tile's partial vector of x . w before V::sum (ROWS = MT = 1, U = V::U_F32), for
// K = CHUNKS * U * W exactly, x already in registers.
template <int CHUNKS>
inline typename V::R partial_dot_held(const typename V::R (&x)[CHUNKS * V::U_F32],
                                      const float* w) {
  constexpr int U = V::U_F32;
  typename V::R acc[U];
  ARBOR_UNROLL for (int u = 0; u < U; ++u)
    acc[u] = V::fma(V::load(w + u * V::W), x[u], V::zero());
  ARBOR_UNROLL for (int c = 1; c < CHUNKS; ++c)
    ARBOR_UNROLL for (int u = 0; u < U; ++u)
      acc[u] = V::fma(V::load(w + (c * U + u) * V::W), x[c * U + u], acc[u]);
  typename V::R s = acc[0];
  ARBOR_UNROLL for (int u = 1; u < U; ++u) s = V::add(s, acc[u]);
  return s;
}

// W weight rows against every x row: out[m * ldo + 0 .. W - 1].
template <int CHUNKS>
inline void key_block_held(const float* x, int64_t ldx, int64_t M, const float* w, int64_t ldw,
                           float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    typename V::R xv[CHUNKS * V::U_F32];
    ARBOR_UNROLL for (int i = 0; i < CHUNKS * V::U_F32; ++i)
      xv[i] = V::load(x + m * ldx + i * V::W);
    typename V::R s[V::W];
    ARBOR_UNROLL for (int i = 0; i < V::W; ++i) s[i] = partial_dot_held<CHUNKS>(xv, w + i * ldw);
    V::store(out + m * ldo, V::sums(s));
  }
}

// Blocks of W weight rows (their W * K floats stay in L1 while every x row passes). Only for
// the head sizes whose query stays in registers: reloading it for every key made the blocks
// slower than dense_rows. Other sizes, and the last n1 - n0 mod W rows, go to dense_rows.
void key_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const void* wv, int64_t ldw,
              float* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int64_t CHUNK = V::U_F32 * V::W;
  const int64_t held = K % CHUNK == 0 && K <= V::KEY_HELD_MAX ? K / CHUNK : 0;
  if (held != 1 && held != 2 && held != 4) {
    dense_rows<float>(x, ldx, M, K, wv, ldw, out, ldo, n0, n1);
    return;
  }
  const float* w = static_cast<const float*>(wv);
  int64_t n = n0;
  for (; n + V::W <= n1; n += V::W) {
    if (held == 1) key_block_held<1>(x, ldx, M, w + n * ldw, ldw, out + n, ldo);
    else if (held == 2) key_block_held<2>(x, ldx, M, w + n * ldw, ldw, out + n, ldo);
    else key_block_held<4>(x, ldx, M, w + n * ldw, ldw, out + n, ldo);
  }
  if (n < n1) dense_rows<float>(x, ldx, M, K, wv, ldw, out, ldo, n, n1);
}

#undef ARBOR_UNROLL

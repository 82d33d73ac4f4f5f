// AVX-512 (F) + FMA instantiation of the Arbor matvec kernels.
// Built with -mavx512f -mavx2 -mfma -mf16c; only called after a CPUID check.
#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__)
#include <immintrin.h>

#include <cmath>

namespace {

struct V {
  using R = __m512;
  static constexpr int W = 16;
  static constexpr int MT_F32 = 4;
  static constexpr int U_F32 = 4;
  static constexpr int MT_Q = 2;
  // From 12 x rows, dense tiles of 4 weight rows (32 registers hold their 16 accumulators;
  // at 8 rows the prefetched one-row tiles were as fast).
  static constexpr int WIDE_M = 12;
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R load(const float* p) { return _mm512_loadu_ps(p); }
  static inline R load_n(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static inline R set1(float f) { return _mm512_set1_ps(f); }

  // Dense weights: float32 as is; bfloat16 is the top half of a float32; float16
  // through vcvtph2ps. Tails go through a zeroed buffer (no AVX-512BW needed).
  static inline R wload(const float* p) { return load(p); }
  static inline R wload_n(const float* p, int n) { return load_n(p, n); }
  static inline R wload(const arbor::bf16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline R wload(const arbor::f16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  template <typename T>
  static inline R wload_n(const T* p, int n) {
    T buf[W] = {};
    for (int i = 0; i < n; ++i) buf[i] = p[i];
    return wload(buf);
  }
  static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  // The halving tree of GCC's _mm512_reduce_add_ps, written out so that key_rows, which
  // runs the same tree over 16 vectors at once, matches it whatever the compiler.
  static inline float sum(R a) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    const __m256 half = _mm256_add_ps(hi, _mm512_castps512_ps256(a));
    const __m128 quarter =
        _mm_add_ps(_mm256_extractf128_ps(half, 1), _mm256_castps256_ps128(half));
    const __m128 pairs = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, 1));
  }
  static inline R q8raw(const uint8_t* p) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  }
  // 4 bits: the 16 possible values looked up by vpermps, which reads only the low 4
  // bits of each index (no masking needed).
  static inline void q4raw(const uint8_t* p, R& lo, R& hi) {
    const R values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m512i v = _mm512_cvtepu8_epi32(b);
    lo = _mm512_permutexvar_ps(v, values);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
  }
};

#include "kernels_impl.h"
#include "kernels_q4x8.h"

// -- attention scores ---------------------------------------------------------------------------
// dense_rows reduces each (x row, weight row) pair's partial vector to a float on its own. With
// K the head size (64: four multiply-adds per pair) that reduction costs as much as the
// products. key_rows forms the same partial vectors (one chain per U-th vector of K, tails
// into the first, added in order) for 16 weight rows, then reduces the 16 together: one
// transposed tree whose every lane takes the pairings of V::sum, so each output equals
// dense_rows' bit for bit and a row's scores still do not depend on the other rows.

#define ARBOR_UNROLL _Pragma("GCC unroll 16")

// Lane i = V::sum(s[i]).
inline __m512 sum16(const __m512 (&s)[16]) {
  __m512 halves[8], quarters[4], eighths[2];
  ARBOR_UNROLL for (int i = 0; i < 8; ++i)  // lanes 0-7: s[2i]'s halves added; 8-15: s[2i+1]'s
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xEE),
                              _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44));
  ARBOR_UNROLL for (int i = 0; i < 4; ++i)  // 128-bit lane j: s[4i + j]'s quarters added
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88));
  ARBOR_UNROLL for (int i = 0; i < 2; ++i)  // lane j: pairs of s[8i + j], then of s[8i + 4 + j]
    eighths[i] = _mm512_add_ps(
        _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Position 4j + c now holds s[j + 4c]'s sum; put s[i]'s at i.
  const __m512 sums = _mm512_add_ps(
      _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
      _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// dense_tile's partial vector of x . w before V::sum (ROWS = MT = 1, U = V::U_F32).
inline __m512 partial_dot(const float* x, const float* w, int64_t K) {
  constexpr int U = V::U_F32;
  __m512 acc[U];
  ARBOR_UNROLL for (int u = 0; u < U; ++u) acc[u] = V::zero();
  int64_t k = 0;
  for (; k + U * V::W <= K; k += U * V::W)
    ARBOR_UNROLL for (int u = 0; u < U; ++u)
      acc[u] = V::fma(V::load(w + k + u * V::W), V::load(x + k + u * V::W), acc[u]);
  for (; k + V::W <= K; k += V::W) acc[0] = V::fma(V::load(w + k), V::load(x + k), acc[0]);
  if (k < K) {
    const int rest = static_cast<int>(K - k);
    acc[0] = V::fma(V::load_n(w + k, rest), V::load_n(x + k, rest), acc[0]);
  }
  __m512 s = acc[0];
  ARBOR_UNROLL for (int u = 1; u < U; ++u) s = V::add(s, acc[u]);
  return s;
}

// The same for K = CHUNKS * U * W exactly, x already in registers.
template <int CHUNKS>
inline __m512 partial_dot_held(const __m512 (&x)[CHUNKS * V::U_F32], const float* w) {
  constexpr int U = V::U_F32;
  __m512 acc[U];
  ARBOR_UNROLL for (int u = 0; u < U; ++u) acc[u] = V::fma(V::load(w + u * V::W), x[u], V::zero());
  ARBOR_UNROLL for (int c = 1; c < CHUNKS; ++c)
    ARBOR_UNROLL for (int u = 0; u < U; ++u)
      acc[u] = V::fma(V::load(w + (c * U + u) * V::W), x[c * U + u], acc[u]);
  __m512 s = acc[0];
  ARBOR_UNROLL for (int u = 1; u < U; ++u) s = V::add(s, acc[u]);
  return s;
}

template <int CHUNKS>
inline void key_block_held(const float* x, int64_t ldx, int64_t M, const float* w, int64_t ldw,
                           float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    __m512 xv[CHUNKS * V::U_F32];
    ARBOR_UNROLL for (int i = 0; i < CHUNKS * V::U_F32; ++i) xv[i] = V::load(x + m * ldx + i * V::W);
    __m512 s[16];
    ARBOR_UNROLL for (int i = 0; i < 16; ++i) s[i] = partial_dot_held<CHUNKS>(xv, w + i * ldw);
    _mm512_storeu_ps(out + m * ldo, sum16(s));
  }
}

inline void key_block(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                      int64_t ldw, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    __m512 s[16];
    ARBOR_UNROLL for (int i = 0; i < 16; ++i) s[i] = partial_dot(x + m * ldx, w + i * ldw, K);
    _mm512_storeu_ps(out + m * ldo, sum16(s));
  }
}

// Blocks of 16 weight rows (their 16 * K floats stay in L1 while every x row passes); the last
// n1 - n0 mod 16 rows through dense_rows.
void key_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const void* wv, int64_t ldw,
              float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const float* w = static_cast<const float*>(wv);
  constexpr int64_t CHUNK = V::U_F32 * V::W;
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    if (K == CHUNK)
      key_block_held<1>(x, ldx, M, w + n * ldw, ldw, out + n, ldo);
    else if (K == 2 * CHUNK)
      key_block_held<2>(x, ldx, M, w + n * ldw, ldw, out + n, ldo);
    else
      key_block(x, ldx, M, K, w + n * ldw, ldw, out + n, ldo);
  }
  if (n < n1) dense_rows<float>(x, ldx, M, K, wv, ldw, out, ldo, n, n1);
}

#undef ARBOR_UNROLL

}  // namespace

namespace arbor {
const IsaKernels& isa_avx512() {
  static const IsaKernels k{"avx512", 2 * V::W, ARBOR_DENSE_ROWS, &key_rows, &q_rows, &q4x8_rows};
  return k;
}
}  // namespace arbor

#elif defined(__x86_64__)
namespace arbor {
const IsaKernels& isa_avx512() { return isa_generic(); }
}  // namespace arbor
#endif

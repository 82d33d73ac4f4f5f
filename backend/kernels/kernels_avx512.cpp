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
  // Panel tiles (kernels_panels.h): 8 x rows, 16 accumulator registers (8 rows x 2 panels).
  static constexpr int PANEL_MT = 8;
  static constexpr int PANEL_ACC = 16;
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R load(const float* p) { return _mm512_loadu_ps(p); }
  static inline R load_n(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static inline R set1(float f) { return _mm512_set1_ps(f); }
  static inline void store(float* p, R v) { _mm512_storeu_ps(p, v); }

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
  // Lane i = sum(s[i]) for 16 vectors: sum's tree run on all 16 at once (kernels_keys.h).
  static inline R sums(const R (&s)[W]) {
    R halves[8], quarters[4], eighths[2];
    for (int i = 0; i < 8; ++i)  // lanes 0-7: s[2i]'s halves added; 8-15: s[2i+1]'s
      halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xEE),
                                _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44));
    for (int i = 0; i < 4; ++i)  // 128-bit lane j: s[4i + j]'s quarters added
      quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD),
                                  _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88));
    for (int i = 0; i < 2; ++i)  // lane j: pairs of s[8i + j], then of s[8i + 4 + j]
      eighths[i] = _mm512_add_ps(
          _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
          _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // Position 4j + c now holds s[j + 4c]'s sum; put s[i]'s at i.
    const R sums = _mm512_add_ps(
        _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, sums);
  }
  // Head sizes whose query key_rows holds in registers (multiples of U_F32 * W = 64).
  static constexpr int KEY_HELD_MAX = 128;
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
#include "kernels_panels.h"

#include "kernels_keys.h"

}  // namespace

namespace arbor {
const IsaKernels& isa_avx512() {
  static const IsaKernels k{"avx512", 2 * V::W, ARBOR_DENSE_ROWS, &key_rows, &q_rows, &q4x8_rows,
                            &panel_rows};
  return k;
}
}  // namespace arbor

#elif defined(__x86_64__)
namespace arbor {
const IsaKernels& isa_avx512() { return isa_generic(); }
}  // namespace arbor
#endif

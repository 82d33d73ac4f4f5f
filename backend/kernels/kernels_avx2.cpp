// AVX2 + FMA + F16C instantiation of the Arbor matvec kernels.
// Built with -mavx2 -mfma -mf16c; only called after a CPUID check.
#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cmath>

namespace {

struct V {
  using R = __m256;
  static constexpr int W = 8;
  // Dense tiles of up to 4 x rows with 2 accumulators each (+ x + w: 10 of the 16
  // registers). Two chains of FMAs still outrun one thread's share of memory bandwidth
  // for one row, and a 3- or 4-row verify block makes one pass over each weight row
  // instead of two (measured: 4 rows 30 against 32-34 ms per 538 MB, 1 row unchanged).
  static constexpr int MT_F32 = 4;
  static constexpr int U_F32 = 2;
  static constexpr int MT_Q = 2;  // two x rows share each pass over a weight row
  // No wide dense tiles: 16 registers cannot hold their 16 accumulators, and with
  // prefetching the one-row tiles do as well at 8-16 rows (measured).
  static constexpr int WIDE_M = 0;
  // Panel tiles (kernels_panels.h): a panel is two registers; 4 x rows x 1 panel (or 1 row x
  // 4 panels) fill 8 accumulators, leaving room for the weights and the broadcast x.
  static constexpr int PANEL_MT = 4;
  static constexpr int PANEL_ACC = 8;
  static inline R zero() { return _mm256_setzero_ps(); }
  static inline R load(const float* p) { return _mm256_loadu_ps(p); }
  static inline R load_n(const float* p, int n) {
    alignas(32) static const int mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                             0,  0,  0,  0,  0,  0,  0,  0};
    __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask + 8 - n));
    return _mm256_maskload_ps(p, m);
  }
  static inline R set1(float f) { return _mm256_set1_ps(f); }
  static inline void store(float* p, R v) { _mm256_storeu_ps(p, v); }

  // Dense weights: float32 as is; bfloat16 is the top half of a float32; float16
  // through vcvtph2ps (F16C). Tails go through a zeroed buffer.
  static inline R wload(const float* p) { return load(p); }
  static inline R wload_n(const float* p, int n) { return load_n(p, n); }
  static inline R wload(const arbor::bf16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline R wload(const arbor::f16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  template <typename T>
  static inline R wload_n(const T* p, int n) {
    T buf[W] = {};
    for (int i = 0; i < n; ++i) buf[i] = p[i];
    return wload(buf);
  }
  static inline R add(R a, R b) { return _mm256_add_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float sum(R a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Lane i = sum(s[i]) for 8 vectors: sum's tree run on all 8 at once (kernels_keys.h).
  static inline R sums(const R (&s)[W]) {
    R halves[4], quarters[2];
    for (int i = 0; i < 4; ++i)  // lanes 0-3: s[2i]'s halves added; 4-7: s[2i+1]'s
      halves[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31),
                                _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20));
    for (int i = 0; i < 2; ++i)  // 128-bit half h: pairs of s[4i + h], then of s[4i + 2 + h]
      quarters[i] = _mm256_add_ps(
          _mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
          _mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // Half h, position c now holds s[2c + h]'s sum; put s[i]'s at i.
    const R sums = _mm256_add_ps(
        _mm256_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm256_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  // At K = 64 the query takes 8 of the 16 registers and some partial vectors spill; still
  // 1.4-1.7x dense_rows (this AVX2 code on an AVX-512 EPYC). K = 128 would take them all.
  static constexpr int KEY_HELD_MAX = 64;
  static inline R q8raw(const uint8_t* p) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  }
  static inline void q4raw(const uint8_t* p, R& lo, R& hi) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    __m256i v = _mm256_cvtepu8_epi32(b);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
};

#include "kernels_impl.h"
#include "kernels_keys.h"
#include "kernels_q4x8.h"
#include "kernels_panels.h"

}  // namespace

namespace arbor {
const IsaKernels& isa_avx2() {
  static const IsaKernels k{"avx2", 2 * V::W, ARBOR_DENSE_ROWS, &key_rows, &q_rows, &q4x8_rows,
                            &panel_rows};
  return k;
}
}  // namespace arbor

#elif defined(__x86_64__)
namespace arbor {
const IsaKernels& isa_avx2() { return isa_generic(); }
}  // namespace arbor
#endif

// AVX-512 (F) + FMA instantiation of the Arbor matvec kernels.
// Built with -mavx512f -mavx2 -mfma; only called after a CPUID check.
#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

struct V {
  using R = __m512;
  static constexpr int W = 16;
  static constexpr int MT_F32 = 4;
  static constexpr int MT_Q = 2;
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R load(const float* p) { return _mm512_loadu_ps(p); }
  static inline R load_n(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static inline R set1(float f) { return _mm512_set1_ps(f); }
  static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float sum(R a) { return _mm512_reduce_add_ps(a); }
  static inline R u8(const uint8_t* p) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  }
  static inline void u4(const uint8_t* p, R& lo, R& hi) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m512i v = _mm512_cvtepu8_epi32(b);
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
};

#include "kernels_impl.h"

}  // namespace

namespace arbor {
const IsaKernels& isa_avx512() {
  static const IsaKernels k{"avx512", 2 * V::W, &f32_rows, &q_rows};
  return k;
}
}  // namespace arbor

#elif defined(__x86_64__)
namespace arbor {
const IsaKernels& isa_avx512() { return isa_generic(); }
}  // namespace arbor
#endif

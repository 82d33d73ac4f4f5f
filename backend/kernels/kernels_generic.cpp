// Portable scalar instantiation of the Arbor matvec kernels (any CPU).
#include "kernels.h"

namespace {

struct V {
  using R = float;
  static constexpr int W = 1;
  static constexpr int MT_F32 = 4;
  static constexpr int MT_Q = 2;
  static inline R zero() { return 0.0f; }
  static inline R load(const float* p) { return *p; }
  static inline R load_n(const float* p, int n) { return n > 0 ? *p : 0.0f; }
  static inline R set1(float f) { return f; }

  static inline float from_bits(uint32_t u) {
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
  }
  static inline R wload(const float* p) { return *p; }
  static inline R wload(const arbor::bf16_t* p) { return from_bits(uint32_t(p->bits) << 16); }
  static inline R wload(const arbor::f16_t* p) {
    const uint32_t h = p->bits, sign = (h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return from_bits(sign | 0x7f800000u | (mant << 13));  // inf, nan
    if (exp == 0) {
      if (mant == 0) return from_bits(sign);
      exp = 113;  // subnormal: renormalise
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      return from_bits(sign | (exp << 23) | ((mant & 0x3ffu) << 13));
    }
    return from_bits(sign | ((exp + 112) << 23) | (mant << 13));
  }
  template <typename T>
  static inline R wload_n(const T* p, int n) { return n > 0 ? wload(p) : 0.0f; }
  static inline R add(R a, R b) { return a + b; }
  static inline R fma(R a, R b, R c) { return a * b + c; }
  static inline float sum(R a) { return a; }
  static inline R q8raw(const uint8_t* p) { return static_cast<float>(*p); }
  // One byte holds two consecutive 4-bit values: low nibble first.
  static inline void q4raw(const uint8_t* p, R& lo, R& hi) {
    lo = static_cast<float>(*p & 15);
    hi = static_cast<float>(*p >> 4);
  }
};

#include "kernels_impl.h"

}  // namespace

namespace arbor {
const IsaKernels& isa_generic() {
  // A 2-value block split into (even, odd) is the natural order: no permutation.
  static const IsaKernels k{"generic", 0, ARBOR_DENSE_ROWS, &q_rows};
  return k;
}
}  // namespace arbor

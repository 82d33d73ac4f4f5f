// Portable scalar instantiation of the Arbor matvec kernels (any CPU).
#include "kernels.h"

namespace {

struct V {
  using R = float;
  static constexpr int W = 1;
  static constexpr int MT_F32 = 4;
  static constexpr int U_F32 = 4;
  static constexpr int MT_Q = 2;
  static constexpr int WIDE_M = 0;
  static constexpr int PANEL_MT = 1;
  static constexpr int PANEL_ACC = 16;  // one panel: 16 scalar chains
  static inline R zero() { return 0.0f; }
  static inline R load(const float* p) { return *p; }
  static inline R load_n(const float* p, int n) { return n > 0 ? *p : 0.0f; }
  static inline R set1(float f) { return f; }
  static inline void store(float* p, R v) { *p = v; }

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
#include "kernels_panels.h"

// 4-bit weights against int8 inputs (see kernels_q4x8.h for the layout): each block's
// integer sum exactly, then its two scales in float32.
void q4x8_rows(const arbor::QuantizedInputs& in, const uint8_t* wq, int64_t ldq,
               const float* scales, const float* biases, int64_t ldsb, int gs, float* out,
               int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t K = in.K, blocks = K / 64, groups = K / gs, per_group = gs / 64;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = wq + n * ldq;
    for (int64_t m = 0; m < in.M; ++m) {
      float acc = 0.0f, bias_acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const float ws = scales[n * ldsb + g];
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
          const int8_t* xb = in.q + m * K + b * 64;
          const uint8_t* wb = w + b * 32;
          int32_t sum = 0;
          for (int i = 0; i < 32; ++i) sum += (wb[i] & 15) * xb[i] + (wb[i] >> 4) * xb[32 + i];
          acc += static_cast<float>(sum) * (ws * in.scale[m * blocks + b]);
        }
        bias_acc += biases[n * ldsb + g] * in.group_sum[m * groups + g];
      }
      out[m * ldo + n] = acc + bias_acc;
    }
  }
}

}  // namespace

namespace arbor {
const IsaKernels& isa_generic() {
  // A 2-value block split into (even, odd) is the natural order: no permutation.
  static const IsaKernels k{"generic", 0, ARBOR_DENSE_ROWS, &dense_rows<float>, &q_rows, &q4x8_rows,
                            &panel_rows};
  return k;
}
}  // namespace arbor

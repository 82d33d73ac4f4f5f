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
  static inline R add(R a, R b) { return a + b; }
  static inline R fma(R a, R b, R c) { return a * b + c; }
  static inline float sum(R a) { return a; }
  static inline R u8(const uint8_t* p) { return static_cast<float>(*p); }
  // One byte holds two consecutive 4-bit values: low nibble first.
  static inline void u4(const uint8_t* p, R& lo, R& hi) {
    lo = static_cast<float>(*p & 15);
    hi = static_cast<float>(*p >> 4);
  }
};

#include "kernels_impl.h"

}  // namespace

namespace arbor {
const IsaKernels& isa_generic() {
  // A 2-value block split into (even, odd) is the natural order: no permutation.
  static const IsaKernels k{"generic", 0, &f32_rows, &q_rows};
  return k;
}
}  // namespace arbor

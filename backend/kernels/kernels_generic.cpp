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
  template <int BITS>
  struct QGroup {
    float scale, bias;
  };
  template <int BITS>
  static inline QGroup<BITS> qgroup(float scale, float bias) {
    return {scale, bias};
  }
  static inline R q8(const uint8_t* p, const QGroup<8>& g) {
    return g.scale * static_cast<float>(*p) + g.bias;
  }
  // One byte holds two consecutive 4-bit values: low nibble first.
  static inline void q4(const uint8_t* p, const QGroup<4>& g, R& lo, R& hi) {
    lo = g.scale * static_cast<float>(*p & 15) + g.bias;
    hi = g.scale * static_cast<float>(*p >> 4) + g.bias;
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

// 4-bit weights against int8 inputs, AVX2: included inside an anonymous namespace by
// kernels_avx2.cpp and kernels_avx512.cpp (both built with -mavx2), so each has its own copy.
//
// x comes quantized by quantize_inputs (kernels.cpp): per block of 64 values one scale
// (max |x| / 127) and int8 values, the block's 32 even-indexed values first and then its 32
// odd ones, the order in which one 32-byte load of packed weights splits into its low and
// high nibbles. vpmaddubsw multiplies the unsigned nibbles by the signed inputs and adds
// neighbouring pairs (at most 2 * 15 * 127: no saturation), vpmaddwd widens to int32, so a
// block's sum of q * x is exact in integers; it meets the weight group's scale and the block's
// input scale once, in float32, and the group's bias meets the exact float sum of x.

// Every tile shape runs the same operations per (weight row, x row), the bias sum as an
// explicit fma (the compiler would contract a * b + c in some tiles and not others), so a
// row's result does not depend on how many rows come with it.
#define ARBOR_UNROLL_Q8 _Pragma("GCC unroll 8")

// ROWS weight rows against x rows m0 .. m0 + MT, weight groups of PG blocks of 64.
template <int ROWS, int MT, int PG>
inline void q4x8_tile(const arbor::QuantizedInputs& in, int64_t m0, const uint8_t* wq, int64_t ldq,
                      const float* scales, const float* biases, int64_t ldsb, float* out,
                      int64_t ldo) {
  const int64_t K = in.K, blocks = K / 64, groups = blocks / PG;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* xq[MT];
  const float *xscale[MT], *xsum[MT];
  ARBOR_UNROLL_Q8 for (int m = 0; m < MT; ++m) {
    xq[m] = in.q + (m0 + m) * K;
    xscale[m] = in.scale + (m0 + m) * blocks;
    xsum[m] = in.group_sum + (m0 + m) * groups;
  }
  __m256 acc[ROWS][MT];
  float bias_acc[ROWS][MT];
  ARBOR_UNROLL_Q8 for (int r = 0; r < ROWS; ++r)
    ARBOR_UNROLL_Q8 for (int m = 0; m < MT; ++m) {
      acc[r][m] = _mm256_setzero_ps();
      bias_acc[r][m] = 0.0f;
    }
  for (int64_t g = 0; g < groups; ++g) {
    ARBOR_UNROLL_Q8 for (int j = 0; j < PG; ++j) {
      const int64_t b = g * PG + j;
      __m256i xe[MT], xo[MT];
      __m256 xs[MT];
      ARBOR_UNROLL_Q8 for (int m = 0; m < MT; ++m) {
        xe[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * 64));
        xo[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * 64 + 32));
        xs[m] = _mm256_broadcast_ss(xscale[m] + b);
      }
      ARBOR_UNROLL_Q8 for (int r = 0; r < ROWS; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + r * ldq + b * 32));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        const __m256 ws = _mm256_broadcast_ss(scales + r * ldsb + g);
        ARBOR_UNROLL_Q8 for (int m = 0; m < MT; ++m) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe[m]),
                                                 _mm256_maddubs_epi16(hi, xo[m]));
          const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
          acc[r][m] = _mm256_fmadd_ps(sums, _mm256_mul_ps(ws, xs[m]), acc[r][m]);
        }
      }
    }
    ARBOR_UNROLL_Q8 for (int r = 0; r < ROWS; ++r)
      ARBOR_UNROLL_Q8 for (int m = 0; m < MT; ++m)
        bias_acc[r][m] = std::fma(biases[r * ldsb + g], xsum[m][g], bias_acc[r][m]);
  }
  ARBOR_UNROLL_Q8 for (int r = 0; r < ROWS; ++r)
    ARBOR_UNROLL_Q8 for (int m = 0; m < MT; ++m) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][m]), _mm256_extractf128_ps(acc[r][m], 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      out[(m0 + m) * ldo + r] = _mm_cvtss_f32(s) + bias_acc[r][m];
    }
}

// Weight rows n0 .. n1 against every x row: one x row in tiles of 4 weight rows; more in
// 2 x 2 tiles (a 4 x 2 tile's accumulators and inputs would not fit the 16 registers).
template <int ROWS, int PG>
inline void q4x8_rows_of(const arbor::QuantizedInputs& in, const uint8_t* wq, int64_t ldq,
                         const float* scales, const float* biases, int64_t ldsb, float* out,
                         int64_t ldo, int64_t n) {
  wq += n * ldq;
  scales += n * ldsb;
  biases += n * ldsb;
  out += n;
  int64_t m = 0;
  if constexpr (ROWS <= 2)
    for (; m + 2 <= in.M; m += 2)
      q4x8_tile<ROWS, 2, PG>(in, m, wq, ldq, scales, biases, ldsb, out, ldo);
  for (; m < in.M; ++m) q4x8_tile<ROWS, 1, PG>(in, m, wq, ldq, scales, biases, ldsb, out, ldo);
}

template <int PG>
void q4x8_rows_pg(const arbor::QuantizedInputs& in, const uint8_t* wq, int64_t ldq,
                  const float* scales, const float* biases, int64_t ldsb, float* out, int64_t ldo,
                  int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (in.M == 1)
    for (; n + 4 <= n1; n += 4)
      q4x8_rows_of<4, PG>(in, wq, ldq, scales, biases, ldsb, out, ldo, n);
  for (; n + 2 <= n1; n += 2) q4x8_rows_of<2, PG>(in, wq, ldq, scales, biases, ldsb, out, ldo, n);
  for (; n < n1; ++n) q4x8_rows_of<1, PG>(in, wq, ldq, scales, biases, ldsb, out, ldo, n);
}

void q4x8_rows(const arbor::QuantizedInputs& in, const uint8_t* wq, int64_t ldq,
               const float* scales, const float* biases, int64_t ldsb, int gs, float* out,
               int64_t ldo, int64_t n0, int64_t n1) {
  if (gs == 64)
    q4x8_rows_pg<1>(in, wq, ldq, scales, biases, ldsb, out, ldo, n0, n1);
  else  // 128
    q4x8_rows_pg<2>(in, wq, ldq, scales, biases, ldsb, out, ldo, n0, n1);
}

#undef ARBOR_UNROLL_Q8

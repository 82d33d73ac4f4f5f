// Arbor matvec kernels, written once against a small vector-traits struct `V`.
//
// Each ISA translation unit (kernels_avx512.cpp, kernels_avx2.cpp,
// kernels_generic.cpp) defines `V` inside an anonymous namespace and then
// includes this file there, so every instantiation has internal linkage and
// code compiled for one ISA can never be picked up by another TU. Keep this
// file free of std:: templates for the same reason.
//
// V must provide:
//   using R;               vector register type
//   W;                     float lanes per register
//   MT_F32, MT_Q;          most x rows handled per tile (register budget)
//   WIDE_M;                from this many x rows, dense tiles of WIDE_ROWS weight rows (0: never)
//   U_F32;                 accumulators per (weight row, x row) along K in dense tiles
//   zero(), load(p), load_n(p, n) (first n lanes, rest 0), set1(f),
//   fma(a, b, c) = a * b + c, sum(a) (horizontal add),
//   wload(p), wload_n(p, n) for p a float*, bf16_t* or f16_t* (widened to float),
//   add(a, b),
//   q8raw(p)               W bytes -> W floats (the quantized values, not yet scaled)
//   q4raw(p, lo, hi)       W bytes -> low nibbles as floats in lo, high ones in hi

#define ARBOR_UNROLL _Pragma("GCC unroll 16")

template <typename WT, int ROWS, int MT, int U>
inline void dense_tile(
    const float* x, int64_t ldx, int64_t K, const WT* w, int64_t ldw,
    float* out, int64_t ldo) {
  typename V::R acc[U][ROWS][MT];
  ARBOR_UNROLL for (int u = 0; u < U; ++u)
    ARBOR_UNROLL for (int r = 0; r < ROWS; ++r)
      ARBOR_UNROLL for (int m = 0; m < MT; ++m) acc[u][r][m] = V::zero();

  int64_t k = 0;
  for (; k + U * V::W <= K; k += U * V::W) {
    ARBOR_UNROLL for (int u = 0; u < U; ++u) {
      typename V::R xv[MT];
      ARBOR_UNROLL for (int m = 0; m < MT; ++m)
        xv[m] = V::load(x + m * ldx + k + u * V::W);
      ARBOR_UNROLL for (int r = 0; r < ROWS; ++r) {
        typename V::R wv = V::wload(w + r * ldw + k + u * V::W);
        ARBOR_UNROLL for (int m = 0; m < MT; ++m)
          acc[u][r][m] = V::fma(wv, xv[m], acc[u][r][m]);
      }
    }
  }
  for (; k + V::W <= K; k += V::W) {
    typename V::R xv[MT];
    ARBOR_UNROLL for (int m = 0; m < MT; ++m) xv[m] = V::load(x + m * ldx + k);
    ARBOR_UNROLL for (int r = 0; r < ROWS; ++r) {
      typename V::R wv = V::wload(w + r * ldw + k);
      ARBOR_UNROLL for (int m = 0; m < MT; ++m)
        acc[0][r][m] = V::fma(wv, xv[m], acc[0][r][m]);
    }
  }
  if (k < K) {
    const int rest = static_cast<int>(K - k);
    typename V::R xv[MT];
    ARBOR_UNROLL for (int m = 0; m < MT; ++m) xv[m] = V::load_n(x + m * ldx + k, rest);
    ARBOR_UNROLL for (int r = 0; r < ROWS; ++r) {
      typename V::R wv = V::wload_n(w + r * ldw + k, rest);
      ARBOR_UNROLL for (int m = 0; m < MT; ++m)
        acc[0][r][m] = V::fma(wv, xv[m], acc[0][r][m]);
    }
  }
  ARBOR_UNROLL for (int r = 0; r < ROWS; ++r)
    ARBOR_UNROLL for (int m = 0; m < MT; ++m) {
      typename V::R s = acc[0][r][m];
      ARBOR_UNROLL for (int u = 1; u < U; ++u) s = V::add(s, acc[u][r][m]);
      out[m * ldo + r] = V::sum(s);
    }
}

// All x rows against one weight row, in tiles of at most V::MT_F32 x rows, each
// row with U = V::U_F32 accumulators along K. Every x row is reduced in the same order
// whatever M is and wherever it sits in its tile, so a product of M rows equals,
// bit for bit, M one-row products: a verify block of draft tokens gives exactly
// the logits of one-token decode steps (tests/test_kernels.py pins it).
template <typename WT>
inline void dense_rows_x(
    const float* x, int64_t ldx, int64_t M, int64_t K, const WT* w, float* out, int64_t ldo) {
  constexpr int U = V::U_F32;
  int64_t m = 0;
  for (; m + V::MT_F32 <= M; m += V::MT_F32)
    dense_tile<WT, 1, V::MT_F32, U>(x + m * ldx, ldx, K, w, 0, out + m * ldo, ldo);
  switch (M - m) {
    case 1: dense_tile<WT, 1, 1, U>(x + m * ldx, ldx, K, w, 0, out + m * ldo, ldo); break;
    case 2: dense_tile<WT, 1, 2, U>(x + m * ldx, ldx, K, w, 0, out + m * ldo, ldo); break;
    case 3: dense_tile<WT, 1, 3, U>(x + m * ldx, ldx, K, w, 0, out + m * ldo, ldo); break;
    default: break;
  }
}

// With a few x rows a product stops being bound by memory alone: each weight row costs
// compute as well, and the hardware prefetcher, which follows one stream at the pace of
// its reads, no longer keeps the next rows on the way. From PREFETCH_MIN_M rows on, the
// weights PREFETCH_ROWS rows ahead are asked into L2 before each row (measured on a 2-core
// EPYC, 8 rows: 28 -> 38-44 GFMA/s over 1536x576 and 49152x576 float32 products).
constexpr int64_t PREFETCH_MIN_M = 3;  // kPrefetchMinM in kernels.cpp sizes the chunks alike
constexpr int64_t PREFETCH_ROWS = 16;

inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(c + at, 0, 1);
}

// Many x rows (from V::WIDE_M on; 0: never): tiles of WIDE_ROWS weight rows x up to
// MT_F32 x rows, so each loaded weight vector meets four x rows and each x vector four
// weight rows (one load per two FMAs instead of five per four). The accumulators
// that dense_tile keeps side by side (one per u, taking every U-th vector of K) are run
// one u after the other here, each its own chain in the same order as there, and added
// at the end as there: the outputs equal dense_tile's bit for bit, so a row's product
// does not depend on M (AVX-512, 16 rows: 30 -> 45-50 GFMA/s). While the first x rows
// run, the tile `ahead` (PREFETCH_ROWS rows on) is asked into L2, a few lines per step.
constexpr int WIDE_ROWS = 4;

template <typename WT, int MT>
inline void dense_wide_tile(
    const float* x, int64_t ldx, int64_t K, const WT* w, int64_t ldw, float* out,
    int64_t ldo, const char* ahead, int64_t ahead_bytes) {
  constexpr int U = V::U_F32, R = WIDE_ROWS;
  typename V::R part[U][R][MT];
  const int64_t main_end = K / (U * V::W) * (U * V::W);
  int64_t asked = 0;
  ARBOR_UNROLL for (int u = 0; u < U; ++u) {
    typename V::R acc[R][MT];
    ARBOR_UNROLL for (int r = 0; r < R; ++r)
      ARBOR_UNROLL for (int m = 0; m < MT; ++m) acc[r][m] = V::zero();
    auto step = [&](int64_t k, auto wload_at, auto xload_at) {
      typename V::R xv[MT];
      ARBOR_UNROLL for (int m = 0; m < MT; ++m) xv[m] = xload_at(x + m * ldx + k);
      ARBOR_UNROLL for (int r = 0; r < R; ++r) {
        const typename V::R wv = wload_at(w + r * ldw + k);
        ARBOR_UNROLL for (int m = 0; m < MT; ++m) acc[r][m] = V::fma(wv, xv[m], acc[r][m]);
      }
    };
    const auto wfull = [](const WT* p) { return V::wload(p); };
    const auto xfull = [](const float* p) { return V::load(p); };
    for (int64_t k = u * V::W; k < main_end; k += U * V::W) {
      if (asked < ahead_bytes) {
        ARBOR_UNROLL for (int i = 0; i < 4; ++i) __builtin_prefetch(ahead + asked + 64 * i, 0, 1);
        asked += 4 * 64;
      }
      step(k, wfull, xfull);
    }
    if (u == 0) {  // dense_tile's tails go to its first accumulator, after its main loop
      int64_t k = main_end;
      for (; k + V::W <= K; k += V::W) step(k, wfull, xfull);
      if (k < K) {
        const int rest = static_cast<int>(K - k);
        step(k, [rest](const WT* p) { return V::wload_n(p, rest); },
             [rest](const float* p) { return V::load_n(p, rest); });
      }
    }
    ARBOR_UNROLL for (int r = 0; r < R; ++r)
      ARBOR_UNROLL for (int m = 0; m < MT; ++m) part[u][r][m] = acc[r][m];
  }
  ARBOR_UNROLL for (int r = 0; r < R; ++r)
    ARBOR_UNROLL for (int m = 0; m < MT; ++m) {
      typename V::R s = part[0][r][m];
      ARBOR_UNROLL for (int u = 1; u < U; ++u) s = V::add(s, part[u][r][m]);
      out[m * ldo + r] = V::sum(s);
    }
}

template <typename WT>
inline void dense_wide_rows(
    const float* x, int64_t ldx, int64_t M, int64_t K, const WT* w, int64_t ldw, float* out,
    int64_t ldo, const char* ahead, int64_t ahead_bytes) {
  int64_t m = 0;
  for (; m + V::MT_F32 <= M; m += V::MT_F32) {
    dense_wide_tile<WT, V::MT_F32>(x + m * ldx, ldx, K, w, ldw, out + m * ldo, ldo, ahead,
                                   ahead_bytes);
    ahead_bytes = 0;  // asked for during the first x rows
  }
  switch (M - m) {
    case 1: dense_wide_tile<WT, 1>(x + m * ldx, ldx, K, w, ldw, out + m * ldo, ldo, ahead, ahead_bytes); break;
    case 2: dense_wide_tile<WT, 2>(x + m * ldx, ldx, K, w, ldw, out + m * ldo, ldo, ahead, ahead_bytes); break;
    case 3: dense_wide_tile<WT, 3>(x + m * ldx, ldx, K, w, ldw, out + m * ldo, ldo, ahead, ahead_bytes); break;
    default: break;
  }
}

// Up to PREFETCH_MIN_M x rows, one weight row at a time keeps each thread on a single
// sequential stream, which the hardware prefetcher follows best (~22 GB/s vs ~14-17 GB/s
// for 4 or 8 interleaved rows); the x tiles re-read that row from L1.
template <typename WT>
void dense_rows(
    const float* x, int64_t ldx, int64_t M, int64_t K, const void* wv,
    int64_t ldw, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const WT* w = static_cast<const WT*>(wv);
  const int64_t row_bytes = ldw * static_cast<int64_t>(sizeof(WT));
  int64_t n = n0;
  if (V::WIDE_M > 0 && M >= V::WIDE_M) {
    for (; n + WIDE_ROWS <= n1; n += WIDE_ROWS) {
      const bool ask = n + PREFETCH_ROWS + WIDE_ROWS <= n1;
      dense_wide_rows<WT>(x, ldx, M, K, w + n * ldw, ldw, out + n, ldo,
                          reinterpret_cast<const char*>(w + (n + PREFETCH_ROWS) * ldw),
                          ask ? WIDE_ROWS * row_bytes : 0);
    }
  }
  for (; n < n1; ++n) {
    if (M >= PREFETCH_MIN_M && n + PREFETCH_ROWS < n1)
      prefetch_l2(w + (n + PREFETCH_ROWS) * ldw, row_bytes);
    dense_rows_x<WT>(x, ldx, M, K, w + n * ldw, out + n, ldo);
  }
}

#define ARBOR_DENSE_ROWS {&dense_rows<float>, &dense_rows<arbor::bf16_t>, &dense_rows<arbor::f16_t>}

// Quantized tile. x rows are read in the order the ISA expects: natural for
// 8 bits; for 4 bits each block of 2*W values is split into its even-indexed
// values followed by its odd-indexed ones (see permute_q4 in kernels.cpp), which
// matches the low/high nibble order q4raw() produces from W packed bytes.
//
// The affine dequantization is factored out of the inner loop: within a group,
// sum_k (scale * q_k + bias) * x_k = scale * sum_k q_k * x_k + bias * sum_k x_k, so
// the loop only widens q to float and multiplies (no per-weight scale/bias FMA),
// and the group's two sums meet its scale and bias once, lane by lane. Each x
// row's sums run in the same order whatever M is, so rows stay reduced alike.
template <int ROWS, int MT, int BITS>
inline void q_tile(
    const float* x, int64_t ldx, int64_t K, const uint8_t* wq, int64_t ldq,
    const float* scales, const float* biases, int64_t ldsb, int gs,
    float* out, int64_t ldo) {
  typename V::R acc[ROWS][MT];
  ARBOR_UNROLL for (int r = 0; r < ROWS; ++r)
    ARBOR_UNROLL for (int m = 0; m < MT; ++m) acc[r][m] = V::zero();
  const int64_t groups = K / gs;
  for (int64_t g = 0; g < groups; ++g) {
    typename V::R part[ROWS][MT], xs[MT];  // sum q * x and sum x over the group, per lane
    ARBOR_UNROLL for (int m = 0; m < MT; ++m) {
      xs[m] = V::zero();
      ARBOR_UNROLL for (int r = 0; r < ROWS; ++r) part[r][m] = V::zero();
    }
    const int64_t k0 = g * gs, k1 = k0 + gs;
    if constexpr (BITS == 8) {
      for (int64_t k = k0; k < k1; k += V::W) {
        typename V::R xv[MT];
        ARBOR_UNROLL for (int m = 0; m < MT; ++m) {
          xv[m] = V::load(x + m * ldx + k);
          xs[m] = V::add(xs[m], xv[m]);
        }
        ARBOR_UNROLL for (int r = 0; r < ROWS; ++r) {
          typename V::R wv = V::q8raw(wq + r * ldq + k);
          ARBOR_UNROLL for (int m = 0; m < MT; ++m)
            part[r][m] = V::fma(wv, xv[m], part[r][m]);
        }
      }
    } else {
      for (int64_t k = k0; k < k1; k += 2 * V::W) {
        typename V::R xe[MT], xo[MT];
        ARBOR_UNROLL for (int m = 0; m < MT; ++m) {
          xe[m] = V::load(x + m * ldx + k);
          xo[m] = V::load(x + m * ldx + k + V::W);
          xs[m] = V::add(xs[m], V::add(xe[m], xo[m]));
        }
        ARBOR_UNROLL for (int r = 0; r < ROWS; ++r) {
          typename V::R lo, hi;
          V::q4raw(wq + r * ldq + k / 2, lo, hi);
          ARBOR_UNROLL for (int m = 0; m < MT; ++m) {
            part[r][m] = V::fma(lo, xe[m], part[r][m]);
            part[r][m] = V::fma(hi, xo[m], part[r][m]);
          }
        }
      }
    }
    ARBOR_UNROLL for (int r = 0; r < ROWS; ++r) {
      const typename V::R sc = V::set1(scales[r * ldsb + g]), bi = V::set1(biases[r * ldsb + g]);
      ARBOR_UNROLL for (int m = 0; m < MT; ++m)
        acc[r][m] = V::fma(xs[m], bi, V::fma(part[r][m], sc, acc[r][m]));
    }
  }
  ARBOR_UNROLL for (int r = 0; r < ROWS; ++r)
    ARBOR_UNROLL for (int m = 0; m < MT; ++m) out[m * ldo + r] = V::sum(acc[r][m]);
}

template <int ROWS, int BITS>
inline void q_rows_x(
    const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wq,
    int64_t ldq, const float* scales, const float* biases, int64_t ldsb,
    int gs, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + V::MT_Q <= M; m += V::MT_Q)
    q_tile<ROWS, V::MT_Q, BITS>(x + m * ldx, ldx, K, wq, ldq, scales, biases, ldsb, gs, out + m * ldo, ldo);
  for (; m < M; ++m)
    q_tile<ROWS, 1, BITS>(x + m * ldx, ldx, K, wq, ldq, scales, biases, ldsb, gs, out + m * ldo, ldo);
}

template <int BITS>
inline void q_rows_bits(
    const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wq,
    int64_t ldq, const float* scales, const float* biases, int64_t ldsb,
    int gs, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  constexpr int RB = 4;
  int64_t n = n0;
  for (; n + RB <= n1; n += RB)
    q_rows_x<RB, BITS>(x, ldx, M, K, wq + n * ldq, ldq, scales + n * ldsb, biases + n * ldsb, ldsb, gs, out + n, ldo);
  for (; n < n1; ++n)
    q_rows_x<1, BITS>(x, ldx, M, K, wq + n * ldq, ldq, scales + n * ldsb, biases + n * ldsb, ldsb, gs, out + n, ldo);
}

void q_rows(
    const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wq,
    int64_t ldq, const float* scales, const float* biases, int64_t ldsb,
    int gs, int bits, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  if (bits == 8)
    q_rows_bits<8>(x, ldx, M, K, wq, ldq, scales, biases, ldsb, gs, out, ldo, n0, n1);
  else
    q_rows_bits<4>(x, ldx, M, K, wq, ldq, scales, biases, ldsb, gs, out, ldo, n0, n1);
}

#undef ARBOR_UNROLL

// Float32 weights in panels (included by each ISA's translation unit after kernels_impl.h,
// inside its anonymous namespace, like it).
//
// A panel holds PANEL consecutive outputs' weights k-major: panel p of an N x K matrix is
// K x PANEL floats, value (n, k) at [(n / PANEL) * K * PANEL + k * PANEL + n % PANEL] (see
// pack_panels in kernels.cpp). A tile loads a panel's PANEL weights at one k as PANEL / W
// vectors and meets each x row's k-th value broadcast, so every output is one chain of fused
// multiply-adds over k = 0 .. K - 1, in order, started from zero:
//  - no horizontal sums, and a weight stream that runs through memory in order, so several
//    x rows keep the FMA units busy (8 rows on a 2-core EPYC: products in ~10 against ~26 ms
//    for the row-major kernels over the same 30 layers; 64 rows ~50 GFMA/s per core);
//  - a row's result depends on nothing but its own x row and the weights, whatever M is,
//    wherever the row sits in its tile and however the panels are cut into chunks;
//  - the same chain on every ISA that has FMA: AVX-512 and AVX2 give the same bits.

#define ARBOR_UNROLL _Pragma("GCC unroll 16")

constexpr int PANEL = 16;

template <int MT, int PT>
inline void panel_tile(const float* x, int64_t ldx, int64_t K, const float* panels, float* out,
                       int64_t ldo) {
  constexpr int VP = PANEL / V::W;  // vectors per panel
  typename V::R acc[MT][PT][VP];
  ARBOR_UNROLL for (int m = 0; m < MT; ++m)
    ARBOR_UNROLL for (int t = 0; t < PT; ++t)
      ARBOR_UNROLL for (int v = 0; v < VP; ++v) acc[m][t][v] = V::zero();
  const int64_t panel_floats = K * PANEL;
  for (int64_t k = 0; k < K; ++k) {
    typename V::R wv[PT][VP];
    ARBOR_UNROLL for (int t = 0; t < PT; ++t)
      ARBOR_UNROLL for (int v = 0; v < VP; ++v)
        wv[t][v] = V::load(panels + t * panel_floats + k * PANEL + v * V::W);
    ARBOR_UNROLL for (int m = 0; m < MT; ++m) {
      const typename V::R xb = V::set1(x[m * ldx + k]);
      ARBOR_UNROLL for (int t = 0; t < PT; ++t)
        ARBOR_UNROLL for (int v = 0; v < VP; ++v) acc[m][t][v] = V::fma(wv[t][v], xb, acc[m][t][v]);
    }
  }
  ARBOR_UNROLL for (int m = 0; m < MT; ++m)
    ARBOR_UNROLL for (int t = 0; t < PT; ++t)
      ARBOR_UNROLL for (int v = 0; v < VP; ++v)
        V::store(out + m * ldo + t * PANEL + v * V::W, acc[m][t][v]);
}

// Panels per tile for MT x rows: as many as the accumulator registers hold, at most 8 (8
// chains of FMAs keep two FMA units busy through their latency).
template <int MT>
constexpr int panels_per_tile() {
  constexpr int fit = V::PANEL_ACC / (MT * (PANEL / V::W));
  return fit < 1 ? 1 : fit > 8 ? 8 : fit;
}

// Panels [p0, p1) against MT x rows, in tiles of PT panels while that many are left, then of
// fewer (halving), so that a short chunk's panels still run side by side.
template <int MT, int PT = panels_per_tile<MT>()>
inline void panel_strip(const float* x, int64_t ldx, int64_t K, const float* panels, int64_t p0,
                        int64_t p1, float* out, int64_t ldo) {
  int64_t p = p0;
  for (; p + PT <= p1; p += PT)
    panel_tile<MT, PT>(x, ldx, K, panels + p * K * PANEL, out + p * PANEL, ldo);
  if constexpr (PT > 1) {
    if (p < p1) panel_strip<MT, PT / 2>(x, ldx, K, panels, p, p1, out, ldo);
  }
}

// out[m, n] for every x row m and the outputs of panels [p0, p1) (out row stride ldo). The
// panels of one chunk stay in cache while tiles of V::PANEL_MT x rows pass over them.
void panel_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panels,
                float* out, int64_t ldo, int64_t p0, int64_t p1) {
  constexpr int MT = V::PANEL_MT;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) panel_strip<MT>(x + m * ldx, ldx, K, panels, p0, p1, out + m * ldo, ldo);
  const float* xr = x + m * ldx;
  float* o = out + m * ldo;
  switch (M - m) {  // the last rows, fewer than MT
    case 1: panel_strip<1>(xr, ldx, K, panels, p0, p1, o, ldo); break;
    case 2: panel_strip<2>(xr, ldx, K, panels, p0, p1, o, ldo); break;
    case 3: panel_strip<3>(xr, ldx, K, panels, p0, p1, o, ldo); break;
    case 4: panel_strip<4 < MT ? 4 : 1>(xr, ldx, K, panels, p0, p1, o, ldo); break;
    case 5: panel_strip<5 < MT ? 5 : 1>(xr, ldx, K, panels, p0, p1, o, ldo); break;
    case 6: panel_strip<6 < MT ? 6 : 1>(xr, ldx, K, panels, p0, p1, o, ldo); break;
    case 7: panel_strip<7 < MT ? 7 : 1>(xr, ldx, K, panels, p0, p1, o, ldo); break;
    default: break;
  }
}

#undef ARBOR_UNROLL

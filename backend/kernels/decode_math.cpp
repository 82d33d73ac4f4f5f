// Arithmetic of Arbor's decode-time attention, RMS norm and RoPE primitives and
// of the fused SwiGLU gate (the MLX glue is in decode_ops.cpp).
//
// Why: on MLX's CPU backend these small ops are graphs of many tiny ops
// (fast.rope and fast.rms_norm fall back to composed ops; attention of one
// query materializes scores through several), and each op costs a dispatch.
// For a 135M model that was ~28 of ~48 ms per decoded token; here each is one
// pass over its data.
//
// The hot loops are compiled for AVX-512, AVX2+FMA and baseline x86-64
// (GCC function multiversioning picks one at load time) and written so the
// compiler vectorizes them: fixed-width accumulator arrays instead of scalar
// reductions, and an exp built from a polynomial instead of a libm call.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels.h"

#define ARBOR_CLONES ARBOR_ISA_CLONES

namespace arbor {
namespace {

// Eight-float vectors in GCC's vector extension: each clone lowers them to its
// own registers (one ymm for AVX2 / AVX-512, two xmm for baseline x86-64).
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
constexpr int W = 8;

inline vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, vf8 v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r) with
// n = round(x / ln2) (by the 1.5 * 2^23 rounding trick), r = x - n ln2, and a
// degree-6 Taylor p (relative error < 2e-7). Works lane-wise on vectors and scalars.
template <typename T>
__attribute__((always_inline)) inline T exp_nonpositive(T x) {
  const T lo = x * 0.0f - 87.0f;
  x = x < lo ? lo : x;
  const T n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  const T r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  T p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  if constexpr (sizeof(T) == sizeof(float)) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
  } else {
    const vi8 bits = (__builtin_convertvector(n, vi8) + 127) << 23;
    vf8 scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
  }
}

// Sum of the lanes by pairwise halving (a running scalar sum would be a chain
// of dependent adds; the compiler may not reassociate float adds itself).
inline float sum_lanes(vf8 v) {
  float a[W];
  store8(a, v);
  for (int w = W / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) a[j] += a[j + w];
  return a[0];
}

// The largest of x[0:n] (-inf for none), eight lanes at a time. Equal values are the same
// float but for the sign of zero, which exp(x - max) does not see.
ARBOR_CLONES float max_of(const float* __restrict x, int64_t n) {
  const float none = -std::numeric_limits<float>::infinity();
  vf8 acc = {none, none, none, none, none, none, none, none};
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vf8 v = load8(x + j);
    acc = v > acc ? v : acc;
  }
  float a[W];
  store8(a, acc);
  float max = none;
  for (int i = 0; i < W; ++i) max = a[i] > max ? a[i] : max;
  for (; j < n; ++j) max = x[j] > max ? x[j] : max;
  return max;
}

// scores[j] = exp(scores[j] - max), returns their sum.
ARBOR_CLONES float exp_shifted(float* __restrict scores, int64_t n, float max) {
  vf8 acc = {};
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vf8 e = exp_nonpositive(load8(scores + j) - max);
    store8(scores + j, e);
    acc += e;
  }
  float s = sum_lanes(acc);
  for (; j < n; ++j) {
    scores[j] = exp_nonpositive(scores[j] - max);
    s += scores[j];
  }
  return s;
}

// out_r[0:Dv] = sum_j p_r[j] * v[j * ldv + 0:Dv] / norm[r] for the R rows that share
// these values (row r uses values lo[r] .. n[r]-1). Each row sums its values in order, a
// block of BLOCK outputs at a time held in registers. The values are taken in spans of about
// 16 KB, each passed to every row before the next (from L1; a whole row's values come from L2
// at half the speed), so a row's sums go out to `out` and back once per span; a float stored
// and loaded is unchanged, so every output is the same in-order sum as in one pass.
ARBOR_CLONES void weighted_span(const float* __restrict p, int64_t j0, int64_t j1,
                                const float* __restrict v, int64_t ldv, int64_t Dv,
                                float* __restrict o) {
  constexpr int64_t BLOCK = 8 * W;
  int64_t d0 = 0;
  for (; d0 + BLOCK <= Dv; d0 += BLOCK) {
    vf8 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = load8(o + d0 + i * W);
    for (int64_t j = j0; j < j1; ++j) {
      const float pj = p[j];
      const float* row = v + j * ldv + d0;
      for (int i = 0; i < 8; ++i) acc[i] = acc[i] + pj * load8(row + i * W);
    }
    for (int i = 0; i < 8; ++i) store8(o + d0 + i * W, acc[i]);
  }
  for (; d0 + W <= Dv; d0 += W) {
    vf8 acc = load8(o + d0);
    for (int64_t j = j0; j < j1; ++j) acc = acc + p[j] * load8(v + j * ldv + d0);
    store8(o + d0, acc);
  }
  for (; d0 < Dv; ++d0) {
    float acc = o[d0];
    for (int64_t j = j0; j < j1; ++j) acc += p[j] * v[j * ldv + d0];
    o[d0] = acc;
  }
}

void weighted_rows(const float* __restrict p, int64_t ldp, int64_t R, const int64_t* lo,
                   const int64_t* n, const float* __restrict v, int64_t ldv, int64_t Dv,
                   const float* norm, float* __restrict out) {
  if (R <= 0) return;
  const int64_t span = std::max<int64_t>(8, 4096 / std::max<int64_t>(1, Dv));
  const int64_t first = *std::min_element(lo, lo + R), last = *std::max_element(n, n + R);
  std::fill(out, out + R * Dv, 0.0f);
  for (int64_t j0 = first; j0 < last; j0 += span)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t a = std::max(j0, lo[r]), b = std::min(j0 + span, n[r]);
      if (a < b) weighted_span(p + r * ldp, a, b, v, ldv, Dv, out + r * Dv);
    }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / norm[r];
    for (int64_t d = 0; d < Dv; ++d) out[r * Dv + d] *= inv;
  }
}

struct AttentionJob {
  View3 q, k, v;
  int64_t Hq, Hkv, M, L, D, Dv;
  float scale;
  bool causal;
  int64_t window;  // 0: none
  float* out;
  int64_t out_head;  // rows between two heads' outputs (M, or a shared buffer's N)
};

// One (batch, kv head): query rows m0 .. m1 - 1 of each of its Hq / Hkv query heads,
// handled together so every key and value row is read once for them. Runs on a pool
// thread, so it calls the single-threaded row kernels directly.
void attend_group(const AttentionJob& j, int64_t bk, int64_t m0, int64_t m1,
                  std::vector<float>& buf) {
  const int64_t b = bk / j.Hkv, hk = bk % j.Hkv, G = j.Hq / j.Hkv, R = G * (m1 - m0);
  if (R <= 0) return;
  const float* k = j.k.p + b * j.k.s0 + hk * j.k.s1;
  const float* v = j.v.p + b * j.v.s0 + hk * j.v.s1;
  const int64_t ldp = j.L;
  buf.resize(static_cast<size_t>(R * (ldp + 2 * j.Dv) + 2 * R));
  float* scores = buf.data();
  float* out = scores + R * ldp;
  float* sums = out + R * j.Dv;
  // Row r = (m, g), pre-scaled; rows sorted by visible keys (query m sees
  // keys lo .. L - M + m when causal, lo = the window's first).
  std::vector<int64_t> n(static_cast<size_t>(R)), lo(static_cast<size_t>(R));
  std::vector<float> q(static_cast<size_t>(R * j.D));
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (m - m0) * G + g, h = hk * G + g;
      const float* src = j.q.p + b * j.q.s0 + h * j.q.s1 + m * j.q.s2;
      for (int64_t d = 0; d < j.D; ++d) q[r * j.D + d] = src[d] * j.scale;
      n[r] = j.causal ? j.L - j.M + m + 1 : j.L;
      lo[r] = j.window > 0 ? std::max<int64_t>(0, n[r] - j.window) : 0;
    }
  // Scores of all rows against all keys are a matrix-vector product with the
  // keys as weight rows: the matvec kernels read each key row once for all R rows.
  best_isa().key_rows(q.data(), j.D, R, j.D, k, j.k.s2, scores, ldp, 0, n[R - 1]);
  for (int64_t r = 0; r < R; ++r) {
    // From the row's first visible key, so its lanes line up as in a one-query call.
    float* s = scores + r * ldp + lo[r];
    const int64_t count = n[r] - lo[r];
    sums[r] = exp_shifted(s, count, max_of(s, count));
  }
  weighted_rows(scores, ldp, R, lo.data(), n.data(), v, j.v.s2, j.Dv, sums, out);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = hk * G + g;
      std::memcpy(j.out + (((b * j.Hq + h) * j.out_head) + m) * j.Dv,
                  out + ((m - m0) * G + g) * j.Dv, sizeof(float) * j.Dv);
    }
}

struct SoftmaxJob {
  const float* x;
  float* out;
  int64_t M, L, window, rows, rows_per_chunk;
};

void softmax_chunk(void* ctx, int64_t c) {
  const auto* j = static_cast<SoftmaxJob*>(ctx);
  const int64_t r1 = std::min(j->rows, (c + 1) * j->rows_per_chunk);
  for (int64_t r = c * j->rows_per_chunk; r < r1; ++r) {
    const float* x = j->x + r * j->L;
    float* o = j->out + r * j->L;
    const int64_t n = j->L - j->M + r % j->M + 1;
    const int64_t lo = j->window > 0 ? std::max<int64_t>(0, n - j->window) : 0;
    const float max = max_of(x + lo, n - lo);
    std::memcpy(o + lo, x + lo, sizeof(float) * (n - lo));
    const float inv = 1.0f / exp_shifted(o + lo, n - lo, max);
    for (int64_t t = lo; t < n; ++t) o[t] *= inv;
    for (int64_t t = 0; t < lo; ++t) o[t] = 0.0f;
    for (int64_t t = n; t < j->L; ++t) o[t] = 0.0f;
  }
}

// Attention jobs (one per sequence) cut into chunks: (job, group, part of the queries).
struct SegmentJobs {
  const AttentionJob* jobs;
  int64_t groups;  // (batch, kv head) groups per job
  int64_t parts;   // query parts per group
};

void attend_segment_chunk(void* ctx, int64_t c) {
  thread_local std::vector<float> buf;
  const auto* s = static_cast<SegmentJobs*>(ctx);
  const AttentionJob& j = s->jobs[c / (s->groups * s->parts)];
  const int64_t part = c % s->parts, M = j.M;
  attend_group(j, c / s->parts % s->groups, part * M / s->parts, (part + 1) * M / s->parts, buf);
}

// Query parts per group, so that the chunks share out evenly over the threads: 3 kv heads
// alone leave one of 2 threads with two of them and the other waiting; in 2 parts each, 3
// chunks go to each thread. A query's result does not depend on the part it falls in.
int64_t query_parts(int64_t chunks, int64_t max_m, int threads) {
  if (threads <= 1 || max_m < 2 || chunks >= 4 * threads) return 1;
  return std::min<int64_t>(max_m, threads / std::gcd<int64_t>(chunks, threads));
}

// Below ~256k multiply-adds a pool hand-off costs more than it saves.
constexpr int64_t kPoolWork = 1 << 18;

ARBOR_CLONES void rms_row(const float* __restrict x, int64_t H, const float* __restrict w,
                          float eps, float* __restrict out) {
  vf8 acc = {};
  int64_t i = 0;
  for (; i + W <= H; i += W) {
    const vf8 v = load8(x + i);
    acc += v * v;
  }
  float ss = sum_lanes(acc);
  for (; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  if (w != nullptr) {
    for (int64_t d = 0; d < H; ++d) out[d] = x[d] * r * w[d];
  } else {
    for (int64_t d = 0; d < H; ++d) out[d] = x[d] * r;
  }
}

// out[i] = g[i] * sigmoid(g[i]) * u[i]. sigmoid from e = exp(-|g|) <= 1, so the
// exponential never overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below.
ARBOR_CLONES void silu_mul_range(const float* __restrict g, const float* __restrict u, int64_t n,
                                 float* __restrict out) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf8 x = load8(g + i);
    const vf8 neg = x < 0.0f ? x : -x;  // -|x|
    const vf8 e = exp_nonpositive(neg);
    const vf8 num = x < 0.0f ? e : e * 0.0f + 1.0f;
    store8(out + i, x * (num / (1.0f + e)) * load8(u + i));
  }
  for (; i < n; ++i) {
    const float x = g[i];
    const float e = exp_nonpositive(x < 0.0f ? x : -x);
    out[i] = x * ((x < 0.0f ? e : 1.0f) / (1.0f + e)) * u[i];
  }
}

struct SiluMulJob {
  const float* g;
  int64_t ldg;
  const float* u;
  int64_t ldu;
  int64_t H;
  float* out;
  int64_t rows, rows_per_chunk;
};

void silu_mul_chunk(void* ctx, int64_t c) {
  auto* j = static_cast<SiluMulJob*>(ctx);
  const int64_t r1 = std::min(j->rows, (c + 1) * j->rows_per_chunk);
  for (int64_t r = c * j->rows_per_chunk; r < r1; ++r)
    silu_mul_range(j->g + r * j->ldg, j->u + r * j->ldu, j->H, j->out + r * j->H);
}

ARBOR_CLONES void rope_row(const float* __restrict x, float* __restrict out, int64_t D,
                           int64_t half, const float* __restrict c, const float* __restrict s) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    out[i] = a * c[i] - b * s[i];
    out[i + half] = a * s[i] + b * c[i];
  }
  for (int64_t i = 2 * half; i < D; ++i) out[i] = x[i];
}

}  // namespace

void attention(View3 q, View3 k, View3 v, int64_t B, int64_t Hq, int64_t Hkv, int64_t M,
               int64_t L, int64_t D, int64_t Dv, float scale, bool causal, int64_t window,
               float* out) {
  AttentionJob job{q, k, v, Hq, Hkv, M, L, D, Dv, scale, causal, window, out, M};
  const int64_t groups = B * Hkv;
  const int threads = B * Hq * M * L * (D + Dv) < kPoolWork ? 1 : max_threads();
  SegmentJobs chunks{&job, groups, query_parts(groups, M, threads)};
  parallel_for(groups * chunks.parts, threads, &attend_segment_chunk, &chunks);
}

void attention_segments(const AttentionSegment* segments, int64_t count, int64_t Hq,
                        int64_t Hkv, int64_t D, int64_t Dv, float scale, bool causal,
                        int64_t window) {
  std::vector<AttentionJob> jobs;
  jobs.reserve(static_cast<size_t>(count));
  int64_t work = 0, max_m = 0;
  for (int64_t s = 0; s < count; ++s) {
    const AttentionSegment& g = segments[s];
    jobs.push_back(AttentionJob{g.q, g.k, g.v, Hq, Hkv, g.M, g.L, D, Dv, scale, causal, window,
                                g.out, g.out_head});
    work += Hq * g.M * g.L * (D + Dv);
    max_m = std::max(max_m, g.M);
  }
  const int threads = work < kPoolWork ? 1 : max_threads();
  SegmentJobs job{jobs.data(), Hkv, query_parts(count * Hkv, max_m, threads)};
  parallel_for(count * Hkv * job.parts, threads, &attend_segment_chunk, &job);
}

void causal_softmax(const float* x, int64_t rows, int64_t M, int64_t L, int64_t window,
                    float* out) {
  if (rows <= 0 || L <= 0) return;
  constexpr int64_t kChunk = 1 << 15;  // elements per pool chunk
  const int64_t per = std::max<int64_t>(1, kChunk / L);
  SoftmaxJob job{x, out, M, L, window, rows, per};
  parallel_for((rows + per - 1) / per, max_threads(), &softmax_chunk, &job);
}

void silu_mul(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t rows, int64_t H,
              float* out) {
  if (rows <= 0 || H <= 0) return;
  constexpr int64_t kChunk = 1 << 15;  // elements per pool chunk
  const int64_t per = std::max<int64_t>(1, kChunk / H);
  SiluMulJob job{g, ldg, u, ldu, H, out, rows, per};
  parallel_for((rows + per - 1) / per, max_threads(), &silu_mul_chunk, &job);
}

void rms_norm(const float* x, int64_t ldx, int64_t rows, int64_t H, const float* w, float eps,
              float* out) {
  for (int64_t r = 0; r < rows; ++r) rms_row(x + r * ldx, H, w, eps, out + r * H);
}

void rope_at(View3 x, int64_t N0, int64_t N1, int64_t T, int64_t D, int64_t dims,
             const int64_t* positions, float scale, const float* inv_freqs, float* out) {
  const int64_t half = dims / 2;
  // cos/sin per (row, frequency): the angle is formed in float32 as MLX does.
  std::vector<float> cs(static_cast<size_t>(2 * T * half));
  for (int64_t t = 0; t < T; ++t) {
    const float pos = static_cast<float>(positions[t]) * scale;
    for (int64_t i = 0; i < half; ++i) {
      const double theta = static_cast<double>(pos * inv_freqs[i]);
      cs[(2 * t) * half + i] = static_cast<float>(std::cos(theta));
      cs[(2 * t + 1) * half + i] = static_cast<float>(std::sin(theta));
    }
  }
  for (int64_t a = 0; a < N0; ++a)
    for (int64_t b = 0; b < N1; ++b)
      for (int64_t t = 0; t < T; ++t)
        rope_row(x.p + a * x.s0 + b * x.s1 + t * x.s2, out + ((a * N1 + b) * T + t) * D, D, half,
                 cs.data() + 2 * t * half, cs.data() + (2 * t + 1) * half);
}

void rope(View3 x, int64_t N0, int64_t N1, int64_t T, int64_t D, int64_t dims, int64_t offset,
          float scale, const float* inv_freqs, float* out) {
  std::vector<int64_t> positions(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) positions[t] = offset + t;
  rope_at(x, N0, N1, T, D, dims, positions.data(), scale, inv_freqs, out);
}

}  // namespace arbor

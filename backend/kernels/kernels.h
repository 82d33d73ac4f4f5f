// Arbor CPU matrix-vector kernels: plain C++ interface, no MLX dependency.
//
// out[m, n] = sum_k x[m, k] * W[n, k] for a few rows of x (decode-time shapes),
// with W either dense (float32, bfloat16 or float16, row stride ldw in elements;
// 16-bit weights widen exactly to float32, accumulation is float32) or MLX's affine quantized
// layout (uint32 words, 32 / bits values per word, low bits first; one float32
// scale and bias per group of `group_size` consecutive values of a row).
#pragma once

#include <cstdint>

// Functions compiled three times (AVX-512, AVX2 + FMA, baseline x86-64), one picked when the
// library loads. The clones must be chosen by the CPU's features: GCC picks `arch=<model>`
// clones (skylake-avx512, haswell) by CPU model, so every AMD CPU ran the baseline clone;
// the x86-64-v4 / v3 levels (GCC 12 on) are picked by features. clone_level() is built from
// the same targets and says which one a CPU gets.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define ARBOR_CLONE_HIGH "arch=x86-64-v4"
#define ARBOR_CLONE_MID "arch=x86-64-v3"
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ARBOR_CLONE_HIGH "arch=skylake-avx512"
#define ARBOR_CLONE_MID "arch=haswell"
#endif
#ifdef ARBOR_CLONE_HIGH
#define ARBOR_ISA_CLONES __attribute__((target_clones(ARBOR_CLONE_HIGH, ARBOR_CLONE_MID, "default")))
#else
#define ARBOR_ISA_CLONES
#endif

namespace arbor {

// Storage of dense weights. 16-bit values are passed as their raw bits.
enum class WType : int { f32 = 0, bf16 = 1, f16 = 2 };
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

// Rows of x quantized for the int8-input kernel (quantize_inputs): M rows of K int8 values
// in blocks of 64 (each block's 32 even-indexed values, then its 32 odd ones), one float32
// scale per block (value ~= scale * q) and the exact float32 sum of x per weight group.
struct QuantizedInputs {
  const int8_t* q;
  const float* scale;      // M x (K / 64)
  const float* group_sum;  // M x (K / group_size)
  int64_t M, K;
};

using DenseRowsFn = void (*)(
    const float* x, int64_t ldx, int64_t M, int64_t K,
    const void* w, int64_t ldw, float* out, int64_t ldo,
    int64_t n0, int64_t n1);

// Row-range entry points implemented once per instruction set (see kernels_impl.h).
struct IsaKernels {
  const char* name;
  // Width of the 4-bit block whose even/odd values the q4 kernel expects split
  // (x permuted by permute_q4); 0 when the kernel reads x in natural order.
  int q4_block;
  // Dense rows, indexed by WType.
  DenseRowsFn dense_rows[3];
  // float32 dense_rows for many short weight rows (attention keys, K the head size):
  // equal to dense_rows[f32] bit for bit, faster where K is small.
  DenseRowsFn key_rows;
  void (*q_rows)(
      const float* x, int64_t ldx, int64_t M, int64_t K,
      const uint8_t* wq, int64_t ldq, const float* scales, const float* biases,
      int64_t ldsb, int group_size, int bits, float* out, int64_t ldo,
      int64_t n0, int64_t n1);
  // 4-bit weights against int8 inputs (group_size a multiple of 64).
  void (*q4x8_rows)(
      const QuantizedInputs& in, const uint8_t* wq, int64_t ldq, const float* scales,
      const float* biases, int64_t ldsb, int group_size, float* out, int64_t ldo,
      int64_t n0, int64_t n1);
  // float32 weights in panels (kernels_panels.h): the outputs of panels [p0, p1).
  void (*panel_rows)(
      const float* x, int64_t ldx, int64_t M, int64_t K, const float* panels, float* out,
      int64_t ldo, int64_t p0, int64_t p1);
};

const IsaKernels& isa_generic();
#if defined(__x86_64__) || defined(_M_X64)
const IsaKernels& isa_avx2();
const IsaKernels& isa_avx512();
#endif

// The best kernel set this CPU supports (overridable with ARBOR_MATVEC_ISA=generic|avx2|avx512).
// AVX2 also requires FMA and F16C.
const IsaKernels& best_isa();

// Which of the ARBOR_ISA_CLONES targets this CPU runs: "high" (AVX-512), "mid" (AVX2 + FMA),
// "baseline", or "none" where the functions are not cloned.
const char* clone_level();

// Thread count used for large products (ARBOR_MATVEC_THREADS, else usable cores).
int max_threads();
void set_max_threads(int n);

// Multithreaded drivers. x: M rows with stride ldx; out: M rows of N, contiguous.
void matvec_dense(
    const float* x, int64_t ldx, int64_t M, int64_t K,
    const void* w, WType wtype, int64_t ldw, int64_t N, float* out);

// The same product for float32 weights in panels: N / kPanel panels of K x kPanel values,
// value (n, k) at panels[(n / kPanel) * K * kPanel + k * kPanel + n % kPanel]
// (backend.kernels.pack_panels: an MLX array of shape (N / kPanel, K, kPanel)).
// Each output is one chain of fused multiply-adds over k in order, so a row's result is the
// same whatever M is, and the same on AVX-512 and AVX2.
constexpr int64_t kPanel = 16;
void matvec_panels(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panels,
                   int64_t N, float* out);
void matvec_q(
    const float* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* wq, int64_t ldq, const float* scales, const float* biases,
    int64_t ldsb, int group_size, int bits, int64_t N, float* out);

// The same product for 4-bit weights with x rounded to int8 per block of 64 values (scale
// max |x| / 127): 1.4-1.6x the speed of the float32-input kernel from memory (2x when
// cache-resident), at ~2% relative error in the products. For draft models, whose outputs
// are only proposals the target verifies; group_size 64 or 128, K a multiple of it. Rows
// stay independent (each row's result is the same whatever M is).
void matvec_q4_int8_inputs(
    const float* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* wq, int64_t ldq, const float* scales, const float* biases,
    int64_t ldsb, int group_size, int64_t N, float* out);

// x (M rows at stride ldx; K a multiple of group_size, itself a multiple of 64) into `q` (M * K),
// `scale` (M * K / 64) and `group_sum` (M * K / group_size).
void quantize_inputs(const float* x, int64_t ldx, int64_t M, int64_t K, int group_size,
                     int8_t* q, float* scale, float* group_sum);

// W (N x K) float32 from MLX's affine layout (wq row stride ldq in uint32 words,
// scales / biases row stride ldsb), bits 4 or 8: the prefill path's weights.
void dequantize(const uint32_t* wq, int64_t ldq, const float* scales, const float* biases,
                int64_t ldsb, int group_size, int bits, int64_t N, int64_t K, float* out);

// Runs fn(ctx, c) for c in [0, chunks) on the pool (at most `threads` threads,
// the caller included); returns when all are done.
void parallel_for(int64_t chunks, int threads, void (*fn)(void*, int64_t), void* ctx);

// ---------------------------------------------------------------------------
// Decode-time attention, RMS norm and RoPE (decode_math.cpp), float32.

// Strided operand: element (i0, i1, i2, j) at p[i0*s0 + i1*s1 + i2*s2 + j].
struct View3 {
  const float* p;
  int64_t s0, s1, s2;
};

// out (B, Hq, M, Dv), contiguous = softmax(scale * q k^T [causal]) v for
// q (B, Hq, M, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv); query head h reads kv
// head h / (Hq / Hkv). Causal is aligned to the last key: query i sees keys
// 0 .. L - M + i (requires L >= M); with window > 0 only the last `window` of
// those. Each query reduces over exactly its visible keys, in order, whatever M
// is: M queries give bit for bit what M one-query calls give.
void attention(View3 q, View3 k, View3 v, int64_t B, int64_t Hq, int64_t Hkv, int64_t M,
               int64_t L, int64_t D, int64_t Dv, float scale, bool causal, int64_t window,
               float* out);

// One sequence of a batched step for attention_segments: its M queries (q, B == 1 rows of
// heads), its keys and values (L positions), and where its output rows go: row m of head
// h at out + (h * out_head + m) * Dv (several segments write their rows into one
// (Hq, N, Dv) buffer: out_head = N, out advanced to the segment's first row).
struct AttentionSegment {
  View3 q, k, v;
  int64_t M, L;
  float* out;
  int64_t out_head;
};

// attention() of every segment (B == 1 each; same heads, head sizes, scale, mask), all
// their (segment, kv head) groups in one pool hand-off: each group is computed as a
// one-segment call computes it, so the rows are bit for bit the same.
void attention_segments(const AttentionSegment* segments, int64_t count, int64_t Hq,
                        int64_t Hkv, int64_t D, int64_t Dv, float scale, bool causal,
                        int64_t window);

// Causal softmax of score rows: x (rows, L) where row r is query m = r % M of a
// block of M queries whose keys end at the last one (query m sees keys
// 0 .. L - M + m; with window > 0 only the last `window` of those). Masked keys
// get probability 0. For long query runs, whose score products BLAS computes.
void causal_softmax(const float* x, int64_t rows, int64_t M, int64_t L, int64_t window,
                    float* out);

// out (rows x H) = silu(g) * u for rows of g and u at row strides ldg / ldu
// (threaded when large).
void silu_mul(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t rows, int64_t H,
              float* out);

// rows x H (row stride ldx) -> out (rows x H): x * rsqrt(mean(x^2) + eps) * w
// (w may be null: no weight).
void rms_norm(const float* x, int64_t ldx, int64_t rows, int64_t H, const float* w, float eps,
              float* out);

// Non-traditional RoPE of x (N0, N1, T, D) into contiguous out: row (., ., t)
// is at position offset + t; angle i = (position * scale) * inv_freqs[i] for
// i < dims / 2 rotates elements i and i + dims / 2; elements from dims on are copied.
void rope(View3 x, int64_t N0, int64_t N1, int64_t T, int64_t D, int64_t dims, int64_t offset,
          float scale, const float* inv_freqs, float* out);

// The same with row t at positions[t] (T entries), whatever the order.
void rope_at(View3 x, int64_t N0, int64_t N1, int64_t T, int64_t D, int64_t dims,
             const int64_t* positions, float scale, const float* inv_freqs, float* out);

}  // namespace arbor

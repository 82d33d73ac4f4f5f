// Arbor matvec drivers: ISA selection, a small persistent thread pool and the
// row partitioning of one product across it.
#include "kernels.h"

#include <pthread.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// Dequantized values must equal MLX's (scale * q, then + bias, each rounded): no fused
// multiply-add where the clone's instruction set has one.
#if defined(__GNUC__) && !defined(__clang__)
#define ARBOR_DEQUANT_CLONES ARBOR_ISA_CLONES __attribute__((optimize("fp-contract=off")))
#else
#define ARBOR_DEQUANT_CLONES ARBOR_ISA_CLONES
#endif

namespace arbor {

// ---------------------------------------------------------------------------
// Instruction set selection

// Versions of one function, dispatched like target_clones; callers must see them all, so
// other files call clone_level(), which calls this here.
#ifdef ARBOR_CLONE_HIGH
__attribute__((target(ARBOR_CLONE_HIGH))) static const char* level() { return "high"; }
__attribute__((target(ARBOR_CLONE_MID))) static const char* level() { return "mid"; }
__attribute__((target("default"))) static const char* level() { return "baseline"; }
#else
static const char* level() { return "none"; }
#endif

const char* clone_level() { return level(); }

const IsaKernels& best_isa() {
  static const IsaKernels* chosen = [] {
    const char* env = std::getenv("ARBOR_MATVEC_ISA");
    std::string want = env ? env : "";
#if defined(__x86_64__)
    __builtin_cpu_init();
    bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                  __builtin_cpu_supports("fma");
    unsigned a = 0, b = 0, c = 0, d = 0;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    if (want == "generic") return &isa_generic();
    if (want == "avx2" && has2) return &isa_avx2();
    if (has512 && want != "avx2") return &isa_avx512();
    if (has2) return &isa_avx2();
#endif
    return &isa_generic();
  }();
  return *chosen;
}

// ---------------------------------------------------------------------------
// Thread pool. A product is cut into chunks of rows; the calling thread and the
// workers claim chunks from one atomic word until none are left, so a worker
// that is not scheduled (cores shared with other processes) never holds the
// caller up: the caller simply does more chunks itself. Idle workers spin for a
// short while (decode issues products back to back, and a futex wake-up costs
// as much as a small product), yielding the CPU as they go, then sleep.

namespace {

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == 0) ? static_cast<int>(x) : fallback;
}

std::atomic<int> g_max_threads{0};

class Pool {
 public:
  using Fn = void (*)(void* ctx, int64_t chunk);

  static Pool& get() {
    // Never destroyed: workers may outlive exit. A forked child has none of the
    // parent's threads (and maybe a mutex held by one), so it starts afresh.
    static std::once_flag once;
    std::call_once(once, [] {
      instance_.store(new Pool(), std::memory_order_release);
      pthread_atfork(nullptr, nullptr, [] {
        instance_.store(new Pool(), std::memory_order_release);
      });
    });
    return *instance_.load(std::memory_order_acquire);
  }

  // Runs fn(ctx, c) for every chunk c in [0, chunks) using up to `threads`
  // threads, this one included; returns when all chunks are done.
  void run(int64_t chunks, int threads, Fn fn, void* ctx) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::defer_lock);
    if (threads <= 1 || chunks <= 1 || chunks > kMaxChunks || !busy.try_lock()) {
      for (int64_t c = 0; c < chunks; ++c) fn(ctx, c);  // serial (or pool busy)
      return;
    }
    ensure_workers(threads - 1);
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t job = (job_id_ = (job_id_ + 1) & kJobMask);
    word_.store(pack(job, static_cast<uint64_t>(chunks), 0), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(sleep_mutex_);
      wake_.notify_all();
    }
    work_on(job);
    int spins = 0;
    while (done_.load(std::memory_order_acquire) != chunks) {
      if (++spins % 64 == 0) sched_yield();  // a claimed chunk may sit on a preempted worker
    }
  }

 private:
  // word_ = job id (24 bits) | chunk count (20 bits) | next chunk (20 bits)
  static constexpr uint64_t kJobMask = (1ull << 24) - 1;
  static constexpr int64_t kMaxChunks = (1ll << 20) - 2;
  static uint64_t pack(uint64_t job, uint64_t total, uint64_t next) {
    return (job << 40) | (total << 20) | next;
  }
  static uint64_t job_of(uint64_t w) { return w >> 40; }
  static uint64_t total_of(uint64_t w) { return (w >> 20) & 0xFFFFF; }
  static uint64_t next_of(uint64_t w) { return w & 0xFFFFF; }

  // Claims and runs chunks of `job` until it has none left.
  void work_on(uint64_t job) {
    uint64_t w = word_.load(std::memory_order_acquire);
    for (;;) {
      if (job_of(w) != job || next_of(w) >= total_of(w)) return;
      if (!word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        continue;
      // The claimed chunk keeps the job unfinished, so fn_/ctx_ stay valid.
      fn_(ctx_, static_cast<int64_t>(next_of(w)));
      done_.fetch_add(1, std::memory_order_acq_rel);
      w = word_.load(std::memory_order_acquire);
    }
  }

  Pool() { spin_us_ = env_int("ARBOR_MATVEC_SPIN_US", 300); }

  void ensure_workers(int n) {
    while (workers_ < n) {
      ++workers_;
      std::thread([this] { loop(); }).detach();
    }
  }

  void loop() {
    using clock = std::chrono::steady_clock;
    uint64_t seen = job_of(word_.load(std::memory_order_acquire));
    for (;;) {
      auto deadline = clock::now() + std::chrono::microseconds(spin_us_);
      int spins = 0;
      uint64_t job;
      while ((job = job_of(word_.load(std::memory_order_acquire))) == seen) {
        if (++spins % 16 != 0) continue;
        sched_yield();  // let a thread sharing this CPU (the caller) run
        if (clock::now() < deadline) continue;
        std::unique_lock<std::mutex> lk(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lk, [&] {
          return job_of(word_.load(std::memory_order_seq_cst)) != seen;
        });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        deadline = clock::now() + std::chrono::microseconds(spin_us_);
      }
      seen = job;
      work_on(job);
    }
  }

  static inline std::atomic<Pool*> instance_{nullptr};

  std::mutex run_mutex_;
  int workers_ = 0;
  uint64_t job_id_ = 0;
  std::atomic<uint64_t> word_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int spin_us_ = 300;
};

// Chunks of whole 16-row groups, each streaming about kChunkBytes of weights.
constexpr int64_t kChunkBytes = 64 * 1024;

inline int64_t chunk_rows(int64_t row_cost_bytes, int64_t N) {
  int64_t rows = kChunkBytes / std::max<int64_t>(1, row_cost_bytes);
  rows = std::max<int64_t>(16, (rows + 15) / 16 * 16);
  return std::min<int64_t>(rows, std::max<int64_t>(N, 1));
}

// With several x rows the kernels ask for the weights some rows ahead (kernels_impl.h),
// which pays only inside long chunks: each thread's share of a small product in one
// chunk, else chunks of 128 rows.
constexpr int64_t kPrefetchMinM = 3;

inline int64_t prefetching_chunk_rows(int64_t N) {
  const int64_t share = (N + max_threads() - 1) / max_threads();
  return std::max<int64_t>(16, std::min<int64_t>(128, (share + 15) / 16 * 16));
}

inline int threads_for(int64_t chunks) {
  return static_cast<int>(std::min<int64_t>(max_threads(), chunks));
}

struct DenseJob {
  DenseRowsFn rows_fn;
  const float* x;
  int64_t ldx, M, K;
  const void* w;
  int64_t ldw, N;
  float* out;
  int64_t rows;  // per chunk
};

// Weight rows [n0, n1) of chunk c.
struct RowRange {
  int64_t n0, n1;
};

inline RowRange chunk_range(int64_t c, int64_t rows, int64_t N) {
  return {c * rows, std::min(N, (c + 1) * rows)};
}

void dense_chunk(void* ctx, int64_t c) {
  auto* j = static_cast<DenseJob*>(ctx);
  const auto [n0, n1] = chunk_range(c, j->rows, j->N);
  j->rows_fn(j->x, j->ldx, j->M, j->K, j->w, j->ldw, j->out, j->N, n0, n1);
}

// Weights in MLX's affine layout, as the quantized kernels walk them.
struct PackedRows {
  const uint8_t* wq;
  int64_t ldq;
  const float* scales;
  const float* biases;
  int64_t ldsb;
  int gs;
};

struct QJob {
  const IsaKernels* isa;
  const float* x;
  int64_t ldx, M, K;
  PackedRows w;
  int bits;
  int64_t N;
  float* out;
  int64_t rows;  // per chunk
};

void q_chunk(void* ctx, int64_t c) {
  auto* j = static_cast<QJob*>(ctx);
  const auto [n0, n1] = chunk_range(c, j->rows, j->N);
  const PackedRows& w = j->w;
  j->isa->q_rows(j->x, j->ldx, j->M, j->K, w.wq, w.ldq, w.scales, w.biases, w.ldsb, w.gs,
                 j->bits, j->out, j->N, n0, n1);
}

struct Q4x8Job {
  const IsaKernels* isa;
  QuantizedInputs in;
  PackedRows w;
  int64_t N;
  float* out;
  int64_t rows;  // per chunk
};

void q4x8_chunk(void* ctx, int64_t c) {
  auto* j = static_cast<Q4x8Job*>(ctx);
  const auto [n0, n1] = chunk_range(c, j->rows, j->N);
  const PackedRows& w = j->w;
  j->isa->q4x8_rows(j->in, w.wq, w.ldq, w.scales, w.biases, w.ldsb, w.gs, j->out, j->N, n0, n1);
}

}  // namespace

int max_threads() {
  int t = g_max_threads.load(std::memory_order_relaxed);
  if (t <= 0) {
    t = env_int("ARBOR_MATVEC_THREADS", 0);
    if (t <= 0) t = usable_cores();
    t = std::max(1, std::min(t, 64));
    g_max_threads.store(t, std::memory_order_relaxed);
  }
  return t;
}

void set_max_threads(int n) {
  g_max_threads.store(n <= 0 ? 0 : std::min(n, 64), std::memory_order_relaxed);
}

void parallel_for(int64_t chunks, int threads, void (*fn)(void*, int64_t), void* ctx) {
  if (chunks <= 0) return;
  Pool::get().run(chunks, std::max(1, std::min(threads, max_threads())), fn, ctx);
}

void matvec_dense(
    const float* x, int64_t ldx, int64_t M, int64_t K, const void* w,
    WType wtype, int64_t ldw, int64_t N, float* out) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    std::memset(out, 0, sizeof(float) * M * N);
    return;
  }
  const int64_t esize = wtype == WType::f32 ? 4 : 2;
  // Cost of a row: its bytes, and more once several x rows make it compute bound.
  int64_t row_cost = K * esize * std::max<int64_t>(1, M / 2);
  int64_t rows = chunk_rows(row_cost, N);
  if (M >= kPrefetchMinM) rows = prefetching_chunk_rows(N);
  DenseJob job{best_isa().dense_rows[static_cast<int>(wtype)], x, ldx, M, K, w, ldw, N, out, rows};
  int64_t chunks = (N + rows - 1) / rows;
  Pool::get().run(chunks, threads_for(chunks), &dense_chunk, &job);
}

namespace {

struct PanelJob {
  const float* x;
  int64_t ldx, M, K;
  const float* panels;
  int64_t P;  // panels in all
  float* out;
  int64_t N, per_chunk;  // panels per chunk
};

void panel_chunk(void* ctx, int64_t c) {
  auto* j = static_cast<PanelJob*>(ctx);
  const int64_t p0 = c * j->per_chunk, p1 = std::min(j->P, p0 + j->per_chunk);
  best_isa().panel_rows(j->x, j->ldx, j->M, j->K, j->panels, j->out, j->N, p0, p1);
}

}  // namespace

void matvec_panels(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panels,
                   int64_t N, float* out) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    std::memset(out, 0, sizeof(float) * M * N);
    return;
  }
  // A chunk's panels stay in L2 while the tiles of x rows pass over them: 8 panels (a
  // one-row tile takes 8 at once) for a few rows, about 256 KiB of panels for many.
  const int64_t P = N / kPanel, panel_bytes = K * kPanel * 4;
  const int64_t per_chunk = M <= 8 ? 8 : std::max<int64_t>(2, (256 * 1024 / panel_bytes) & ~1);
  PanelJob job{x, ldx, M, K, panels, P, out, N, per_chunk};
  const int64_t chunks = (P + per_chunk - 1) / per_chunk;
  Pool::get().run(chunks, threads_for(chunks), &panel_chunk, &job);
}

void matvec_q(
    const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wq,
    int64_t ldq, const float* scales, const float* biases, int64_t ldsb,
    int group_size, int bits, int64_t N, float* out) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    std::memset(out, 0, sizeof(float) * M * N);
    return;
  }
  const IsaKernels* isa = &best_isa();
  // The 4-bit kernels read each block of q4_block values of x as its even
  // entries followed by its odd ones (the order nibbles unpack in).
  thread_local std::vector<float> scratch;
  if (bits == 4 && isa->q4_block > 0) {
    const int B = isa->q4_block, H = B / 2;
    scratch.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m) {
      const float* src = x + m * ldx;
      float* dst = scratch.data() + m * K;
      for (int64_t b = 0; b < K; b += B)
        for (int i = 0; i < H; ++i) {
          dst[b + i] = src[b + 2 * i];
          dst[b + H + i] = src[b + 2 * i + 1];
        }
    }
    x = scratch.data();
    ldx = K;
  }
  // Unpacking costs more than streaming: count a packed row like its float32 size.
  int64_t row_cost = K * static_cast<int64_t>(sizeof(float)) * std::max<int64_t>(1, M / 2);
  int64_t rows = chunk_rows(row_cost, N);
  QJob job{isa, x, ldx, M, K, {wq, ldq, scales, biases, ldsb, group_size}, bits, N, out, rows};
  int64_t chunks = (N + rows - 1) / rows;
  Pool::get().run(chunks, threads_for(chunks), &q_chunk, &job);
}

namespace {

// x rounded to the nearest integer, ties to even, for |x| <= 127: adding and taking away
// 1.5 * 2^23 leaves no fraction bits (the default rounding mode does the rounding; the
// kernels build without -ffast-math, which could fold it). Plain float arithmetic, unlike
// a libm call, so the loops below vectorize.
inline float round_small(float x) {
  const float magic = 12582912.0f;
  return (x + magic) - magic;
}

}  // namespace

void quantize_inputs(const float* x, int64_t ldx, int64_t M, int64_t K, int group_size,
                     int8_t* q, float* scale, float* group_sum) {
  const int64_t blocks = K / 64, groups = K / group_size;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = row + b * 64;
      float amax = 0.0f;
      for (int i = 0; i < 64; ++i) amax = std::max(amax, std::fabs(v[i]));
      // |v * inv| <= 127 (rounding can only land on 127 itself), so no clamp is needed.
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* out = q + m * K + b * 64;
      for (int i = 0; i < 32; ++i) {  // even-indexed values, then odd ones
        out[i] = static_cast<int8_t>(round_small(v[2 * i] * inv));
        out[32 + i] = static_cast<int8_t>(round_small(v[2 * i + 1] * inv));
      }
      scale[m * blocks + b] = amax / 127.0f;
    }
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) sum += row[k];
      group_sum[m * groups + g] = sum;
    }
  }
}

void matvec_q4_int8_inputs(
    const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wq,
    int64_t ldq, const float* scales, const float* biases, int64_t ldsb,
    int group_size, int64_t N, float* out) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    std::memset(out, 0, sizeof(float) * M * N);
    return;
  }
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scale, group_sum;
  q.resize(static_cast<size_t>(M * K));
  scale.resize(static_cast<size_t>(M * (K / 64)));
  group_sum.resize(static_cast<size_t>(M * (K / group_size)));
  quantize_inputs(x, ldx, M, K, group_size, q.data(), scale.data(), group_sum.data());
  // A packed row costs about its int8-input work: count it like a 16-bit row.
  int64_t row_cost = K * 2 * std::max<int64_t>(1, M / 2);
  int64_t rows = chunk_rows(row_cost, N);
  Q4x8Job job{&best_isa(), {q.data(), scale.data(), group_sum.data(), M, K},
              {wq, ldq, scales, biases, ldsb, group_size}, N, out, rows};
  int64_t chunks = (N + rows - 1) / rows;
  Pool::get().run(chunks, threads_for(chunks), &q4x8_chunk, &job);
}

namespace {

// One row of MLX's affine layout: BITS-bit values packed low bits first into
// uint32 words; value i of group g is scales[g] * q + biases[g]. The word's
// values unpack with constant shifts, which the compiler vectorizes.
template <int BITS>
ARBOR_DEQUANT_CLONES void dequantize_row(const uint32_t* __restrict wq,
                                         const float* __restrict scales,
                                         const float* __restrict biases, int64_t K, int gs,
                                         float* __restrict out) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  for (int64_t g = 0; g < K / gs; ++g) {
    const float sc = scales[g], bi = biases[g];
    const uint32_t* w = wq + g * gs / PER;
    float* o = out + g * gs;
    for (int64_t j = 0; j < gs / PER; ++j) {
      const uint32_t v = w[j];
      for (int t = 0; t < PER; ++t)
        o[j * PER + t] = sc * static_cast<float>((v >> (t * BITS)) & MASK) + bi;
    }
  }
}

struct DequantJob {
  const uint32_t* wq;
  int64_t ldq;  // words per row
  const float* scales;
  const float* biases;
  int64_t ldsb;
  int64_t K;
  int gs, bits;
  int64_t N;
  float* out;
  int64_t rows;  // per chunk
};

void dequant_chunk(void* ctx, int64_t c) {
  auto* j = static_cast<DequantJob*>(ctx);
  const int64_t n1 = std::min(j->N, (c + 1) * j->rows);
  for (int64_t n = c * j->rows; n < n1; ++n) {
    const uint32_t* w = j->wq + n * j->ldq;
    const float* sc = j->scales + n * j->ldsb;
    const float* bi = j->biases + n * j->ldsb;
    float* o = j->out + n * j->K;
    if (j->bits == 4)
      dequantize_row<4>(w, sc, bi, j->K, j->gs, o);
    else
      dequantize_row<8>(w, sc, bi, j->K, j->gs, o);
  }
}

}  // namespace

void dequantize(const uint32_t* wq, int64_t ldq, const float* scales, const float* biases,
                int64_t ldsb, int group_size, int bits, int64_t N, int64_t K, float* out) {
  if (N <= 0 || K <= 0) return;
  // Writing the float32 rows is the cost: chunk by output bytes.
  const int64_t rows = chunk_rows(K * static_cast<int64_t>(sizeof(float)), N);
  DequantJob job{wq, ldq, scales, biases, ldsb, K, group_size, bits, N, out, rows};
  const int64_t chunks = (N + rows - 1) / rows;
  Pool::get().run(chunks, threads_for(chunks), &dequant_chunk, &job);
}

}  // namespace arbor

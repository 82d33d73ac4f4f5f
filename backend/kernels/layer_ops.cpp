// A Llama-style decoder layer's few-row forward (one decode token, or a verify
// block of up to 16) as two MLX primitives around the cache's buffer update:
//
//   attention_inputs: RMS norm -> stacked q/k/v product -> RoPE of q and k
//                     -> q (B, Hq, N, D), k and v (B, Hkv, N, D)
//   attention_mlp:    causal attention over the cache's key / value buffers (read
//                     in place) -> output projection -> + residual -> RMS norm ->
//                     stacked gate/up product -> silu(gate) * up -> down -> + residual
//
// Both take a step's rows by sequence (segments): one sequence, or several whose
// rows are stacked along the token axis (a batched step, B == 1), each at its own
// positions and attending to its own cache, as it would alone.
//
// Separately these are ~26 graph nodes per layer, and at decode sizes each node's
// graph building and dispatch cost more than its arithmetic (~10 us against a few).
// Each stage calls the function the separate op calls (rms_norm, the matvec
// drivers, rope, silu_mul) on the same values in the same order, and the residual
// adds are the same float32 additions, so the outputs equal the separate ops' bit
// for bit; tests/test_fused_layers.py pins that.

#include "layer_ops.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include "kernels.h"
#include "mlx_glue.h"

namespace arbor {
namespace {

// A weight matrix among a primitive's inputs, starting at inputs[at]: dense
// (bits == 0: one array) or affine quantized (wq, scales, biases).
struct Weight {
  size_t at;
  int bits, group_size;
  bool int8_inputs;
};

size_t weight_arrays(int bits) { return bits ? 3 : 1; }

int64_t weight_rows(const std::vector<mx::array>& in, const Weight& w) {
  return w.bits ? in[w.at].shape(0) : dense_outputs(in[w.at]);
}

int64_t weight_cols(const std::vector<mx::array>& in, const Weight& w) {
  return w.bits ? static_cast<int64_t>(in[w.at].shape(1)) * 32 / w.bits : in[w.at].shape(1);
}

void product(const std::vector<mx::array>& in, const Weight& w, const float* x, int64_t M,
             int64_t K, float* out) {
  if (w.bits)
    quantized_product(x, M, K, in[w.at], in[w.at + 1], in[w.at + 2], w.group_size, w.bits, out,
                      w.int8_inputs);
  else
    dense_product(x, M, K, in[w.at], out);
}

// Weak copies of a primitive's arrays for its dispatched task (MLX keeps the
// arrays alive until the task has run: set_input_array / set_output_array).
std::vector<mx::array> weak(const std::vector<mx::array>& arrays) {
  std::vector<mx::array> copies;
  copies.reserve(arrays.size());
  for (const auto& a : arrays) copies.push_back(mx::array::unsafe_weak_copy(a));
  return copies;
}

struct Heads {
  int64_t q, kv, dim;
};

struct RopeParams {
  int dims;
  float scale;
};

// Which rows of the token axis are whose: segment s is rows[s] consecutive rows
// at positions offsets[s] .. offsets[s] + rows[s] - 1.
struct Segments {
  std::vector<int64_t> offsets, rows;

  size_t size() const { return rows.size(); }
  // The position of every row of the token axis.
  std::vector<int64_t> positions() const {
    std::vector<int64_t> out;
    for (size_t s = 0; s < size(); ++s)
      for (int64_t t = 0; t < rows[s]; ++t) out.push_back(offsets[s] + t);
    return out;
  }
  bool operator==(const Segments& o) const { return offsets == o.offsets && rows == o.rows; }
};

struct Norm {
  const float* w;
  float eps;
};

// The attention inputs of rows x (B, N, H contiguous): q (B, h.q, N, D) and, per
// segment s of n rows, k[s] and v[s] (B, h.kv, n, D), each contiguous: the separate
// ops' rms_norm, product and rope (each row at its own position).
void qkv_rows(const std::vector<mx::array>& in, const Weight& qkv, const float* x, int64_t B,
              int64_t N, int64_t H, Norm norm, Heads h, RopeParams r, const Segments& segs,
              const float* freqs, float* q, const std::vector<float*>& k,
              const std::vector<float*>& v) {
  const int64_t M = B * N, W = (h.q + 2 * h.kv) * h.dim;
  std::vector<float> normed(static_cast<size_t>(M * H)), y(static_cast<size_t>(M * W));
  rms_norm(x, H, M, H, norm.w, norm.eps, normed.data());
  product(in, qkv, normed.data(), M, H, y.data());
  // Row (b, t) of y is [q heads | k heads | v heads]; element (b, head, t, j) of a
  // head group starting at column c is y[(b * N + t) * W + c + head * dim + j].
  const std::vector<int64_t> pos = segs.positions();
  rope_at(View3{y.data(), N * W, h.dim, W}, B, h.q, N, h.dim, r.dims, pos.data(), r.scale, freqs,
          q);
  int64_t first = 0;  // the segment's first row
  for (size_t s = 0; s < segs.size(); ++s) {
    const int64_t n = segs.rows[s];
    const float* rows = y.data() + first * W;
    rope_at(View3{rows + h.q * h.dim, N * W, h.dim, W}, B, h.kv, n, h.dim, r.dims,
            pos.data() + first, r.scale, freqs, k[s]);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t head = 0; head < h.kv; ++head)
        for (int64_t t = 0; t < n; ++t)
          std::memcpy(v[s] + ((b * h.kv + head) * n + t) * h.dim,
                      rows + (b * N + t) * W + (h.q + h.kv + head) * h.dim,
                      h.dim * sizeof(float));
    first += n;
  }
}

struct MlpWeights {
  Weight o, gate_up, down;
};

// out (B, N, H) = h + down(silu(g) * u), h = x + o(attention rows), [g | u] the
// gate/up product of rms_norm(h), for attn (B, Hq, N, D) contiguous.
void mlp_rows(const std::vector<mx::array>& in, const MlpWeights& w, const float* attn,
              int64_t Hq, int64_t D, const float* x, int64_t B, int64_t N, int64_t H, Norm norm,
              float* out) {
  const int64_t M = B * N, A = Hq * D, I = weight_rows(in, w.gate_up) / 2;
  // The attention heads of each position side by side: rows (b, t) of (M, Hq * D).
  std::vector<float> rows(static_cast<size_t>(M * A));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < N; ++t)
      for (int64_t head = 0; head < Hq; ++head)
        std::memcpy(rows.data() + (b * N + t) * A + head * D, attn + ((b * Hq + head) * N + t) * D,
                    D * sizeof(float));
  std::vector<float> h(static_cast<size_t>(M * H)), normed(h.size());
  product(in, w.o, rows.data(), M, A, h.data());
  for (int64_t i = 0; i < M * H; ++i) h[i] = x[i] + h[i];
  rms_norm(h.data(), H, M, H, norm.w, norm.eps, normed.data());
  std::vector<float> gu(static_cast<size_t>(M * 2 * I)), act(static_cast<size_t>(M * I));
  product(in, w.gate_up, normed.data(), M, H, gu.data());
  silu_mul(gu.data(), 2 * I, gu.data() + I, 2 * I, M, I, act.data());
  product(in, w.down, act.data(), M, I, out);
  for (int64_t i = 0; i < M * H; ++i) out[i] = h[i] + out[i];
}

bool same_kind(const Weight& a, const Weight& b) {
  return a.bits == b.bits && a.group_size == b.group_size && a.int8_inputs == b.int8_inputs;
}

bool same_mlp(const MlpWeights& a, const MlpWeights& b) {
  return same_kind(a.o, b.o) && same_kind(a.gate_up, b.gate_up) && same_kind(a.down, b.down);
}

class AttentionInputs : public mx::Primitive {
 public:
  AttentionInputs(mx::Stream s, Heads heads, float eps, RopeParams rope, Segments segs,
                  Weight qkv)
      : mx::Primitive(s), heads_(heads), eps_(eps), rope_(rope), segs_(std::move(segs)),
        qkv_(qkv) {}

  // inputs: x (B, N, H), norm weight (H,), inverse frequencies (rope_dims / 2,), qkv weight.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) alloc_out(o);
    register_io(stream(), inputs, outputs);
    mx::cpu::get_command_encoder(stream()).dispatch(
        [in = weak(inputs), out = weak(outputs), h = heads_, eps = eps_, r = rope_,
         segs = segs_, qkv = qkv_]() mutable {
          const auto& x = in[0];
          if (x.size() == 0) return;
          std::vector<char> xs, ws, fs;
          std::vector<float*> k, v;
          for (size_t s = 0; s < segs.size(); ++s) {
            k.push_back(out[1 + 2 * s].data<float>());
            v.push_back(out[2 + 2 * s].data<float>());
          }
          qkv_rows(in, qkv, contiguous_floats(x, xs), x.shape(0), x.shape(1), x.shape(2),
                   Norm{contiguous_floats(in[1], ws), eps}, h, r, segs,
                   contiguous_floats(in[2], fs), out[0].data<float>(), k, v);
        });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[arbor.attention_inputs] has no GPU implementation.");
  }
  const char* name() const override { return "ArborAttentionInputs"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionInputs&>(other);
    return heads_.q == o.heads_.q && heads_.kv == o.heads_.kv && heads_.dim == o.heads_.dim &&
        eps_ == o.eps_ && rope_.dims == o.rope_.dims && rope_.scale == o.rope_.scale &&
        segs_ == o.segs_ && same_kind(qkv_, o.qkv_);
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return shapes(inputs[0].shape(0), heads_, segs_);
  }

  // q (B, heads, N, D), then k and v (B, kv_heads, n, D) of each segment of n rows.
  static std::vector<mx::Shape> shapes(int B, Heads h, const Segments& segs) {
    const int D = static_cast<int>(h.dim), kv = static_cast<int>(h.kv);
    int N = 0;
    for (int64_t n : segs.rows) N += static_cast<int>(n);
    std::vector<mx::Shape> out{{B, static_cast<int>(h.q), N, D}};
    for (int64_t n : segs.rows) {
      out.push_back({B, kv, static_cast<int>(n), D});
      out.push_back({B, kv, static_cast<int>(n), D});
    }
    return out;
  }

 private:
  Heads heads_;
  float eps_;
  RopeParams rope_;
  Segments segs_;
  Weight qkv_;
};

struct AttentionParams {
  float scale;
  int64_t window;  // 0: none
};

// Attention and everything after it, for full-attention caches: per segment s, the
// key and value buffers (B, Hkv, capacity, D) hold positions 0 .. lengths[s] - 1
// (the segment's queries are the last of them); causal attention over them as the
// attention op computes it, then mlp_rows over every row. Reads the buffers in
// place (no history slices).
class AttentionMlp : public mx::UnaryPrimitive {
 public:
  AttentionMlp(mx::Stream s, std::vector<int64_t> lengths, std::vector<int64_t> rows,
               AttentionParams attention, float eps, MlpWeights w)
      : mx::UnaryPrimitive(s), lengths_(std::move(lengths)), rows_(std::move(rows)),
        attention_(attention), eps_(eps), w_(w) {}

  // inputs: q, residual x (B, N, H), norm weight (H,), each segment's keys and values,
  // the mlp weights.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    alloc_out(output);
    std::vector<mx::array> outputs{output};
    register_io(stream(), inputs, outputs);
    mx::cpu::get_command_encoder(stream()).dispatch(
        [in = weak(inputs), out = mx::array::unsafe_weak_copy(output), lengths = lengths_,
         rows = rows_, a = attention_, eps = eps_, w = w_]() mutable {
          const auto& q = in[0];
          const auto& x = in[1];
          if (x.size() == 0) return;
          const int64_t B = q.shape(0), Hq = q.shape(1), N = q.shape(2), D = q.shape(3);
          const int64_t Hkv = in[3].shape(1);
          std::vector<char> qs, xs, ws;
          std::vector<float> attn(q.size());
          const View3 qv = view_of(q, qs);
          if (rows.size() == 1) {
            std::vector<char> ks, vs;
            attention(qv, view_of(in[3], ks), view_of(in[4], vs), B, Hq, Hkv, N, lengths[0], D,
                      D, a.scale, true, a.window, attn.data());
          } else {  // several sequences (B == 1): each writes its rows of every head
            const size_t count = rows.size();
            std::vector<std::vector<char>> kvs(2 * count);
            std::vector<AttentionSegment> segs;
            int64_t first = 0;
            for (size_t s = 0; s < count; ++s) {
              segs.push_back(AttentionSegment{
                  View3{qv.p + first * qv.s2, qv.s0, qv.s1, qv.s2},
                  view_of(in[3 + 2 * s], kvs[2 * s]), view_of(in[4 + 2 * s], kvs[2 * s + 1]),
                  rows[s], lengths[s], attn.data() + first * D, N});
              first += rows[s];
            }
            attention_segments(segs.data(), static_cast<int64_t>(count), Hq, Hkv, D, D,
                               a.scale, true, a.window);
          }
          mlp_rows(in, w, attn.data(), Hq, D, contiguous_floats(x, xs), B, N, x.shape(2),
                   Norm{contiguous_floats(in[2], ws), eps}, out.data<float>());
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.attention_mlp] has no GPU implementation.");
  }
  const char* name() const override { return "ArborAttentionMlp"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionMlp&>(other);
    return lengths_ == o.lengths_ && rows_ == o.rows_ && attention_.scale == o.attention_.scale &&
        attention_.window == o.attention_.window && eps_ == o.eps_ && same_mlp(w_, o.w_);
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape()};
  }

 private:
  std::vector<int64_t> lengths_, rows_;
  AttentionParams attention_;
  float eps_;
  MlpWeights w_;
};

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[arbor.") + op + "] " + what);
}

void require_f32(const char* op, const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32)
    fail(op, std::string("expected float32 ") + what + ", got " + dtype_str(a.dtype()) + " " +
                 shape_str(a) + ".");
}

// Appends one weight's arrays to `inputs` after checking its kind and shape
// (rows x cols); returns where it starts.
Weight take_weight(const char* op, const char* what, const WeightArg& arg, int64_t rows,
                   int64_t cols, std::vector<mx::array>& inputs) {
  const auto& [arrays, bits, group_size, int8_inputs] = arg;
  if (bits != 0 && bits != 4 && bits != 8)
    fail(op, std::string(what) + ": bits must be 0 (dense), 4 or 8, got " +
                 std::to_string(bits) + ".");
  if (int8_inputs && !int8_inputs_supported(bits, group_size))
    fail(op, std::string(what) + ": " + int8_inputs_refusal(bits, group_size));
  if (arrays.size() != weight_arrays(bits))
    fail(op, std::string(what) + ": expected " + (bits ? "wq, scales and biases" : "one array") +
                 ", got " + std::to_string(arrays.size()) + " arrays.");
  const auto& w = arrays[0];
  Weight spec{inputs.size(), bits, group_size, int8_inputs};
  if (w.ndim() != 2 && (bits || !is_panels(w)))
    fail(op, std::string(what) + ": expected a matrix (or float32 panels), got " + shape_str(w) + ".");
  if (bits) {
    const auto& sc = arrays[1];
    const auto& bi = arrays[2];
    const bool ok = w.dtype() == mx::uint32 && sc.dtype() == mx::float32 &&
        bi.dtype() == mx::float32 && quantized_layout_supported(bits, group_size) &&
        sc.ndim() == 2 && bi.shape() == sc.shape() && sc.shape(0) == w.shape(0) &&
        static_cast<int64_t>(sc.shape(1)) * group_size ==
            static_cast<int64_t>(w.shape(1)) * 32 / bits;
    if (!ok)
      fail(op, std::string(what) + ": expected uint32 wq (N, K*bits/32) and float32 scales / "
               "biases (N, K/group_size), 4/8 bits in groups of 32/64/128 or 8 in groups of 16; "
               "got wq " + shape_str(w) + " " +
               dtype_str(w.dtype()) + ", scales " + shape_str(sc) + ", group_size " +
               std::to_string(group_size) + ".");
  } else if (w.dtype() != mx::float32 && w.dtype() != mx::bfloat16 && w.dtype() != mx::float16) {
    fail(op, std::string(what) + ": expected float32, bfloat16 or float16, got " +
                 dtype_str(w.dtype()) + ".");
  }
  for (const auto& a : arrays) inputs.push_back(a);
  if (weight_rows(inputs, spec) != rows || weight_cols(inputs, spec) != cols)
    fail(op, std::string(what) + ": expected " + std::to_string(rows) + " x " +
                 std::to_string(cols) + " values, got " + std::to_string(weight_rows(inputs, spec)) +
                 " x " + std::to_string(weight_cols(inputs, spec)) + ".");
  return spec;
}

void require_rows(const char* op, const mx::array& x, const mx::array& norm) {
  require_f32(op, x, "x");
  require_f32(op, norm, "norm weight");
  if (x.ndim() != 3 || x.shape(2) == 0)
    fail(op, "expected x (B, N, H), got " + shape_str(x) + ".");
  if (norm.ndim() != 1 || norm.shape(0) != x.shape(2))
    fail(op, "norm weight " + shape_str(norm) + " does not match x " + shape_str(x) + ".");
}

void require_heads(const char* op, const mx::array& inv_freqs, int heads, int kv_heads,
                   int head_dim, int rope_dims) {
  require_f32(op, inv_freqs, "inv_freqs");
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || rope_dims <= 0 ||
      rope_dims % 2 != 0 || rope_dims > head_dim || inv_freqs.ndim() != 1 ||
      inv_freqs.shape(0) != rope_dims / 2)
    fail(op, "expected heads a multiple of kv_heads, an even rope_dims <= head_dim and inv_freqs "
             "(rope_dims / 2,); got heads " + std::to_string(heads) +
             ", kv_heads " + std::to_string(kv_heads) + ", head_dim " +
             std::to_string(head_dim) + ", rope_dims " + std::to_string(rope_dims) +
             ", inv_freqs " + shape_str(inv_freqs) + ".");
}

std::string list_str(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i)
    out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

// Segments that cover x's N rows (several only for B == 1), each with a row and
// a position >= 0 (for attention_mlp: the cache lengths, each >= its rows, checked there).
Segments take_segments(const char* op, const mx::array& x, std::vector<int64_t> offsets,
                       std::vector<int64_t> rows) {
  int64_t total = 0;
  bool ok = !rows.empty() && offsets.size() == rows.size() &&
      (rows.size() == 1 || x.shape(0) == 1);
  for (size_t s = 0; ok && s < rows.size(); ++s) {
    ok = rows[s] >= 1 && offsets[s] >= 0;
    total += rows[s];
  }
  if (!ok || total != x.shape(1))
    fail(op, "expected segments of >= 1 rows at offsets >= 0 covering x's " +
                 std::to_string(x.shape(1)) + " rows (several only for batch 1); got offsets " +
                 list_str(offsets) + ", rows " + list_str(rows) + " for x " + shape_str(x) + ".");
  return Segments{std::move(offsets), std::move(rows)};
}

MlpWeights take_mlp(const char* op, int64_t H, int64_t A, const WeightArg& o,
                    const WeightArg& gate_up, const WeightArg& down,
                    std::vector<mx::array>& inputs) {
  const auto& gu = std::get<0>(gate_up);
  const int64_t gu_rows = gu.empty() ? 0 : gu.size() == 1 ? dense_outputs(gu[0]) : gu[0].shape(0);
  if (gu_rows == 0 || gu_rows % 2 != 0)
    fail(op, "gate_up: expected the gate and up rows stacked (2 * I rows).");
  const int64_t I = gu_rows / 2;
  MlpWeights w;
  w.o = take_weight(op, "o", o, H, A, inputs);
  w.gate_up = take_weight(op, "gate_up", gate_up, 2 * I, H, inputs);
  w.down = take_weight(op, "down", down, H, I, inputs);
  return w;
}

}  // namespace

std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight,
                                        float eps, const WeightArg& qkv, int heads, int kv_heads,
                                        int head_dim, int rope_dims,
                                        const std::vector<int64_t>& offsets,
                                        const std::vector<int64_t>& rows, float rope_scale,
                                        const mx::array& inv_freqs, mx::StreamOrDevice s) {
  const char* op = "attention_inputs";
  require_rows(op, x, norm_weight);
  require_heads(op, inv_freqs, heads, kv_heads, head_dim, rope_dims);
  Segments segs = take_segments(op, x, offsets, rows);
  std::vector<mx::array> inputs{x, norm_weight, inv_freqs};
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * head_dim;
  const Weight w = take_weight(op, "qkv", qkv, width, x.shape(2), inputs);
  const Heads h{heads, kv_heads, head_dim};
  auto shapes = AttentionInputs::shapes(x.shape(0), h, segs);
  std::vector<mx::Dtype> types(shapes.size(), mx::float32);
  auto prim = std::make_shared<AttentionInputs>(cpu_stream(s), h, eps,
                                                RopeParams{rope_dims, rope_scale},
                                                std::move(segs), w);
  return mx::array::make_arrays(std::move(shapes), types, prim, inputs);
}

mx::array attention_mlp(const mx::array& q, const std::vector<mx::array>& keys,
                        const std::vector<mx::array>& values, const std::vector<int64_t>& lengths,
                        const std::vector<int64_t>& rows, float scale, int64_t window,
                        const mx::array& x, const mx::array& norm_weight, float eps,
                        const WeightArg& o, const WeightArg& gate_up, const WeightArg& down,
                        mx::StreamOrDevice s) {
  const char* op = "attention_mlp";
  require_rows(op, x, norm_weight);
  require_f32(op, q, "q");
  if (keys.size() != rows.size() || values.size() != rows.size() ||
      lengths.size() != rows.size())
    fail(op, "expected keys, values and a length for each of the " +
                 std::to_string(rows.size()) + " segments.");
  take_segments(op, x, lengths, rows);
  bool ok = q.ndim() == 4 && q.shape(0) == x.shape(0) && q.shape(2) == x.shape(1) && window >= 0;
  for (size_t i = 0; ok && i < rows.size(); ++i) {
    const auto& k = keys[i];
    const auto& v = values[i];
    ok = k.dtype() == mx::float32 && v.dtype() == mx::float32 && k.ndim() == 4 &&
        k.shape() == v.shape() && k.shape(0) == q.shape(0) && k.shape(1) > 0 &&
        q.shape(1) % k.shape(1) == 0 && k.shape(1) == keys[0].shape(1) &&
        k.shape(3) == q.shape(3) && lengths[i] >= rows[i] && lengths[i] <= k.shape(2);
  }
  if (!ok)
    fail(op, "expected q (B, Hq, N, D) for x (B, N, H), float32 key and value buffers "
             "(B, Hkv, capacity, D) with Hq a multiple of Hkv, each segment's rows <= length <= "
             "capacity and window >= 0; got q " + shape_str(q) + ", keys " +
             shape_str(keys[0]) + ", values " + shape_str(values[0]) + ", x " + shape_str(x) +
             ", lengths " + list_str(lengths) + ", rows " + list_str(rows) + ".");
  std::vector<mx::array> inputs{q, x, norm_weight};
  for (size_t i = 0; i < rows.size(); ++i) {
    inputs.push_back(keys[i]);
    inputs.push_back(values[i]);
  }
  const MlpWeights w = take_mlp(op, x.shape(2), static_cast<int64_t>(q.shape(1)) * q.shape(3), o,
                                gate_up, down, inputs);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<AttentionMlp>(cpu_stream(s), lengths, rows,
                                                  AttentionParams{scale, window}, eps, w),
                   std::move(inputs));
}

}  // namespace arbor

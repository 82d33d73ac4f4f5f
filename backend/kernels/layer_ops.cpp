// A Llama-style decoder layer's few-row forward (one decode token, or a verify
// block of up to 16) as two MLX primitives around the cache's buffer update:
//
//   attention_inputs: RMS norm -> stacked q/k/v product -> RoPE of q and k
//                     -> q (B, Hq, N, D), k and v (B, Hkv, N, D)
//   attention_mlp:    causal attention over the cache's key / value buffers (read
//                     in place) -> output projection -> + residual -> RMS norm ->
//                     stacked gate/up product -> silu(gate) * up -> down -> + residual
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
  return in[w.at].shape(0);
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
  int64_t offset;
  float scale;
};

struct Norm {
  const float* w;
  float eps;
};

// The attention inputs of rows x (B, N, H contiguous): q (B, h.q, N, D), k and v
// (B, h.kv, N, D), each contiguous: the separate ops' rms_norm, product and rope.
void qkv_rows(const std::vector<mx::array>& in, const Weight& qkv, const float* x, int64_t B,
              int64_t N, int64_t H, Norm norm, Heads h, RopeParams r, const float* freqs,
              float* q, float* k, float* v) {
  const int64_t M = B * N, W = (h.q + 2 * h.kv) * h.dim;
  std::vector<float> normed(static_cast<size_t>(M * H)), y(static_cast<size_t>(M * W));
  rms_norm(x, H, M, H, norm.w, norm.eps, normed.data());
  product(in, qkv, normed.data(), M, H, y.data());
  // Row (b, t) of y is [q heads | k heads | v heads]; element (b, head, t, j) of a
  // head group starting at column c is y[(b * N + t) * W + c + head * dim + j].
  rope(View3{y.data(), N * W, h.dim, W}, B, h.q, N, h.dim, r.dims, r.offset, r.scale, freqs, q);
  rope(View3{y.data() + h.q * h.dim, N * W, h.dim, W}, B, h.kv, N, h.dim, r.dims, r.offset,
       r.scale, freqs, k);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t head = 0; head < h.kv; ++head)
      for (int64_t t = 0; t < N; ++t)
        std::memcpy(v + ((b * h.kv + head) * N + t) * h.dim,
                    y.data() + (b * N + t) * W + (h.q + h.kv + head) * h.dim,
                    h.dim * sizeof(float));
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
  AttentionInputs(mx::Stream s, Heads heads, float eps, RopeParams rope, Weight qkv)
      : mx::Primitive(s), heads_(heads), eps_(eps), rope_(rope), qkv_(qkv) {}

  // inputs: x (B, N, H), norm weight (H,), inverse frequencies (rope_dims / 2,), qkv weight.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) alloc_out(o);
    register_io(stream(), inputs, outputs);
    mx::cpu::get_command_encoder(stream()).dispatch(
        [in = weak(inputs), out = weak(outputs), h = heads_, eps = eps_, r = rope_,
         qkv = qkv_]() mutable {
          const auto& x = in[0];
          if (x.size() == 0) return;
          std::vector<char> xs, ws, fs;
          qkv_rows(in, qkv, contiguous_floats(x, xs), x.shape(0), x.shape(1), x.shape(2),
                   Norm{contiguous_floats(in[1], ws), eps}, h, r, contiguous_floats(in[2], fs),
                   out[0].data<float>(), out[1].data<float>(), out[2].data<float>());
        });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[arbor.attention_inputs] has no GPU implementation.");
  }
  const char* name() const override { return "ArborAttentionInputs"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionInputs&>(other);
    return heads_.q == o.heads_.q && heads_.kv == o.heads_.kv && heads_.dim == o.heads_.dim &&
        eps_ == o.eps_ && rope_.dims == o.rope_.dims && rope_.offset == o.rope_.offset &&
        rope_.scale == o.rope_.scale && same_kind(qkv_, o.qkv_);
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int B = inputs[0].shape(0), N = inputs[0].shape(1), D = static_cast<int>(heads_.dim);
    return {{B, static_cast<int>(heads_.q), N, D}, {B, static_cast<int>(heads_.kv), N, D},
            {B, static_cast<int>(heads_.kv), N, D}};
  }

 private:
  Heads heads_;
  float eps_;
  RopeParams rope_;
  Weight qkv_;
};

struct AttentionParams {
  float scale;
  int64_t window;  // 0: none
};

// Attention and everything after it, for a full-attention cache: the keys and
// values buffers (B, Hkv, capacity, D) hold positions 0 .. length - 1 (the queries
// q (B, Hq, N, D) are the last N); causal attention over them as the attention op
// computes it, then mlp_rows. Reads the buffers in place (no history slices).
class AttentionMlp : public mx::UnaryPrimitive {
 public:
  AttentionMlp(mx::Stream s, int64_t length, AttentionParams attention, float eps, MlpWeights w)
      : mx::UnaryPrimitive(s), length_(length), attention_(attention), eps_(eps), w_(w) {}

  // inputs: q, keys, values, residual x (B, N, H), norm weight (H,), the mlp weights.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    alloc_out(output);
    std::vector<mx::array> outputs{output};
    register_io(stream(), inputs, outputs);
    mx::cpu::get_command_encoder(stream()).dispatch(
        [in = weak(inputs), out = mx::array::unsafe_weak_copy(output), L = length_,
         a = attention_, eps = eps_, w = w_]() mutable {
          const auto& q = in[0];
          const auto& x = in[3];
          if (x.size() == 0) return;
          const int64_t B = q.shape(0), Hq = q.shape(1), N = q.shape(2), D = q.shape(3);
          const int64_t Hkv = in[1].shape(1);
          std::vector<char> qs, ks, vs, xs, ws;
          std::vector<float> attn(q.size());
          attention(view_of(q, qs), view_of(in[1], ks), view_of(in[2], vs), B, Hq, Hkv, N, L, D,
                    D, a.scale, true, a.window, attn.data());
          mlp_rows(in, w, attn.data(), Hq, D, contiguous_floats(x, xs), B, N, x.shape(2),
                   Norm{contiguous_floats(in[4], ws), eps}, out.data<float>());
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.attention_mlp] has no GPU implementation.");
  }
  const char* name() const override { return "ArborAttentionMlp"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionMlp&>(other);
    return length_ == o.length_ && attention_.scale == o.attention_.scale &&
        attention_.window == o.attention_.window && eps_ == o.eps_ && same_mlp(w_, o.w_);
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[3].shape()};
  }

 private:
  int64_t length_;
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
  if (w.ndim() != 2) fail(op, std::string(what) + ": expected a matrix, got " + shape_str(w) + ".");
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
                   int head_dim, int rope_dims, int64_t offset) {
  require_f32(op, inv_freqs, "inv_freqs");
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || rope_dims <= 0 ||
      rope_dims % 2 != 0 || rope_dims > head_dim || inv_freqs.ndim() != 1 ||
      inv_freqs.shape(0) != rope_dims / 2 || offset < 0)
    fail(op, "expected heads a multiple of kv_heads, an even rope_dims <= head_dim, inv_freqs "
             "(rope_dims / 2,) and offset >= 0; got heads " + std::to_string(heads) +
             ", kv_heads " + std::to_string(kv_heads) + ", head_dim " +
             std::to_string(head_dim) + ", rope_dims " + std::to_string(rope_dims) +
             ", inv_freqs " + shape_str(inv_freqs) + ", offset " + std::to_string(offset) + ".");
}

MlpWeights take_mlp(const char* op, int64_t H, int64_t A, const WeightArg& o,
                    const WeightArg& gate_up, const WeightArg& down,
                    std::vector<mx::array>& inputs) {
  const auto& gu = std::get<0>(gate_up);
  if (gu.empty() || gu[0].ndim() != 2 || gu[0].shape(0) % 2 != 0)
    fail(op, "gate_up: expected the gate and up rows stacked (2 * I rows).");
  const int64_t I = gu[0].shape(0) / 2;
  MlpWeights w;
  w.o = take_weight(op, "o", o, H, A, inputs);
  w.gate_up = take_weight(op, "gate_up", gate_up, 2 * I, H, inputs);
  w.down = take_weight(op, "down", down, H, I, inputs);
  return w;
}

}  // namespace

std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight,
                                        float eps, const WeightArg& qkv, int heads, int kv_heads,
                                        int head_dim, int rope_dims, int64_t offset,
                                        float rope_scale, const mx::array& inv_freqs,
                                        mx::StreamOrDevice s) {
  const char* op = "attention_inputs";
  require_rows(op, x, norm_weight);
  require_heads(op, inv_freqs, heads, kv_heads, head_dim, rope_dims, offset);
  std::vector<mx::array> inputs{x, norm_weight, inv_freqs};
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * head_dim;
  const Weight w = take_weight(op, "qkv", qkv, width, x.shape(2), inputs);
  const int B = x.shape(0), N = x.shape(1);
  auto prim = std::make_shared<AttentionInputs>(cpu_stream(s), Heads{heads, kv_heads, head_dim},
                                                eps, RopeParams{rope_dims, offset, rope_scale}, w);
  return mx::array::make_arrays({{B, heads, N, head_dim}, {B, kv_heads, N, head_dim},
                                 {B, kv_heads, N, head_dim}},
                                {mx::float32, mx::float32, mx::float32}, prim, inputs);
}

mx::array attention_mlp(const mx::array& q, const mx::array& keys, const mx::array& values,
                        int64_t length, float scale, int64_t window, const mx::array& x,
                        const mx::array& norm_weight, float eps, const WeightArg& o,
                        const WeightArg& gate_up, const WeightArg& down, mx::StreamOrDevice s) {
  const char* op = "attention_mlp";
  require_rows(op, x, norm_weight);
  for (auto [a, what] : {std::pair{&q, "q"}, std::pair{&keys, "keys"}, std::pair{&values, "values"}})
    require_f32(op, *a, what);
  const bool ok = q.ndim() == 4 && keys.ndim() == 4 && keys.shape() == values.shape() &&
      q.shape(0) == x.shape(0) && q.shape(2) == x.shape(1) && keys.shape(0) == q.shape(0) &&
      keys.shape(1) > 0 && q.shape(1) % keys.shape(1) == 0 && keys.shape(3) == q.shape(3) &&
      length >= q.shape(2) && length <= keys.shape(2) && window >= 0;
  if (!ok)
    fail(op, "expected q (B, Hq, N, D) for x (B, N, H), key and value buffers (B, Hkv, capacity, "
             "D) with Hq a multiple of Hkv, N <= length <= capacity and window >= 0; got q " +
             shape_str(q) + ", keys " + shape_str(keys) + ", values " + shape_str(values) +
             ", x " + shape_str(x) + ", length " + std::to_string(length) + ".");
  std::vector<mx::array> inputs{q, keys, values, x, norm_weight};
  const MlpWeights w = take_mlp(op, x.shape(2), static_cast<int64_t>(q.shape(1)) * q.shape(3), o,
                                gate_up, down, inputs);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<AttentionMlp>(cpu_stream(s), length,
                                                  AttentionParams{scale, window}, eps, w),
                   std::move(inputs));
}

}  // namespace arbor

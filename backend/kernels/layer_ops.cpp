// A Llama-style decoder layer's few-row forward (one decode token, or a verify
// block of up to 16) as two MLX primitives around the cache update and attention:
//
//   attention_inputs: RMS norm -> stacked q/k/v product -> RoPE of q and k
//                     -> q (B, Hq, N, D), k and v (B, Hkv, N, D)
//   mlp_block:        output projection -> + residual -> RMS norm -> stacked
//                     gate/up product -> silu(gate) * up -> down product -> + residual
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
    quantized_product(x, M, K, in[w.at], in[w.at + 1], in[w.at + 2], w.group_size, w.bits, out);
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

void register_io(mx::Stream stream, const std::vector<mx::array>& inputs,
                 std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& a : outputs) enc.set_output_array(a);
}

// The float32 elements of `a` in row-major order (copied when strided).
const float* floats(const mx::array& a, std::vector<char>& scratch) {
  if (a.flags().row_contiguous) return a.data<float>();
  scratch.resize(a.nbytes());
  gather(a, scratch.data());
  return reinterpret_cast<const float*>(scratch.data());
}

struct Heads {
  int64_t q, kv, dim;
};

class AttentionInputs : public mx::Primitive {
 public:
  AttentionInputs(mx::Stream s, Heads heads, float eps, int rope_dims, int64_t offset,
                  float rope_scale, Weight qkv)
      : mx::Primitive(s), heads_(heads), eps_(eps), rope_dims_(rope_dims), offset_(offset),
        rope_scale_(rope_scale), qkv_(qkv) {}

  // inputs: x (B, N, H), norm weight (H,), inverse frequencies (rope_dims / 2,), qkv weight.
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) alloc_out(o);
    register_io(stream(), inputs, outputs);
    mx::cpu::get_command_encoder(stream()).dispatch(
        [in = weak(inputs), out = weak(outputs), h = heads_, eps = eps_, dims = rope_dims_,
         offset = offset_, scale = rope_scale_, qkv = qkv_]() mutable {
          const auto& x = in[0];
          const int64_t B = x.shape(0), N = x.shape(1), H = x.shape(2), M = B * N;
          if (M == 0) return;
          const int64_t W = (h.q + 2 * h.kv) * h.dim;
          std::vector<char> xs, ws, fs;
          std::vector<float> normed(static_cast<size_t>(M * H)), y(static_cast<size_t>(M * W));
          rms_norm(floats(x, xs), H, M, H, floats(in[1], ws), eps, normed.data());
          product(in, qkv, normed.data(), M, H, y.data());
          // Row (b, t) of y is [q heads | k heads | v heads]; element (b, head, t, j)
          // of a head group starting at column c is y[(b * N + t) * W + c + head * dim + j].
          const float* freqs = floats(in[2], fs);
          rope(View3{y.data(), N * W, h.dim, W}, B, h.q, N, h.dim, dims, offset, scale, freqs,
               out[0].data<float>());
          rope(View3{y.data() + h.q * h.dim, N * W, h.dim, W}, B, h.kv, N, h.dim, dims, offset,
               scale, freqs, out[1].data<float>());
          float* v = out[2].data<float>();
          for (int64_t b = 0; b < B; ++b)
            for (int64_t head = 0; head < h.kv; ++head)
              for (int64_t t = 0; t < N; ++t)
                std::memcpy(v + ((b * h.kv + head) * N + t) * h.dim,
                            y.data() + (b * N + t) * W + (h.q + h.kv + head) * h.dim,
                            h.dim * sizeof(float));
        });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[arbor.attention_inputs] has no GPU implementation.");
  }
  const char* name() const override { return "ArborAttentionInputs"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionInputs&>(other);
    return heads_.q == o.heads_.q && heads_.kv == o.heads_.kv && heads_.dim == o.heads_.dim &&
        eps_ == o.eps_ && rope_dims_ == o.rope_dims_ && offset_ == o.offset_ &&
        rope_scale_ == o.rope_scale_ && qkv_.bits == o.qkv_.bits &&
        qkv_.group_size == o.qkv_.group_size;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int B = inputs[0].shape(0), N = inputs[0].shape(1), D = static_cast<int>(heads_.dim);
    return {{B, static_cast<int>(heads_.q), N, D}, {B, static_cast<int>(heads_.kv), N, D},
            {B, static_cast<int>(heads_.kv), N, D}};
  }

 private:
  Heads heads_;
  float eps_;
  int rope_dims_;
  int64_t offset_;
  float rope_scale_;
  Weight qkv_;
};

class MlpBlock : public mx::UnaryPrimitive {
 public:
  MlpBlock(mx::Stream s, float eps, Weight o, Weight gate_up, Weight down)
      : mx::UnaryPrimitive(s), eps_(eps), o_(o), gate_up_(gate_up), down_(down) {}

  // inputs: attention output (B, Hq, N, D), residual x (B, N, H), norm weight (H,),
  // then the o, gate/up and down weights.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    alloc_out(output);
    std::vector<mx::array> outputs{output};
    register_io(stream(), inputs, outputs);
    mx::cpu::get_command_encoder(stream()).dispatch(
        [in = weak(inputs), out = mx::array::unsafe_weak_copy(output), eps = eps_, wo = o_,
         wgu = gate_up_, wd = down_]() mutable {
          const auto& attn = in[0];
          const auto& x = in[1];
          const int64_t B = x.shape(0), N = x.shape(1), H = x.shape(2), M = B * N;
          if (M == 0) return;
          const int64_t Hq = attn.shape(1), D = attn.shape(3), A = Hq * D;
          const int64_t I = weight_rows(in, wgu) / 2;
          std::vector<char> as, xs, ws;
          // The attention heads of each position side by side: rows (b, t) of (M, Hq * D).
          const float* ap = floats(attn, as);
          std::vector<float> rows(static_cast<size_t>(M * A));
          for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < N; ++t)
              for (int64_t head = 0; head < Hq; ++head)
                std::memcpy(rows.data() + (b * N + t) * A + head * D,
                            ap + ((b * Hq + head) * N + t) * D, D * sizeof(float));
          std::vector<float> h(static_cast<size_t>(M * H)), normed(h.size());
          product(in, wo, rows.data(), M, A, h.data());
          const float* xp = floats(x, xs);
          for (int64_t i = 0; i < M * H; ++i) h[i] = xp[i] + h[i];
          rms_norm(h.data(), H, M, H, floats(in[2], ws), eps, normed.data());
          std::vector<float> gu(static_cast<size_t>(M * 2 * I)), act(static_cast<size_t>(M * I));
          product(in, wgu, normed.data(), M, H, gu.data());
          silu_mul(gu.data(), 2 * I, gu.data() + I, 2 * I, M, I, act.data());
          float* o = out.data<float>();
          product(in, wd, act.data(), M, I, o);
          for (int64_t i = 0; i < M * H; ++i) o[i] = h[i] + o[i];
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.mlp_block] has no GPU implementation.");
  }
  const char* name() const override { return "ArborMlpBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MlpBlock&>(other);
    auto same = [](const Weight& a, const Weight& b) {
      return a.bits == b.bits && a.group_size == b.group_size;
    };
    return eps_ == o.eps_ && same(o_, o.o_) && same(gate_up_, o.gate_up_) &&
        same(down_, o.down_);
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape()};
  }

 private:
  float eps_;
  Weight o_, gate_up_, down_;
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
Weight take_weight(const char* op, const char* what, const std::vector<mx::array>& arrays,
                   int bits, int group_size, int64_t rows, int64_t cols,
                   std::vector<mx::array>& inputs) {
  if (bits != 0 && bits != 4 && bits != 8)
    fail(op, std::string(what) + ": bits must be 0 (dense), 4 or 8, got " +
                 std::to_string(bits) + ".");
  if (arrays.size() != weight_arrays(bits))
    fail(op, std::string(what) + ": expected " + (bits ? "wq, scales and biases" : "one array") +
                 ", got " + std::to_string(arrays.size()) + " arrays.");
  const auto& w = arrays[0];
  Weight spec{inputs.size(), bits, group_size};
  if (w.ndim() != 2) fail(op, std::string(what) + ": expected a matrix, got " + shape_str(w) + ".");
  if (bits) {
    const auto& sc = arrays[1];
    const auto& bi = arrays[2];
    const bool ok = w.dtype() == mx::uint32 && sc.dtype() == mx::float32 &&
        bi.dtype() == mx::float32 && (group_size == 32 || group_size == 64 || group_size == 128) &&
        sc.ndim() == 2 && bi.shape() == sc.shape() && sc.shape(0) == w.shape(0) &&
        static_cast<int64_t>(sc.shape(1)) * group_size ==
            static_cast<int64_t>(w.shape(1)) * 32 / bits;
    if (!ok)
      fail(op, std::string(what) + ": expected uint32 wq (N, K*bits/32) and float32 scales / "
               "biases (N, K/group_size), group_size 32/64/128; got wq " + shape_str(w) + " " +
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

}  // namespace

std::vector<mx::array> attention_inputs(const mx::array& x, const mx::array& norm_weight,
                                        float eps, const std::vector<mx::array>& qkv, int bits,
                                        int group_size, int heads, int kv_heads, int head_dim,
                                        int rope_dims, int64_t offset, float rope_scale,
                                        const mx::array& inv_freqs, mx::StreamOrDevice s) {
  const char* op = "attention_inputs";
  require_rows(op, x, norm_weight);
  require_f32(op, inv_freqs, "inv_freqs");
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || rope_dims <= 0 ||
      rope_dims % 2 != 0 || rope_dims > head_dim || inv_freqs.ndim() != 1 ||
      inv_freqs.shape(0) != rope_dims / 2 || offset < 0)
    fail(op, "expected heads a multiple of kv_heads, an even rope_dims <= head_dim, inv_freqs "
             "(rope_dims / 2,) and offset >= 0; got heads " + std::to_string(heads) +
             ", kv_heads " + std::to_string(kv_heads) + ", head_dim " +
             std::to_string(head_dim) + ", rope_dims " + std::to_string(rope_dims) +
             ", inv_freqs " + shape_str(inv_freqs) + ", offset " + std::to_string(offset) + ".");
  std::vector<mx::array> inputs{x, norm_weight, inv_freqs};
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * head_dim;
  const Weight w = take_weight(op, "qkv", qkv, bits, group_size, width, x.shape(2), inputs);
  const int B = x.shape(0), N = x.shape(1);
  auto prim = std::make_shared<AttentionInputs>(cpu_stream(s), Heads{heads, kv_heads, head_dim},
                                                eps, rope_dims, offset, rope_scale, w);
  return mx::array::make_arrays({{B, heads, N, head_dim}, {B, kv_heads, N, head_dim},
                                 {B, kv_heads, N, head_dim}},
                                {mx::float32, mx::float32, mx::float32}, prim, inputs);
}

mx::array mlp_block(const mx::array& attn, const mx::array& x, const mx::array& norm_weight,
                    float eps, const std::vector<mx::array>& o, int o_bits, int o_group,
                    const std::vector<mx::array>& gate_up, int gate_up_bits, int gate_up_group,
                    const std::vector<mx::array>& down, int down_bits, int down_group,
                    mx::StreamOrDevice s) {
  const char* op = "mlp_block";
  require_rows(op, x, norm_weight);
  require_f32(op, attn, "attention output");
  if (attn.ndim() != 4 || attn.shape(0) != x.shape(0) || attn.shape(2) != x.shape(1))
    fail(op, "expected the attention output (B, Hq, N, D) for x (B, N, H), got " +
                 shape_str(attn) + " for x " + shape_str(x) + ".");
  if (gate_up.empty() || gate_up[0].ndim() != 2 || gate_up[0].shape(0) % 2 != 0)
    fail(op, "gate_up: expected the gate and up rows stacked (2 * I rows).");
  const int64_t H = x.shape(2), A = static_cast<int64_t>(attn.shape(1)) * attn.shape(3);
  const int64_t I = gate_up[0].shape(0) / 2;
  std::vector<mx::array> inputs{attn, x, norm_weight};
  const Weight wo = take_weight(op, "o", o, o_bits, o_group, H, A, inputs);
  const Weight wgu = take_weight(op, "gate_up", gate_up, gate_up_bits, gate_up_group, 2 * I, H,
                                 inputs);
  const Weight wd = take_weight(op, "down", down, down_bits, down_group, H, I, inputs);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<MlpBlock>(cpu_stream(s), eps, wo, wgu, wd),
                   std::move(inputs));
}

}  // namespace arbor

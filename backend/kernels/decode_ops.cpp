// MLX glue for the decode-time attention, RMS norm and RoPE primitives; the
// arithmetic is in decode_math.cpp. Like matvec, each op only records a graph
// node; eval_cpu hands the work to MLX's CPU command encoder.

#include "decode_ops.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include "kernels.h"
#include "mlx_glue.h"

namespace arbor {
namespace {

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream s, float scale, bool causal, int64_t window)
      : mx::UnaryPrimitive(s), scale_(scale), causal_(causal), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    alloc_out(out);
    register_io(stream(), inputs, out);
    const float scale = scale_;
    const bool causal = causal_;
    const int64_t window = window_;
    mx::cpu::get_command_encoder(stream()).dispatch(
        [q = mx::array::unsafe_weak_copy(inputs[0]), k = mx::array::unsafe_weak_copy(inputs[1]),
         v = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out),
         scale, causal, window]() mutable {
          if (out.size() == 0) return;
          std::vector<char> qs, ks, vs;
          attention(view_of(q, qs), view_of(k, ks), view_of(v, vs), q.shape(0), q.shape(1),
                    k.shape(1), q.shape(2), k.shape(2), q.shape(3), v.shape(3), scale, causal,
                    window, out.data<float>());
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.attention] has no GPU implementation.");
  }
  const char* name() const override { return "ArborAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && window_ == o.window_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1), inputs[0].shape(2), inputs[2].shape(3)}};
  }

 private:
  float scale_;
  bool causal_;
  int64_t window_;
};

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    alloc_out(out);
    register_io(stream(), inputs, out);
    const float eps = eps_;
    const bool weighted = inputs.size() > 1;
    mx::cpu::get_command_encoder(stream()).dispatch(
        [x = mx::array::unsafe_weak_copy(inputs[0]),
         w = mx::array::unsafe_weak_copy(inputs[weighted ? 1 : 0]),
         out = mx::array::unsafe_weak_copy(out), eps, weighted]() mutable {
          if (out.size() == 0) return;
          std::vector<char> xs, ws;
          const float* xp = contiguous_floats(x, xs);
          const float* wp = weighted ? contiguous_floats(w, ws) : nullptr;
          const int64_t H = x.shape(-1);
          rms_norm(xp, H, static_cast<int64_t>(x.size()) / H, H, wp, eps, out.data<float>());
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.rms_norm] has no GPU implementation.");
  }
  const char* name() const override { return "ArborRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

class CausalSoftmax : public mx::UnaryPrimitive {
 public:
  CausalSoftmax(mx::Stream s, int64_t window) : mx::UnaryPrimitive(s), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    alloc_out(out);
    register_io(stream(), inputs, out);
    const int64_t window = window_;
    mx::cpu::get_command_encoder(stream()).dispatch(
        [x = mx::array::unsafe_weak_copy(inputs[0]), out = mx::array::unsafe_weak_copy(out),
         window]() mutable {
          if (out.size() == 0) return;
          std::vector<char> xs;
          const float* xp = contiguous_floats(x, xs);
          const int64_t L = x.shape(-1), M = x.shape(-2);
          causal_softmax(xp, static_cast<int64_t>(x.size()) / L, M, L, window,
                         out.data<float>());
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.causal_softmax] has no GPU implementation.");
  }
  const char* name() const override { return "ArborCausalSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return window_ == static_cast<const CausalSoftmax&>(other).window_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int64_t window_;
};

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream s, int dims, int64_t offset, float scale)
      : mx::UnaryPrimitive(s), dims_(dims), offset_(offset), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    alloc_out(out);
    register_io(stream(), inputs, out);
    const int dims = dims_;
    const int64_t offset = offset_;
    const float scale = scale_;
    mx::cpu::get_command_encoder(stream()).dispatch(
        [x = mx::array::unsafe_weak_copy(inputs[0]), f = mx::array::unsafe_weak_copy(inputs[1]),
         out = mx::array::unsafe_weak_copy(out), dims, offset, scale]() mutable {
          if (out.size() == 0) return;
          std::vector<char> xs, fs;
          const float* fp = contiguous_floats(f, fs);
          rope(view_of(x, xs), x.shape(0), x.shape(1), x.shape(2), x.shape(3), dims, offset,
               scale, fp, out.data<float>());
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.rope] has no GPU implementation.");
  }
  const char* name() const override { return "ArborRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && offset_ == o.offset_ && scale_ == o.scale_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  int64_t offset_;
  float scale_;
};

class SiluMul : public mx::UnaryPrimitive {
 public:
  explicit SiluMul(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    alloc_out(out);
    register_io(stream(), inputs, out);
    mx::cpu::get_command_encoder(stream()).dispatch(
        [g = mx::array::unsafe_weak_copy(inputs[0]), u = mx::array::unsafe_weak_copy(inputs[1]),
         out = mx::array::unsafe_weak_copy(out)]() mutable {
          if (out.size() == 0) return;
          // Rows read in place at their stride (the halves of a stacked gate/up product).
          const int64_t H = out.shape(-1), rows = static_cast<int64_t>(out.size()) / H;
          std::vector<char> gs, us;
          int64_t ldg = uniform_row_stride(g), ldu = uniform_row_stride(u);
          const float* gp = g.data<float>();
          const float* up = u.data<float>();
          if (ldg < 0) {
            gp = contiguous_floats(g, gs);
            ldg = H;
          }
          if (ldu < 0) {
            up = contiguous_floats(u, us);
            ldu = H;
          }
          silu_mul(gp, ldg, up, ldu, rows, H, out.data<float>());
        });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.silu_mul] has no GPU implementation.");
  }
  const char* name() const override { return "ArborSiluMul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

void require_f32(const char* op, const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32)
    throw std::invalid_argument(std::string("[arbor.") + op + "] expected float32 " + what +
                                ", got " + dtype_str(a.dtype()) + " " + shape_str(a) + ".");
}

}  // namespace

mx::array causal_softmax(const mx::array& x, int64_t window, mx::StreamOrDevice s) {
  require_f32("causal_softmax", x, "scores");
  if (x.ndim() < 2 || x.shape(-1) < x.shape(-2) || window < 0)
    throw std::invalid_argument("[arbor.causal_softmax] expected scores (..., M, L) with L >= M "
                                "and window >= 0; got " + shape_str(x) + ".");
  return mx::array(x.shape(), mx::float32, std::make_shared<CausalSoftmax>(cpu_stream(s), window),
                   {x});
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    bool causal, int64_t window, mx::StreamOrDevice s) {
  for (auto [a, what] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}})
    require_f32("attention", *a, what);
  const bool ok = q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && k.shape(0) == q.shape(0) &&
      v.shape(0) == q.shape(0) && k.shape(1) == v.shape(1) && k.shape(1) > 0 &&
      q.shape(1) % k.shape(1) == 0 && k.shape(2) == v.shape(2) && k.shape(3) == q.shape(3) &&
      (!causal || k.shape(2) >= q.shape(2)) && window >= 0 && (window == 0 || causal);
  if (!ok)
    throw std::invalid_argument(
        "[arbor.attention] expected q (B, Hq, M, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv) with "
        "Hq a multiple of Hkv (and L >= M when causal; a window only when causal); got q " +
        shape_str(q) + ", k " +
        shape_str(k) + ", v " + shape_str(v) + ".");
  mx::Shape shape{q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  return mx::array(shape, mx::float32, std::make_shared<Attention>(cpu_stream(s), scale, causal, window),
                   {q, k, v});
}

mx::array rms_norm(const mx::array& x, const mx::array* weight, float eps, mx::StreamOrDevice s) {
  require_f32("rms_norm", x, "x");
  if (x.ndim() < 1 || x.shape(-1) == 0)
    throw std::invalid_argument("[arbor.rms_norm] expected x (..., H), got " + shape_str(x) + ".");
  std::vector<mx::array> inputs{x};
  if (weight != nullptr) {
    require_f32("rms_norm", *weight, "weight");
    if (weight->ndim() != 1 || weight->shape(0) != x.shape(-1))
      throw std::invalid_argument("[arbor.rms_norm] weight " + shape_str(*weight) +
                                  " does not match x " + shape_str(x) + ".");
    inputs.push_back(*weight);
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(cpu_stream(s), eps),
                   std::move(inputs));
}

mx::array rope(const mx::array& x, int dims, int64_t offset, float scale,
               const mx::array& inv_freqs, mx::StreamOrDevice s) {
  require_f32("rope", x, "x");
  require_f32("rope", inv_freqs, "inv_freqs");
  if (x.ndim() != 4 || dims <= 0 || dims % 2 != 0 || dims > x.shape(3) || inv_freqs.ndim() != 1 ||
      inv_freqs.shape(0) != dims / 2)
    throw std::invalid_argument("[arbor.rope] expected x (N0, N1, T, D), an even dims <= D and "
                                "inv_freqs (dims / 2,); got x " + shape_str(x) + ", dims " +
                                std::to_string(dims) + ", inv_freqs " + shape_str(inv_freqs) +
                                ".");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(cpu_stream(s), dims, offset, scale), {x, inv_freqs});
}

mx::array silu_mul(const mx::array& g, const mx::array& u, mx::StreamOrDevice s) {
  require_f32("silu_mul", g, "g");
  require_f32("silu_mul", u, "u");
  if (g.shape() != u.shape())
    throw std::invalid_argument("[arbor.silu_mul] g " + shape_str(g) + " and u " + shape_str(u) +
                                " differ in shape.");
  return mx::array(g.shape(), mx::float32, std::make_shared<SiluMul>(cpu_stream(s)), {g, u});
}

}  // namespace arbor

// Arbor's native MLX CPU primitives for decode-time matrix-vector products.
//
//   matvec(x, w)                          x (..., K) f32, w (N, K) f32/bf16/f16 -> (..., N) f32 = x @ w.T
//   matvec_q(x, wq, scales, biases, gs, bits)
//                                         same with w in MLX's affine quantized layout
//
// Both are MLX primitives: building them only records a graph node; eval_cpu
// runs when MLX evaluates the graph and hands the work to MLX's CPU command
// encoder, so they compose with other ops, mx.compile and mx.async_eval. The
// arithmetic lives in kernels.cpp / kernels_impl.h.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/transforms.h"
#include "mlx/utils.h"
#include "mlx/version.h"

#include "decode_ops.h"
#include "gather_ops.h"
#include "layer_ops.h"
#include "kernels.h"
#include "mlx_glue.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace arbor {
namespace {

// ---------------------------------------------------------------------------

class Matvec : public mx::UnaryPrimitive {
 public:
  explicit Matvec(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    alloc_out(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_input_array(w);
    enc.set_output_array(out);
    const int64_t K = w.shape(1), N = dense_outputs(w);
    const int64_t M = N > 0 ? static_cast<int64_t>(out.size()) / N : 0;
    enc.dispatch([x = mx::array::unsafe_weak_copy(x),
                  w = mx::array::unsafe_weak_copy(w),
                  out = mx::array::unsafe_weak_copy(out), M, K, N]() mutable {
      if (out.size() == 0) return;
      std::vector<char> xs;
      dense_product(K > 0 ? x_rows(x, xs) : nullptr, M, K, w, out.data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.matvec] has no GPU implementation.");
  }

  const char* name() const override { return "ArborMatvec"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = static_cast<int>(dense_outputs(inputs[1]));
    return {s};
  }
};

class QuantizedMatvec : public mx::UnaryPrimitive {
 public:
  QuantizedMatvec(mx::Stream s, int group_size, int bits, bool int8_inputs)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits), int8_inputs_(int8_inputs) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& wq = inputs[1];
    const auto& scales = inputs[2];
    const auto& biases = inputs[3];
    alloc_out(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    const int64_t N = wq.shape(0);
    const int64_t K = x.shape(-1);
    const int64_t M = N > 0 ? static_cast<int64_t>(out.size()) / N : 0;
    const int gs = group_size_, bits = bits_;
    const bool int8_inputs = int8_inputs_;
    enc.dispatch([x = mx::array::unsafe_weak_copy(x),
                  wq = mx::array::unsafe_weak_copy(wq),
                  sc = mx::array::unsafe_weak_copy(scales),
                  bi = mx::array::unsafe_weak_copy(biases),
                  out = mx::array::unsafe_weak_copy(out), M, K, N, gs, bits,
                  int8_inputs]() mutable {
      if (out.size() == 0) return;
      std::vector<char> xs;
      quantized_product(K > 0 ? x_rows(x, xs) : nullptr, M, K, wq, sc, bi, gs, bits,
                        out.data<float>(), int8_inputs);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.matvec_q] has no GPU implementation.");
  }

  const char* name() const override { return "ArborQuantizedMatvec"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatvec&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && int8_inputs_ == o.int8_inputs_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = inputs[1].shape(0);
    return {s};
  }

 private:
  int group_size_;
  int bits_;
  bool int8_inputs_;
};

class Dequantize : public mx::UnaryPrimitive {
 public:
  Dequantize(mx::Stream s, int group_size, int bits)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    alloc_out(out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    const int gs = group_size_, bits = bits_;
    enc.dispatch([wq = mx::array::unsafe_weak_copy(inputs[0]),
                  sc = mx::array::unsafe_weak_copy(inputs[1]),
                  bi = mx::array::unsafe_weak_copy(inputs[2]),
                  out = mx::array::unsafe_weak_copy(out), gs, bits]() mutable {
      if (out.size() == 0) return;
      std::vector<char> qs, ss, bs;
      int64_t ldq = 0, lds = 0;
      const void* qp = rows_of(wq, ldq, qs);
      const float *sp = nullptr, *bp = nullptr;
      scale_bias_rows(sc, bi, sp, bp, lds, ss, bs);
      dequantize(static_cast<const uint32_t*>(qp), ldq, sp, bp, lds, gs, bits, out.shape(0),
                 out.shape(1), out.data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.dequantize] has no GPU implementation.");
  }

  const char* name() const override { return "ArborDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Dequantize&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1) * 32 / bits_}};
  }

 private:
  int group_size_;
  int bits_;
};

}  // namespace

// ---------------------------------------------------------------------------
// Ops (graph construction; shapes and dtypes are checked here, eagerly).

mx::array matvec(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {}) {
  if (x.ndim() < 1 || (w.ndim() != 2 && !is_panels(w)) || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument(
        "[arbor.matvec] expected x (..., K) and w (N, K) or float32 panels (N / 16, K, 16), "
        "got x " + shape_str(x) +
        " and w " + shape_str(w) + ".");
  }
  const auto wt = w.dtype();
  if (x.dtype() != mx::float32 ||
      (wt != mx::float32 && wt != mx::bfloat16 && wt != mx::float16)) {
    throw std::invalid_argument(
        "[arbor.matvec] expected float32 x and float32, bfloat16 or float16 w, got " +
        dtype_str(x.dtype()) +
        " x " + shape_str(x) + " and " + dtype_str(w.dtype()) + " w " + shape_str(w) + ".");
  }
  mx::Shape out_shape = x.shape();
  out_shape.back() = static_cast<int>(dense_outputs(w));
  return mx::array(out_shape, mx::float32, std::make_shared<Matvec>(cpu_stream(s)), {x, w});
}

mx::array matvec_q(
    const mx::array& x, const mx::array& wq, const mx::array& scales,
    const mx::array& biases, int group_size, int bits, bool int8_inputs = false,
    mx::StreamOrDevice s = {}) {
  if (int8_inputs && !int8_inputs_supported(bits, group_size)) {
    throw std::invalid_argument("[arbor.matvec_q] " + int8_inputs_refusal(bits, group_size));
  }
  if (!quantized_layout_supported(bits, group_size)) {
    throw std::invalid_argument("[arbor.matvec_q] " + quantized_layout_refusal(bits, group_size));
  }
  const bool ranks = x.ndim() >= 1 && wq.ndim() == 2 && scales.ndim() == 2 && biases.ndim() == 2;
  const int64_t K = x.ndim() >= 1 ? x.shape(-1) : -1;
  const bool shapes = ranks && K % group_size == 0 &&
      static_cast<int64_t>(wq.shape(1)) * 32 / bits == K &&
      scales.shape(0) == wq.shape(0) && scales.shape(1) == K / group_size &&
      biases.shape() == scales.shape();
  if (!shapes) {
    throw std::invalid_argument(
        "[arbor.matvec_q] expected x (..., K), wq (N, K*bits/32), scales and biases "
        "(N, K/group_size) with K a multiple of group_size; got x " + shape_str(x) +
        ", wq " + shape_str(wq) + ", scales " + shape_str(scales) + ", biases " +
        shape_str(biases) + " for bits=" + std::to_string(bits) +
        ", group_size=" + std::to_string(group_size) + ".");
  }
  if (x.dtype() != mx::float32 || wq.dtype() != mx::uint32 ||
      scales.dtype() != mx::float32 || biases.dtype() != mx::float32) {
    throw std::invalid_argument(
        "[arbor.matvec_q] expected float32 x, uint32 wq and float32 scales/biases; got " +
        dtype_str(x.dtype()) + " x " + shape_str(x) + ", " + dtype_str(wq.dtype()) +
        " wq " + shape_str(wq) + ", " + dtype_str(scales.dtype()) + " scales, " +
        dtype_str(biases.dtype()) + " biases.");
  }
  mx::Shape out_shape = x.shape();
  out_shape.back() = wq.shape(0);
  return mx::array(
      out_shape, mx::float32,
      std::make_shared<QuantizedMatvec>(cpu_stream(s), group_size, bits, int8_inputs),
      {x, wq, scales, biases});
}

mx::array dequantize(const mx::array& wq, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits, mx::StreamOrDevice s = {}) {
  const bool ok = quantized_layout_supported(bits, group_size) && wq.ndim() == 2 &&
      scales.ndim() == 2 && biases.shape() == scales.shape() && wq.dtype() == mx::uint32 &&
      scales.dtype() == mx::float32 && biases.dtype() == mx::float32 &&
      scales.shape(0) == wq.shape(0) &&
      static_cast<int64_t>(scales.shape(1)) * group_size ==
          static_cast<int64_t>(wq.shape(1)) * 32 / bits;
  if (!ok) {
    throw std::invalid_argument(
        "[arbor.dequantize] expected uint32 wq (N, K*bits/32) and float32 scales / biases "
        "(N, K/group_size), bits 4 or 8 in groups of 32/64/128 or 8 in groups of 16; got wq " +
        shape_str(wq) + " " +
        dtype_str(wq.dtype()) + ", scales " + shape_str(scales) + " " +
        dtype_str(scales.dtype()) + ", biases " + shape_str(biases) + " for bits=" +
        std::to_string(bits) + ", group_size=" + std::to_string(group_size) + ".");
  }
  mx::Shape shape{wq.shape(0), static_cast<int>(static_cast<int64_t>(wq.shape(1)) * 32 / bits)};
  return mx::array(shape, mx::float32,
                   std::make_shared<Dequantize>(cpu_stream(s), group_size, bits),
                   {wq, scales, biases});
}

}  // namespace arbor

#define ARBOR_STR2(x) #x
#define ARBOR_STR(x) ARBOR_STR2(x)

NB_MODULE(_arbor_kernels, m) {
  nb::module_::import_("mlx.core");  // registers mlx.core.array with nanobind
  m.doc() = "Arbor's native MLX CPU matrix-vector kernels.";

  m.def("matvec",
        [](const mx::array& x, const mx::array& w) { return arbor::matvec(x, w); },
        nb::arg("x"), nb::arg("w"),
        "x (..., K) float32 @ w.T for w (N, K) float32, bfloat16 or float16 "
        "-> (..., N) float32 (16-bit weights are widened exactly; float32 sums).");
  m.def("matvec_q",
        [](const mx::array& x, const mx::array& wq, const mx::array& scales,
           const mx::array& biases, int group_size, int bits, bool int8_inputs) {
          return arbor::matvec_q(x, wq, scales, biases, group_size, bits, int8_inputs);
        },
        nb::arg("x"), nb::arg("wq"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("int8_inputs") = false,
        "Same as mx.quantized_matmul(x, wq, scales, biases, transpose=True, "
        "group_size, bits) for float32 x, scales and biases; bits 4 or 8. int8_inputs: "
        "x rounded to int8 per block of 64 first (4-bit weights, groups of 64 or 128): "
        "1.5x as fast (2x cache-resident), ~2% relative error; for draft models.");
  m.def("dequantize",
        [](const mx::array& wq, const mx::array& scales, const mx::array& biases, int group_size,
           int bits) { return arbor::dequantize(wq, scales, biases, group_size, bits); },
        nb::arg("wq"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
        nb::arg("bits"),
        "mx.dequantize for MLX's affine layout (float32 scales and biases, bits 4 or 8) -> "
        "float32, threaded.");
  m.def("silu_mul",
        [](const mx::array& g, const mx::array& u) { return arbor::silu_mul(g, u); },
        nb::arg("g"), nb::arg("u"), "silu(g) * u for float32 g and u of one shape.");
  m.def("attention",
        [](const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
           int64_t window) {
          return arbor::attention(q, k, v, scale, causal, window);
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("causal"),
        nb::arg("window") = 0,
        "softmax(scale * q @ k.T [causal, aligned to the last key; only the last `window` keys "
        "when window > 0]) @ v for float32 q (B, Hq, M, D), k (B, Hkv, L, D), "
        "v (B, Hkv, L, Dv) -> (B, Hq, M, Dv).");
  m.def("key_rows",
        [](const mx::array& x, const mx::array& w) {
          if (x.ndim() != 2 || w.ndim() != 2 || x.shape(1) != w.shape(1) ||
              x.dtype() != mx::float32 || w.dtype() != mx::float32)
            throw std::invalid_argument("[arbor.key_rows] expected float32 x (M, K), w (N, K)");
          mx::array xr = mx::contiguous(x), wr = mx::contiguous(w);
          mx::eval({xr, wr});
          const int64_t M = x.shape(0), K = x.shape(1), N = w.shape(0);
          std::vector<float> out(static_cast<size_t>(M * N));
          if (M > 0 && N > 0)
            arbor::best_isa().key_rows(xr.data<float>(), K, M, K, wr.data<float>(), K,
                                       out.data(), N, 0, N);
          return mx::array(out.begin(), mx::Shape{static_cast<int>(M), static_cast<int>(N)},
                           mx::float32);
        },
        nb::arg("x"), nb::arg("w"),
        "x @ w.T for float32 x (M, K), w (N, K) through the attention-scores kernel, at once "
        "(not lazily): the tests hold it to matvec's result bit for bit.");
  m.def("causal_softmax",
        [](const mx::array& x, int64_t window) { return arbor::causal_softmax(x, window); },
        nb::arg("x"), nb::arg("window") = 0,
        "Causal softmax over the last axis of float32 scores (..., M, L), aligned to the last "
        "key (query m sees keys 0 .. L - M + m; the last `window` of them if window > 0).");
  m.def("rms_norm",
        [](const mx::array& x, std::optional<mx::array> w, float eps) {
          return arbor::rms_norm(x, w ? &*w : nullptr, eps);
        },
        nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"),
        "mx.fast.rms_norm for float32 x (..., H) and weight (H,) or None.");
  m.def("rope",
        [](const mx::array& x, int dims, int64_t offset, float scale, const mx::array& inv_freqs) {
          return arbor::rope(x, dims, offset, scale, inv_freqs);
        },
        nb::arg("x"), nb::arg("dims"), nb::arg("offset"), nb::arg("scale"), nb::arg("inv_freqs"),
        "Non-traditional RoPE of float32 x (N0, N1, T, D) at an integer offset: angle i of the row "
        "at position p is (p * scale) * inv_freqs[i].");
  m.def("attention_inputs",
        [](const mx::array& x, const mx::array& norm_weight, float eps,
           const arbor::WeightArg& qkv, int heads, int kv_heads, int head_dim, int rope_dims,
           const std::vector<int64_t>& offsets, const std::vector<int64_t>& rows,
           float rope_scale, const mx::array& inv_freqs) {
          return arbor::attention_inputs(x, norm_weight, eps, qkv, heads, kv_heads, head_dim,
                                         rope_dims, offsets, rows, rope_scale, inv_freqs);
        },
        nb::arg("x"), nb::arg("norm_weight"), nb::arg("eps"), nb::arg("qkv"), nb::arg("heads"),
        nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("rope_dims"), nb::arg("offsets"),
        nb::arg("rows"), nb::arg("rope_scale"), nb::arg("inv_freqs"),
        "[q, k_1, v_1, ...] of a pre-norm attention layer for float32 x (B, N, H): RMS norm, "
        "the stacked q/k/v product, RoPE of q and k; segment s is rows[s] rows at positions "
        "offsets[s] + t with its own k and v. A weight is (arrays, bits, group_size, "
        "int8_inputs).");
  m.def("attention_mlp",
        [](const mx::array& q, const std::vector<mx::array>& keys,
           const std::vector<mx::array>& values, const std::vector<int64_t>& lengths,
           const std::vector<int64_t>& rows, float scale, int64_t window, const mx::array& x,
           const mx::array& norm_weight, float eps, const arbor::WeightArg& o,
           const arbor::WeightArg& gate_up, const arbor::WeightArg& down) {
          return arbor::attention_mlp(q, keys, values, lengths, rows, scale, window, x,
                                      norm_weight, eps, o, gate_up, down);
        },
        nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("lengths"), nb::arg("rows"),
        nb::arg("scale"), nb::arg("window"), nb::arg("x"), nb::arg("norm_weight"),
        nb::arg("eps"), nb::arg("o"), nb::arg("gate_up"), nb::arg("down"),
        "Per segment, causal attention over the first `lengths[s]` positions of its cache's key "
        "/ value buffers, then the rest of a pre-norm layer over every row: x + o(attn) -> h, "
        "h + down(silu(gate) * up) of the RMS-normed h.");
  m.def("gather_matvec",
        [](const mx::array& x, const mx::array& w, const mx::array& indices) {
          return arbor::gather_matvec(x, w, indices);
        },
        nb::arg("x"), nb::arg("w"), nb::arg("indices"),
        "Row r of float32 x (..., K) @ w[indices[r]].T for w (E, N, K) float32, bfloat16 or "
        "float16 and int32 / uint32 indices of x's leading shape -> (..., N) float32.");
  m.def("gather_matvec_q",
        [](const mx::array& x, const mx::array& wq, const mx::array& scales,
           const mx::array& biases, const mx::array& indices, int group_size, int bits) {
          return arbor::gather_matvec_q(x, wq, scales, biases, indices, group_size, bits);
        },
        nb::arg("x"), nb::arg("wq"), nb::arg("scales"), nb::arg("biases"), nb::arg("indices"),
        nb::arg("group_size"), nb::arg("bits"),
        "gather_matvec for stacked weights in MLX's affine layout: uint32 wq (E, N, K*bits/32), "
        "float32 scales and biases (E, N, K/group_size), bits 4 or 8.");
  m.def("clone_level", [] { return std::string(arbor::clone_level()); },
        "Which clone of the vectorized helpers this CPU runs (high, mid, baseline, none).");
  m.def("isa", [] { return std::string(arbor::best_isa().name); },
        "Instruction set the kernels use on this CPU.");
  m.def("max_threads", &arbor::max_threads, "Threads a large product may use.");
  m.def("set_max_threads", &arbor::set_max_threads, nb::arg("n"),
        "Cap the threads (n <= 0: back to ARBOR_MATVEC_THREADS or the core count).");
  m.def("runtime_mlx_version", [] { return std::string(mx::version()); });
  m.attr("built_for_mlx") = ARBOR_STR(MLX_VERSION_MAJOR) "." ARBOR_STR(
      MLX_VERSION_MINOR) "." ARBOR_STR(MLX_VERSION_PATCH);
}

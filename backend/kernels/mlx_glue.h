// Small helpers shared by the MLX primitives (matvec.cpp, decode_ops.cpp, layer_ops.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

#include "kernels.h"

namespace arbor {
namespace mx = mlx::core;

inline std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < a.ndim(); ++i) os << (i ? ", " : "") << a.shape(i);
  if (a.ndim() == 1) os << ",";
  os << ")";
  return os.str();
}

inline std::string dtype_str(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  if (t == mx::bfloat16) return "bfloat16";
  if (t == mx::uint32) return "uint32";
  if (t == mx::int32) return "int32";
  return "dtype size " + std::to_string(t.size());
}

inline mx::Stream cpu_stream(mx::StreamOrDevice s) {
  mx::Stream st = mx::to_stream(s);
  if (st.device.type != mx::Device::DeviceType::cpu)
    st = mx::default_stream(mx::Device(mx::Device::DeviceType::cpu));
  return st;
}

// Copies an arbitrarily strided array into `dst`, row-major: a memcpy per run of
// the last dimension when it is unit-stride (slices, split outputs), element by
// element otherwise.
inline void gather(const mx::array& a, void* dst) {
  const char* base = a.data<char>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = a.ndim();
  const size_t isz = a.itemsize();
  auto* out = static_cast<char*>(dst);
  if (a.size() == 0) return;
  if (nd == 0) {
    std::memcpy(out, base, isz);
    return;
  }
  const bool unit_rows = strides[nd - 1] == 1 || shape[nd - 1] == 1;
  const int64_t run = unit_rows ? shape[nd - 1] : 1;  // elements copied per step
  const int outer = unit_rows ? nd - 1 : nd;          // dims walked one index at a time
  const size_t steps = a.size() / static_cast<size_t>(run);
  std::vector<int64_t> idx(outer, 0);
  for (size_t i = 0; i < steps; ++i) {
    int64_t off = 0;
    for (int d = 0; d < outer; ++d) off += idx[d] * strides[d];
    std::memcpy(out + i * run * isz, base + off * static_cast<int64_t>(isz), run * isz);
    for (int d = outer - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

// The stride between consecutive rows (runs of the last dimension) when `a`
// is such rows at one uniform stride with unit last stride (e.g. a split of a
// contiguous array along its last axis); -1 otherwise.
inline int64_t uniform_row_stride(const mx::array& a) {
  const int nd = a.ndim();
  if (nd == 0 || (a.strides()[nd - 1] != 1 && a.shape(nd - 1) > 1)) return -1;
  if (nd == 1) return a.shape(0);
  const int64_t ld = a.strides()[nd - 2];
  int64_t expect = ld;
  for (int d = nd - 2; d >= 0; --d) {
    if (a.shape(d) > 1 && a.strides()[d] != expect) return -1;
    expect *= a.shape(d);
  }
  return ld;
}

inline void alloc_out(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
}

// A 2-D operand as (pointer, row stride in elements), copying it into `scratch`
// when its rows are not unit-stride.
inline const void* rows_of(const mx::array& a, int64_t& ld, std::vector<char>& scratch) {
  const int64_t cols = a.shape(-1);
  if (a.flags().row_contiguous) {
    ld = cols;
    return a.data<char>();
  }
  if (a.ndim() == 2 && (a.strides()[1] == 1 || cols == 1) && a.strides()[0] >= cols) {
    ld = a.shape(0) == 1 ? cols : a.strides()[0];
    return a.data<char>();
  }
  scratch.resize(a.nbytes());
  gather(a, scratch.data());
  ld = cols;
  return scratch.data();
}

// Quantization scales and biases as rows with one shared stride (the kernels
// walk both with it), copying them when their strides differ.
inline void scale_bias_rows(const mx::array& sc, const mx::array& bi, const float*& sp,
                     const float*& bp, int64_t& ld, std::vector<char>& ss,
                     std::vector<char>& bs) {
  int64_t lds = 0, ldb = 0;
  sp = static_cast<const float*>(rows_of(sc, lds, ss));
  bp = static_cast<const float*>(rows_of(bi, ldb, bs));
  ld = lds;
  if (lds != ldb) {
    ss.resize(sc.nbytes());
    gather(sc, ss.data());
    bs.resize(bi.nbytes());
    gather(bi, bs.data());
    sp = reinterpret_cast<const float*>(ss.data());
    bp = reinterpret_cast<const float*>(bs.data());
    ld = sc.shape(-1);
  }
}

// The M x K rows of x (any leading dims), contiguous.
inline const float* x_rows(const mx::array& x, std::vector<char>& scratch) {
  if (x.flags().row_contiguous) return x.data<float>();
  scratch.resize(x.nbytes());
  gather(x, scratch.data());
  return reinterpret_cast<const float*>(scratch.data());
}

// Whether a dense weight is float32 panels (N / kPanel, K, kPanel), not an (N, K) matrix.
inline bool is_panels(const mx::array& w) {
  return w.ndim() == 3 && w.shape(2) == kPanel && w.dtype() == mx::float32;
}

// The outputs of a dense weight: N of an (N, K) matrix or of its panels.
inline int64_t dense_outputs(const mx::array& w) {
  return w.ndim() == 3 ? w.shape(0) * w.shape(2) : w.shape(0);
}

// out (M x N) = x (M x K rows, contiguous) @ w.T for a dense w (N x K: float32,
// bfloat16 or float16, or float32 panels); the product every dense matvec primitive runs.
inline void dense_product(const float* x, int64_t M, int64_t K, const mx::array& w, float* out) {
  const int64_t N = dense_outputs(w);
  if (M == 0 || N == 0) return;
  std::vector<char> ws;
  if (w.ndim() == 3) {
    const float* panels = w.flags().row_contiguous ? w.data<float>() : nullptr;
    if (panels == nullptr) {
      ws.resize(w.nbytes());
      gather(w, ws.data());
      panels = reinterpret_cast<const float*>(ws.data());
    }
    matvec_panels(x, K, M, K, panels, N, out);
    return;
  }
  int64_t ldw = K;
  const void* wp = K > 0 ? rows_of(w, ldw, ws) : nullptr;
  const WType wt = w.dtype() == mx::bfloat16 ? WType::bf16
      : w.dtype() == mx::float16             ? WType::f16
                                             : WType::f32;
  matvec_dense(x, K, M, K, wp, wt, ldw, N, out);
}

// Whether the quantized kernels take MLX affine weights of this kind: 4- or 8-bit codes in
// groups of 32, 64 or 128, or 8-bit codes in groups of 16 (GGUF K-quant sub-blocks; the 8-bit
// loops step through a group one vector at a time, and a vector is at most 16 floats).
inline bool quantized_layout_supported(int bits, int group_size) {
  return ((bits == 4 || bits == 8) &&
          (group_size == 32 || group_size == 64 || group_size == 128)) ||
         (bits == 8 && group_size == 16);
}

// The primitives' shared message for a layout they do not take.
inline std::string quantized_layout_refusal(int bits, int group_size) {
  return "quantized weights must be 4- or 8-bit codes in groups of 32, 64 or 128, or 8-bit "
         "codes in groups of 16; got bits=" + std::to_string(bits) + ", group_size=" +
         std::to_string(group_size) + ".";
}

// Whether the int8-input kernel takes weights of this kind (matvec_q4_int8_inputs).
inline bool int8_inputs_supported(int bits, int group_size) {
  return bits == 4 && (group_size == 64 || group_size == 128);
}

// Why int8 inputs do not apply to weights of this kind (the primitives' shared message).
inline std::string int8_inputs_refusal(int bits, int group_size) {
  return "int8 inputs need 4-bit weights in groups of 64 or 128, got bits=" +
         std::to_string(bits) + ", group_size=" + std::to_string(group_size) + ".";
}

// The same for w in MLX's affine quantized layout (uint32 wq, float32 scales / biases);
// int8_inputs: x rounded to int8 first (4-bit weights, group_size 64 or 128: callers check).
inline void quantized_product(const float* x, int64_t M, int64_t K, const mx::array& wq,
                              const mx::array& sc, const mx::array& bi, int group_size, int bits,
                              float* out, bool int8_inputs = false) {
  const int64_t N = wq.shape(0);
  if (M == 0 || N == 0) return;
  std::vector<char> qs, ss, bs;
  int64_t ldq = 0, lds = 0;
  const void* qp = K > 0 ? rows_of(wq, ldq, qs) : nullptr;
  const float *sp = nullptr, *bp = nullptr;
  if (K > 0) scale_bias_rows(sc, bi, sp, bp, lds, ss, bs);
  const auto* packed = reinterpret_cast<const uint8_t*>(qp);
  if (int8_inputs)
    matvec_q4_int8_inputs(x, K, M, K, packed, ldq * 4, sp, bp, lds, group_size, N, out);
  else
    matvec_q(x, K, M, K, packed, ldq * 4, sp, bp, lds, group_size, bits, N, out);
}

// A float32 operand of rank 3 or 4 with unit last stride, as a View3 over its
// last three (rank 4) or last two (rank 3) dims; copied when needed.
inline View3 view_of(const mx::array& a, std::vector<char>& scratch) {
  const int nd = a.ndim();
  const float* p = a.data<float>();
  std::vector<int64_t> st(a.strides().begin(), a.strides().end());
  if (st.back() != 1 && a.shape(-1) > 1) {
    scratch.resize(a.nbytes());
    gather(a, scratch.data());
    p = reinterpret_cast<const float*>(scratch.data());
    int64_t acc = 1;
    for (int d = nd - 1; d >= 0; --d) {
      st[d] = acc;
      acc *= a.shape(d);
    }
  }
  if (nd == 4) return View3{p, st[0], st[1], st[2]};
  return View3{p, 0, st[0], st[1]};
}

// The elements of a float32 array in row-major order (copied when strided).
inline const float* contiguous_floats(const mx::array& a, std::vector<char>& scratch) {
  if (a.flags().row_contiguous) return a.data<float>();
  scratch.resize(a.nbytes());
  gather(a, scratch.data());
  return reinterpret_cast<const float*>(scratch.data());
}

inline void register_io(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
}

// The same for a primitive with several outputs.
inline void register_io(mx::Stream stream, const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& a : outputs) enc.set_output_array(a);
}

}  // namespace arbor

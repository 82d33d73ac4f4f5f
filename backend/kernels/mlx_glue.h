// Small helpers shared by the MLX primitives (matvec.cpp, decode_ops.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

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

}  // namespace arbor

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

// Copies an arbitrarily strided array into `dst`, row-major.
inline void gather(const mx::array& a, void* dst) {
  const char* base = a.data<char>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = a.ndim();
  const size_t isz = a.itemsize();
  auto* out = static_cast<char*>(dst);
  const size_t total = a.size();
  std::vector<int64_t> idx(nd, 0);
  for (size_t i = 0; i < total; ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * strides[d];
    std::memcpy(out + i * isz, base + off * static_cast<int64_t>(isz), isz);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

inline void alloc_out(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
}

}  // namespace arbor

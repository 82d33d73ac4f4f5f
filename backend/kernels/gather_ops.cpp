// MLX glue for the gathered matrix-vector products (gather_ops.h): rows are grouped by the
// matrix they pick, and each group runs through the plain matvec drivers (kernels.cpp), so
// a row's result is what a one-row product with its matrix gives, bit for bit.

#include "gather_ops.h"

#include <algorithm>
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

// A stack of E matrices (E, N, C) as a base pointer with its expert and row strides in
// elements and unit last stride, copied when its layout is otherwise.
struct Stack {
  const char* p;
  int64_t s0, s1;
};

Stack stack_of(const mx::array& a, std::vector<char>& scratch) {
  const auto& st = a.strides();
  if (st[2] == 1 || a.shape(2) == 1) return {a.data<char>(), st[0], st[1]};
  scratch.resize(a.nbytes());
  gather(a, scratch.data());
  return {scratch.data(), static_cast<int64_t>(a.shape(1)) * a.shape(2), a.shape(2)};
}

// The row indices as int64, whatever their integer type and layout.
std::vector<int64_t> read_indices(const mx::array& idx) {
  std::vector<char> raw(idx.nbytes());
  gather(idx, raw.data());
  std::vector<int64_t> out(idx.size());
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = idx.dtype() == mx::uint32 ? reinterpret_cast<const uint32_t*>(raw.data())[i]
                                       : reinterpret_cast<const int32_t*>(raw.data())[i];
  return out;
}

// product(e, rows, count, out): `count` contiguous rows of x (K each) through matrix e into
// `count` contiguous output rows (N each).
template <typename Product>
void grouped_rows(const float* x, int64_t R, int64_t K, int64_t N, int64_t E,
                  const std::vector<int64_t>& ids, float* out, Product product) {
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t id : ids) ++count[(id >= 0 && id < E) ? id : E];
  if (count[E] > 0) {
    for (int64_t r = 0; r < R; ++r)
      if (ids[r] < 0 || ids[r] >= E) std::memset(out + r * N, 0, sizeof(float) * N);
  }
  std::vector<float> xs, ys;
  std::vector<int64_t> rows;
  for (int64_t e = 0; e < E; ++e) {
    if (count[e] == 0) continue;
    if (count[e] == R) {  // every row picks e: no copies
      product(e, x, R, out);
      continue;
    }
    rows.clear();
    for (int64_t r = 0; r < R; ++r)
      if (ids[r] == e) rows.push_back(r);
    const int64_t M = static_cast<int64_t>(rows.size());
    xs.resize(static_cast<size_t>(M * K));
    ys.resize(static_cast<size_t>(M * N));
    for (int64_t i = 0; i < M; ++i)
      std::memcpy(xs.data() + i * K, x + rows[i] * K, sizeof(float) * K);
    product(e, xs.data(), M, ys.data());
    for (int64_t i = 0; i < M; ++i)
      std::memcpy(out + rows[i] * N, ys.data() + i * N, sizeof(float) * N);
  }
}

class GatherMatvec : public mx::UnaryPrimitive {
 public:
  // bits 0: dense w; 4 or 8: MLX's affine layout (wq, scales, biases; quantized_layout_supported).
  GatherMatvec(mx::Stream s, int group_size, int bits)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    alloc_out(out);
    register_io(stream(), inputs, out);
    const int gs = group_size_, bits = bits_;
    std::vector<mx::array> in;
    for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
    mx::cpu::get_command_encoder(stream()).dispatch(
        [in = std::move(in), out = mx::array::unsafe_weak_copy(out), gs, bits]() mutable {
          if (out.size() == 0) return;
          const auto& x = in[0];
          const auto& w = in[1];
          const auto& idx = in.back();
          const int64_t K = x.shape(-1), N = out.shape(-1), E = w.shape(0);
          const int64_t R = static_cast<int64_t>(idx.size());
          std::vector<char> xs_scratch, ws, ss, bs;
          const float* xp = x_rows(x, xs_scratch);
          const std::vector<int64_t> ids = read_indices(idx);
          float* op = out.data<float>();
          const Stack wst = stack_of(w, ws);
          if (bits == 0) {
            const WType wt = w.dtype() == mx::bfloat16 ? WType::bf16
                : w.dtype() == mx::float16             ? WType::f16
                                                       : WType::f32;
            const int64_t esize = w.itemsize();
            grouped_rows(xp, R, K, N, E, ids, op,
                         [&](int64_t e, const float* rows, int64_t M, float* dst) {
                           matvec_dense(rows, K, M, K, wst.p + e * wst.s0 * esize, wt, wst.s1,
                                        N, dst);
                         });
            return;
          }
          Stack sc = stack_of(in[2], ss), bi = stack_of(in[3], bs);
          if (sc.s0 != bi.s0 || sc.s1 != bi.s1) {  // matvec_q walks both with one stride
            const int64_t groups = in[2].shape(2), rows = in[2].shape(1) * groups;
            ss.resize(in[2].nbytes());
            gather(in[2], ss.data());
            bs.resize(in[3].nbytes());
            gather(in[3], bs.data());
            sc = {ss.data(), rows, groups};
            bi = {bs.data(), rows, groups};
          }
          grouped_rows(xp, R, K, N, E, ids, op,
                       [&](int64_t e, const float* rows, int64_t M, float* dst) {
                         matvec_q(rows, K, M, K,
                                  reinterpret_cast<const uint8_t*>(wst.p + e * wst.s0 * 4),
                                  wst.s1 * 4,
                                  reinterpret_cast<const float*>(sc.p) + e * sc.s0,
                                  reinterpret_cast<const float*>(bi.p) + e * bi.s0, sc.s1, gs,
                                  bits, N, dst);
                       });
        });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[arbor.gather_matvec] has no GPU implementation.");
  }
  const char* name() const override { return "ArborGatherMatvec"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatherMatvec&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(1);
    return {shape};
  }

 private:
  int group_size_;
  int bits_;
};

void check_rows(const char* op, const mx::array& x, const mx::array& indices) {
  const bool ok = x.dtype() == mx::float32 && x.ndim() >= 1 &&
      (indices.dtype() == mx::int32 || indices.dtype() == mx::uint32) &&
      indices.ndim() == x.ndim() - 1 &&
      std::equal(indices.shape().begin(), indices.shape().end(), x.shape().begin());
  if (!ok)
    throw std::invalid_argument(
        std::string("[arbor.") + op + "] expected float32 x (..., K) and int32 or uint32 "
        "indices of x's leading shape; got x " + shape_str(x) + " " + dtype_str(x.dtype()) +
        " and indices " + shape_str(indices) + " " + dtype_str(indices.dtype()) + ".");
}

}  // namespace

mx::array gather_matvec(const mx::array& x, const mx::array& w, const mx::array& indices,
                        mx::StreamOrDevice s) {
  check_rows("gather_matvec", x, indices);
  const auto wt = w.dtype();
  if (w.ndim() != 3 || w.shape(2) != x.shape(-1) ||
      (wt != mx::float32 && wt != mx::bfloat16 && wt != mx::float16))
    throw std::invalid_argument(
        "[arbor.gather_matvec] expected w (E, N, K) float32, bfloat16 or float16 for x " +
        shape_str(x) + "; got w " + shape_str(w) + " " + dtype_str(wt) + ".");
  mx::Shape shape = x.shape();
  shape.back() = w.shape(1);
  return mx::array(shape, mx::float32, std::make_shared<GatherMatvec>(cpu_stream(s), 0, 0),
                   {x, w, indices});
}

mx::array gather_matvec_q(const mx::array& x, const mx::array& wq, const mx::array& scales,
                          const mx::array& biases, const mx::array& indices, int group_size,
                          int bits, mx::StreamOrDevice s) {
  check_rows("gather_matvec_q", x, indices);
  const int64_t K = x.shape(-1);
  const bool ok = quantized_layout_supported(bits, group_size) && K % group_size == 0 &&
      wq.ndim() == 3 && wq.dtype() == mx::uint32 &&
      static_cast<int64_t>(wq.shape(2)) * 32 / bits == K && scales.ndim() == 3 &&
      scales.dtype() == mx::float32 && biases.dtype() == mx::float32 &&
      biases.shape() == scales.shape() && scales.shape(0) == wq.shape(0) &&
      scales.shape(1) == wq.shape(1) && scales.shape(2) == K / group_size;
  if (!ok)
    throw std::invalid_argument(
        "[arbor.gather_matvec_q] expected uint32 wq (E, N, K*bits/32) and float32 scales / "
        "biases (E, N, K/group_size), 4/8 bits in groups of 32/64/128 or 8 in groups of 16, "
        "for x " + shape_str(x) +
        "; got wq " + shape_str(wq) + " " + dtype_str(wq.dtype()) + ", scales " +
        shape_str(scales) + " " + dtype_str(scales.dtype()) + ", biases " + shape_str(biases) +
        " for bits=" + std::to_string(bits) + ", group_size=" + std::to_string(group_size) + ".");
  mx::Shape shape = x.shape();
  shape.back() = wq.shape(1);
  return mx::array(shape, mx::float32,
                   std::make_shared<GatherMatvec>(cpu_stream(s), group_size, bits),
                   {x, wq, scales, biases, indices});
}

}  // namespace arbor

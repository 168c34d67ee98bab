#pragma once
// nccl::dp's plan (policy/nccl.hpp, comm/nccl/dp_transport.hpp), the part separable from NCCL
// and tested on the host (tests/test_nccl_dp_plan.cpp): the per-dtype buckets a device's tensors are flattened into
// (one ncclReduce or ncclBroadcast per bucket, not one per tensor), and the weights its
// pre-multiplying sum (ncclRedOpCreatePreMulSum) is given. NCCL multiplies in the reduction's dtype, so a 16-bit
// reduction would round a shard's weight to 16 bits (a batch of 3 over three shards: bf16(1/3)
// three times sums to 1.00195): when a weight is not exact in the gradients' 16-bit dtype, the
// bucket is F32 (the gradients converted into it, the result converted back once).

#include <dparallel/config.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <span>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// `w` rounded to dtype `t` (F64, F32, F16 or BF16; others: F32) and widened back to double.
inline double round_to(double w, dtype t) noexcept {
  float const f = static_cast<float>(w);
  switch (t) {
    case dtype::f64: return w;
    case dtype::bf16: return static_cast<double>(static_cast<float>(basic_half<true>(f)));
    case dtype::f16: return static_cast<double>(static_cast<float>(basic_half<false>(f)));
    default: return static_cast<double>(f);
  }
}

/// The weights of one nccl::dp reduce over gradients of one dtype.
struct premul_weights {
  dtype reduce_in = dtype::f32;  ///< the bucket's and NCCL's dtype: the gradients', or F32 (see above)
  std::vector<double> weights;   ///< per device: the weight NCCL multiplies by (exact in reduce_in); 0 without a shard
};

/// The weights for gradients of dtype `grads` over shards of `sizes` (0: the device has no
/// shard): shard i's weight sizes[i] / sum(sizes), given to NCCL in the gradients' dtype when
/// every weight is exact in it (F64 and F32 always: their rounding is the reduction's own), else
/// in F32 with the bucket in F32. The effective weights sum to 1 within F32 rounding.
inline premul_weights choose_premul(dtype grads, std::span<std::size_t const> sizes) {
  std::size_t batch = 0;
  for (std::size_t n : sizes) batch += n;
  premul_weights out;
  out.reduce_in = grads;
  out.weights.assign(sizes.size(), 0.0);
  if (batch == 0) return out;
  bool exact = true;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    double const w = static_cast<double>(sizes[i]) / static_cast<double>(batch);
    out.weights[i] = w;
    exact = exact && round_to(w, grads) == w;
  }
  if (grads != dtype::f64 && grads != dtype::f32 && !exact) out.reduce_in = dtype::f32;
  for (auto& w : out.weights) w = round_to(w, out.reduce_in);
  return out;
}

/// One bucket of a device's gradients: those of dtype `grads` (`members`, in order), at element
/// `offsets[j]` of a flat array of `elements` elements of `reduce_in`.
struct flat_bucket {
  dtype grads = dtype::f32;           ///< the members' dtype
  dtype reduce_in = dtype::f32;       ///< the flat array's dtype (choose_premul)
  std::size_t elements = 0;           ///< the flat array's length
  std::vector<std::size_t> members;   ///< gradient indices, in order (empty gradients left out)
  std::vector<std::size_t> offsets;   ///< each member's first element in the flat array
};

/// The buckets of tensors `grads` (the same layout on every device): one per dtype, in the order
/// the dtypes first appear, each reduced in the dtype choose_premul gives for `sizes`; with no
/// `sizes` (a broadcast: nothing is weighted) each bucket keeps its tensors' dtype.
inline std::vector<flat_bucket> plan_flat_buckets(std::span<tensor_ref const> grads, std::span<std::size_t const> sizes) {
  std::vector<flat_bucket> out;
  for (std::size_t k = 0; k < grads.size(); ++k) {
    if (grads[k].size() == 0) continue;
    flat_bucket* b = nullptr;
    for (auto& x : out)
      if (x.grads == grads[k].dtype()) b = &x;
    if (b == nullptr) {
      out.push_back({grads[k].dtype(), choose_premul(grads[k].dtype(), sizes).reduce_in, 0, {}, {}});
      b = &out.back();
    }
    b->members.push_back(k);
    b->offsets.push_back(b->elements);
    b->elements += grads[k].size();
  }
  return out;
}

/// Whether bucket `b` can be reduced in place in a device's gradients `grads`: no conversion, and
/// the members lie back to back in memory in order (one flat tensor, as many models keep them).
inline bool bucket_in_place(flat_bucket const& b, std::span<tensor_ref const> grads) {
  if (b.reduce_in != b.grads || b.members.empty()) return false;
  auto const* start = static_cast<std::byte const*>(grads[b.members[0]].data());
  for (std::size_t j = 0; j < b.members.size(); ++j)
    if (static_cast<std::byte const*>(grads[b.members[j]].data()) != start + b.offsets[j] * size_of(b.grads)) return false;
  return true;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// DDP's buckets with options::gradient_as_bucket_view: planned from where the gradients lie in
// memory (each bucket one range of it, all-reduced in place), and checked every step against
// that plan. Used by policy/bucketed_reduce.hpp.

#include <dparallel/config.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// The buckets of gradient_as_bucket_view, and what planning found wrong.
struct bucket_view_plan {
  std::vector<bucket_spec> buckets;    ///< offsets relative to each bucket's lowest gradient
  std::vector<std::size_t> base_slot;  ///< per bucket: the slot of its lowest gradient
  std::string error;                   ///< gradients that overlap in memory; empty when none
};

/// The gradients that are adjacent in memory, walked from the highest address down (reverse
/// parameter order for one flat buffer in parameter order: the order backward finishes them),
/// form the buckets; a bucket closes at its cap (the first of each dtype at `first_cap_bytes`,
/// the others at `cap_bytes`), at a gap and where the dtype changes. A bucket is then one range
/// of memory, [its lowest gradient, + elements). Empty gradients join the last bucket. `rank`
/// names this rank in the error.
inline bucket_view_plan plan_bucket_views(std::span<tensor_ref const> grads, std::size_t first_cap_bytes,
                                          std::size_t cap_bytes, int rank) {
  bucket_view_plan out;
  std::vector<std::size_t> order, empty;
  for (std::size_t i = 0; i < grads.size(); ++i) (grads[i].size() == 0 ? empty : order).push_back(i);
  auto const addr = [&](std::size_t i) { return reinterpret_cast<std::uintptr_t>(grads[i].data()); };
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return addr(a) > addr(b); });
  std::vector<dtype> closed_first;  // dtypes whose first bucket is closed
  bucket_spec cur;
  std::uintptr_t low = 0;  // start of the gradient walked last: the lowest of cur, if any
  bool walked = false;
  auto const close = [&] {
    if (cur.params.empty()) return;
    for (std::size_t k = 0; k < cur.params.size(); ++k)
      cur.offsets.push_back((addr(cur.params[k]) - low) / size_of(cur.dtype));
    if (std::find(closed_first.begin(), closed_first.end(), cur.dtype) == closed_first.end())
      closed_first.push_back(cur.dtype);
    out.base_slot.push_back(cur.params.size() - 1);
    out.buckets.push_back(std::move(cur));
    cur = bucket_spec{};
  };
  std::size_t last = 0;
  for (std::size_t i : order) {
    std::uintptr_t const end = addr(i) + grads[i].size_bytes();
    if (walked && end > low && out.error.empty()) {
      out.error = "DDP with gradient_as_bucket_view on rank " + std::to_string(rank) + ": gradients " +
                  std::to_string(i) + " and " + std::to_string(last) +
                  " overlap in memory; expected every gradient to have its own storage";
    }
    if (!cur.params.empty() && (end != low || grads[i].dtype() != cur.dtype)) close();
    walked = true;
    last = i;
    if (cur.params.empty()) cur.dtype = grads[i].dtype();
    cur.params.push_back(i);
    cur.elements += grads[i].size();
    low = addr(i);
    bool const first = std::find(closed_first.begin(), closed_first.end(), cur.dtype) == closed_first.end();
    if (cur.elements * size_of(cur.dtype) >= (first ? first_cap_bytes : cap_bytes)) close();
  }
  close();
  for (std::size_t i : empty) {  // no memory: any bucket will do; the last, or one of their own
    if (out.buckets.empty()) {
      out.buckets.push_back(bucket_spec{grads[i].dtype(), {}, {}, 0});
      out.base_slot.push_back(0);
    }
    out.buckets.back().params.push_back(i);
    out.buckets.back().offsets.push_back(0);
  }
  return out;
}

/// Every step: the gradients must still lie where `plan` (agreed by every rank) says, relative to
/// each other; the model may not have moved them. Throws invalid_argument naming the gradient as
/// `label(i)` does (parameter_label).
template <class Label>
void check_bucket_views(std::span<tensor_ref const> grads, std::vector<bucket_spec> const& buckets,
                        std::vector<std::size_t> const& base_slot, int rank, Label const& label) {
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    auto const& spec = buckets[b];
    if (spec.elements == 0) continue;
    auto const* base = static_cast<std::byte const*>(grads[spec.params[base_slot[b]]].data());
    for (std::size_t k = 0; k < spec.params.size(); ++k) {
      tensor_ref const g = grads[spec.params[k]];
      if (g.size() == 0 || g.data() == base + spec.offsets[k] * size_of(spec.dtype)) continue;
      throw invalid_argument("dparallel: DDP with gradient_as_bucket_view on rank " + std::to_string(rank) +
                             ": gradient " + label(spec.params[k]) +
                             " is no longer where it was, relative to gradient " +
                             label(spec.params[base_slot[b]]) +
                             ", when the buckets were planned; expected the gradients to keep their storage "
                             "(the buckets are views of it): do not reallocate them, or leave "
                             "gradient_as_bucket_view off");
    }
  }
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

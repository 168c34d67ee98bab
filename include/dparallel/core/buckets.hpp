#pragma once
// Gradient buckets for DDP: which parameters are reduced together, in which order.

#include <dparallel/config.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// One bucket: parameters of one dtype whose gradients travel in one collective.
struct bucket_spec {
  /// The dtype of every gradient in the bucket.
  dparallel::dtype dtype = dparallel::dtype::f32;
  std::vector<std::size_t> params;   ///< parameter indices, in the order they fill the bucket
  std::vector<std::size_t> offsets;  ///< element offset of each parameter inside the bucket
  std::size_t elements = 0;          ///< total elements in the bucket

  friend bool operator==(bucket_spec const&, bucket_spec const&) = default;
};

/// Assigns parameters to buckets in the given order (DDP uses reverse parameter order until it
/// has seen the order in which gradients become ready). Parameters of different dtypes never
/// share a bucket. A bucket is closed as soon as it holds at least its cap in bytes: the first
/// bucket of each dtype uses `first_cap_bytes` (so communication starts early), later ones
/// `cap_bytes`. Buckets are returned in the order of their first parameter in `order`.
inline std::vector<bucket_spec> plan_buckets(std::vector<std::size_t> const& element_counts,
                                             std::vector<dtype> const& dtypes, std::vector<std::size_t> const& order,
                                             std::size_t first_cap_bytes, std::size_t cap_bytes) {
  detail::require(element_counts.size() == dtypes.size(), "plan_buckets: expected one dtype per parameter");
  detail::require(order.size() == element_counts.size(),
                  "plan_buckets: expected the order to name every parameter once, found " +
                      std::to_string(order.size()) + " entries for " + std::to_string(element_counts.size()) +
                      " parameters");
  std::vector<bool> seen(order.size(), false);
  for (std::size_t p : order) {
    detail::require(p < order.size() && !seen[p], "plan_buckets: expected a permutation of the parameter indices, "
                                                  "found index " + std::to_string(p) + " twice or out of range");
    seen[p] = true;
  }

  std::vector<bucket_spec> done;
  struct open_bucket {
    bucket_spec b;
    std::size_t first_pos = 0;
    bool closed_one = false;  // whether this dtype already closed its first bucket
  };
  std::vector<open_bucket> open;  // at most one open bucket per dtype
  std::vector<std::size_t> done_pos;
  for (std::size_t pos = 0; pos < order.size(); ++pos) {
    std::size_t const p = order[pos];
    open_bucket* ob = nullptr;
    for (auto& o : open)
      if (o.b.dtype == dtypes[p]) ob = &o;
    if (ob == nullptr) {
      open.push_back({bucket_spec{dtypes[p], {}, {}, 0}, pos, false});
      ob = &open.back();
    }
    if (ob->b.params.empty()) ob->first_pos = pos;
    ob->b.params.push_back(p);
    ob->b.offsets.push_back(ob->b.elements);
    ob->b.elements += element_counts[p];
    std::size_t const cap = ob->closed_one ? cap_bytes : first_cap_bytes;
    if (ob->b.elements * size_of(ob->b.dtype) >= cap) {
      done.push_back(std::move(ob->b));
      done_pos.push_back(ob->first_pos);
      ob->b = bucket_spec{dtypes[p], {}, {}, 0};
      ob->closed_one = true;
    }
  }
  for (auto& o : open) {
    if (o.b.params.empty()) continue;
    done.push_back(std::move(o.b));
    done_pos.push_back(o.first_pos);
  }
  // Order buckets by the position of their first parameter.
  std::vector<std::size_t> idx(done.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  for (std::size_t i = 1; i < idx.size(); ++i)  // insertion sort: few buckets, stable
    for (std::size_t j = i; j > 0 && done_pos[idx[j]] < done_pos[idx[j - 1]]; --j) std::swap(idx[j], idx[j - 1]);
  std::vector<bucket_spec> out;
  out.reserve(done.size());
  for (std::size_t i : idx) out.push_back(std::move(done[i]));
  return out;
}

/// Reverse parameter order: DDP's initial bucket order (gradients of the last layers are ready first).
inline std::vector<std::size_t> reverse_order(std::size_t n) {
  std::vector<std::size_t> o(n);
  for (std::size_t i = 0; i < n; ++i) o[i] = n - 1 - i;
  return o;
}

DPARALLEL_NAMESPACE_END

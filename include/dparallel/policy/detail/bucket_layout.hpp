#pragma once
// DDP's buckets, apart from the step that runs over them (policy/bucketed_reduce.hpp): the route a
// step's gradients take to the collectives, where each parameter lies in the buckets, one bucket's
// memory and progress, the layout that plans and holds them, and the check that every rank planned
// the same buckets.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/bucket_views.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// How one step's gradients reach their buckets' collectives; chosen at the start of the step.
enum class bucket_route {
  accumulate,  ///< no_sync: each gradient is added, batch-weighted, into the no_sync storage; nothing is reduced
  copy,        ///< each gradient is copied into its bucket's storage; the storage is reduced and copied back
  in_place,    ///< the buckets are views of the gradients (gradient_as_bucket_view): reduced where they lie
  coalesced,   ///< the engine reduces a bucket as the list of its gradients (all_reduce_coalesced), no copies;
               ///< a bucket with a gradient marked while the step function ran goes by copy (it must
               ///< leave the gradients alone until the step ends)
};

/// Where a parameter's gradient lies in the buckets.
struct bucket_locator {
  std::size_t bucket = 0;  ///< the bucket, in launch order
  std::size_t slot = 0;    ///< its position among the bucket's parameters (bucket_spec::params[slot])
  std::size_t offset = 0;  ///< its first element inside the bucket (bucket_spec::offsets[slot])
};

/// One bucket's memory and its progress through the current step (what it holds, its parameters
/// and their offsets, is the plan's bucket_spec of the same index).
struct reducer_bucket {
  std::shared_ptr<std::byte> storage;  ///< copy and coalesced routes: the bucket's memory (Backend::allocate)
  std::shared_ptr<std::byte> accum;    ///< no_sync: the gradients accumulated since the last synchronised step
  // This step's:
  std::size_t pending = 0;       ///< gradients not staged yet; the bucket is launched when it reaches 0
  bool copied = false;           ///< coalesced route: a gradient went into storage, so the bucket goes by copy
  std::vector<tensor_ref> list;  ///< coalesced route: its gradients (then a sharded reduction's padding), in order
  work launched;                 ///< its collective, or its communication hook's work
};

/// The buckets of one reducer: the plan (which gradients each bucket holds, in launch order),
/// where each parameter lies in it, and each bucket's memory and progress (same index as the plan).
struct bucket_layout {
  std::vector<bucket_spec> plan;
  std::vector<reducer_bucket> buckets;
  std::vector<std::size_t> base_slot;   ///< bucket views: the slot of each bucket's lowest gradient
  std::vector<std::size_t> counts;      ///< elements of each parameter (model order)
  std::vector<bucket_locator> locator;  ///< where each parameter lies (model order)
  bool views = false;                   ///< the buckets are views of the gradients
  bool has_accum = false;               ///< the buckets have their no_sync storage
  std::string error;                    ///< views: why this rank's gradients cannot be bucketed

  /// Copying buckets over `params` in `order`; each bucket's storage holds `padded(elements)`
  /// elements, from Backend::allocate on `where`. The no_sync storage is laid out anew at once when
  /// it was in use (a rebuild), so the steps after it allocate nothing.
  template <class Backend, class Padded>
  void plan_copies(std::span<tensor_ref const> params, options const& o, std::vector<std::size_t> const& order,
                   device where, Padded padded) {
    counts.clear();
    std::vector<dtype> dtypes;
    for (auto const& p : params) {
      counts.push_back(p.size());
      dtypes.push_back(p.dtype());
    }
    check_caps(o);
    views = false;
    plan = plan_buckets(counts, dtypes, order, mib(o.first_bucket_cap_mb), mib(o.bucket_cap_mb));
    index();
    for (std::size_t b = 0; b < plan.size(); ++b)
      buckets[b].storage = Backend::allocate(where, padded(plan[b].elements) * size_of(plan[b].dtype));
    if (has_accum) allocate_accum<Backend>(where);
  }

  /// gradient_as_bucket_view: the buckets follow the gradients' memory (core/bucket_views.hpp).
  void plan_views(std::span<tensor_ref const> grads, options const& o, int rank) {
    check_caps(o);
    counts.assign(grads.size(), 0);
    for (std::size_t i = 0; i < grads.size(); ++i) counts[i] = grads[i].size();
    auto v = plan_bucket_views(grads, mib(o.first_bucket_cap_mb), mib(o.bucket_cap_mb), rank);
    views = true;
    plan = std::move(v.buckets);
    base_slot = std::move(v.base_slot);
    error = std::move(v.error);
    index();
    has_accum = false;
  }

  /// Every bucket's no_sync storage, zeroed, from Backend::allocate on `where`.
  template <class Backend>
  void allocate_accum(device where) {
    for (std::size_t b = 0; b < plan.size(); ++b)
      buckets[b].accum = Backend::allocate(where, plan[b].elements * size_of(plan[b].dtype));
    has_accum = true;
  }

  /// Bucket b's memory: its storage (on `where`), or a view of the gradients from its lowest one.
  [[nodiscard]] tensor_ref whole(std::size_t b, std::span<tensor_ref const> grads, device where) const {
    auto const& spec = plan[b];
    if (!views) return tensor_ref(buckets[b].storage.get(), spec.elements, spec.dtype, where);
    if (spec.elements == 0) return tensor_ref(nullptr, 0, spec.dtype);
    tensor_ref const lowest = grads[spec.params[base_slot[b]]];
    return tensor_ref(lowest.data(), spec.elements, spec.dtype, lowest.device());
  }

  /// Parameter i's slot of bucket memory `m` (its bucket's storage or no_sync storage) on `where`.
  [[nodiscard]] tensor_ref slot(std::shared_ptr<std::byte> const& m, std::size_t i, device where) const {
    bucket_locator const& at = locator[i];
    dtype const t = plan[at.bucket].dtype;
    return tensor_ref(m.get() + at.offset * size_of(t), counts[i], t, where);
  }

 private:
  static std::size_t mib(double m) { return static_cast<std::size_t>(std::llround(m * 1024.0 * 1024.0)); }

  static void check_caps(options const& o) {
    require(o.bucket_cap_mb > 0 && o.first_bucket_cap_mb > 0,
            "DDP: expected bucket_cap_mb and first_bucket_cap_mb > 0, found " + std::to_string(o.bucket_cap_mb) +
                " and " + std::to_string(o.first_bucket_cap_mb));
  }

  // A fresh bucket per planned bucket, and each parameter's locator.
  void index() {
    buckets.clear();
    buckets.resize(plan.size());
    locator.assign(counts.size(), bucket_locator{});
    for (std::size_t b = 0; b < plan.size(); ++b)
      for (std::size_t k = 0; k < plan[b].params.size(); ++k) locator[plan[b].params[k]] = {b, k, plan[b].offsets[k]};
  }
};

/// Every rank must have made the same bucket plan (the same collectives follow from it): each
/// rank's signature of its plan is compared with rank 0's, and the same error is raised on every
/// rank. `plan_error`: why this rank could not plan (empty: it could), raised after the exchange so
/// that the other ranks fail too.
inline void verify_bucket_plan(process_group const& g, std::vector<bucket_spec> const& plan, bool views,
                               std::string const& plan_error) {
  std::uint64_t h = 1469598103934665603ull;
  auto const mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (auto const& b : plan) {
    mix(static_cast<std::uint64_t>(b.dtype));
    mix(b.elements);
    for (std::size_t k = 0; k < b.params.size(); ++k) {
      mix(b.params[k]);
      mix(b.offsets[k]);
    }
  }
  int const world = g.size();
  std::vector<std::int64_t> mine{views ? 1 : 0, static_cast<std::int64_t>(plan.size()), static_cast<std::int64_t>(h),
                                 plan_error.empty() ? 0 : 1};
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(world));
  g.all_gather(view(all), view(mine)).wait();
  auto const at = [&](int rank, std::size_t k) { return all[static_cast<std::size_t>(rank) * mine.size() + k]; };
  require(plan_error.empty(), plan_error);
  for (int r = 0; r < world; ++r)
    require(at(r, 3) == 0, "DDP: rank " + std::to_string(r) + " could not plan its gradient buckets (its "
                           "own error says why); expected every rank to plan the same buckets");
  for (int r = 1; r < world; ++r) {
    auto const flag = [](std::int64_t v) { return v != 0 ? std::string("true") : std::string("false"); };
    require(at(r, 0) == at(0, 0), "DDP: rank " + std::to_string(r) + " has gradient_as_bucket_view = " +
                                      flag(at(r, 0)) + ", rank 0 has " + flag(at(0, 0)) +
                                      "; expected every rank to pass the same options");
    require(at(r, 1) == at(0, 1) && at(r, 2) == at(0, 2),
            "DDP: rank " + std::to_string(r) + " planned " + std::to_string(at(r, 1)) +
                " gradient buckets, rank 0 planned " + std::to_string(at(0, 1)) +
                (at(r, 1) == at(0, 1) ? " too, but with different contents" : "") +
                "; expected the same buckets on every rank" +
                (views ? ": with gradient_as_bucket_view the buckets follow each rank's gradient memory, "
                         "so every rank must lay out its gradients the same way (e.g. one flat buffer "
                         "in parameter order)"
                       : ""));
  }
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// The pieces of DDP's bucketed reducer (policy/bucketed_reduce.hpp) that are plain data or plain
// functions: the route a step's gradients take to the collectives, where each parameter lies in
// the buckets, one bucket's memory and progress, and the check that every rank planned the same
// buckets.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// How one step's gradients reach their buckets' collectives; chosen at the start of the step.
enum class bucket_route {
  accumulate,  ///< no_sync: each gradient is added, weighted by the batch, into the accumulation storage; nothing is reduced
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
  std::size_t pending = 0;        ///< gradients not staged yet; the bucket is launched when it reaches 0
  bool copied = false;            ///< coalesced route: a gradient went into storage, so the bucket goes by copy
  std::vector<tensor_ref> list;   ///< coalesced route: its gradients (then a sharded reduction's padding), in slot order
  work launched;                  ///< its collective, or its communication hook's work
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

#pragma once
// The parts of parallel<>'s step and construction that need only the shared replica_set: the
// shard plan of a step, draining the streams, and the checks on a fresh replica.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/memory_overlap.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/detail/replica_set.hpp>
#include <dparallel/detail/typed_scratch.hpp>

#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// Asks `scatter` for the shard sizes of a `total`-sample batch over rs's devices and stores the
/// plan (sizes, offsets, batch) in `rs`. The checks build their message only when they fail: this
/// runs every step.
template <class Scatter, class RS>
void plan_step(Scatter& scatter, RS& rs, std::size_t total) {
  if (total == 0) throw invalid_argument("dparallel: step: expected a batch of at least one sample, found an empty batch");
  auto sizes = scatter.shard_sizes(total, rs.size(), rs.opts);
  if (sizes.size() > rs.size())
    throw invalid_argument("dparallel: step: the scatter policy returned " + std::to_string(sizes.size()) +
                           " shards for " + std::to_string(rs.size()) + " devices");
  sizes.resize(rs.size(), 0);
  rs.batch = total;
  rs.shard_sizes = std::move(sizes);
  rs.shard_offsets.assign(rs.size(), 0);
  std::size_t off = 0;
  for (std::size_t i = 0; i < rs.size(); ++i) {
    rs.shard_offsets[i] = off;
    off += rs.shard_sizes[i];
  }
  if (off != total)
    throw invalid_argument("dparallel: step: the scatter policy's shard sizes sum to " + std::to_string(off) +
                           ", expected the batch size " + std::to_string(total));
}

/// Waits for every stream, running on this thread the work no worker has started (where the
/// backend's stream can: synchronize_here); rethrows the first error in device order.
template <class Stream>
void synchronize_streams(std::vector<std::unique_ptr<Stream>>& streams) {
  std::exception_ptr first;
  for (auto& s : streams) {
    try {
      if constexpr (requires { s->synchronize_here(); }) s->synchronize_here();
      else s->synchronize();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

/// Orders the streams of a backend that does not follow the caller's own (cuda::backend:
/// non-blocking CUDA streams) after the caller's work, before anything of a step, or of a shadow
/// step of join(), is enqueued; nothing on a backend without Backend::begin_step.
template <class Backend, class Stream>
void begin_streams(std::vector<std::unique_ptr<Stream>>& streams) {
  if constexpr (requires(Stream& s) { Backend::begin_step(s); })
    for (auto& s : streams) Backend::begin_step(*s);
}

/// Waits for every stream and swallows their errors: for unwinding, where the exception in flight
/// is the one to report but the queued work must finish before the step's locals go away.
template <class Stream>
void drain_streams(std::vector<std::unique_ptr<Stream>>& streams) noexcept {
  for (auto& s : streams) {
    try {
      s->synchronize();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the exception in flight is the one to report
    }
  }
}

/// DataParallel's checks on the replica made for device i: a valid model with the master's
/// parameter count, sizes and dtypes, and storage of its own.
template <class RS>
void check_replica(RS const& rs, std::size_t i) {
  auto& r = *rs.models[i];
  std::string const where = "parallel: the replica for " + to_string(rs.devices[i]);
  verify_model(r, where);
  auto const mp = parameter_refs(*rs.master);
  auto const rp = parameter_refs(r);
  require(mp.size() == rp.size(), where + " has " + std::to_string(rp.size()) + " parameters, expected the master's " +
                                      std::to_string(mp.size()));
  for (std::size_t k = 0; k < mp.size(); ++k) {
    require(mp[k].size() == rp[k].size() && mp[k].dtype() == rp[k].dtype(),
            [&] {
              return where + ": parameter " + parameter_label(*rs.master, k) +
                     " differs from the master's in size or dtype";
            });
  }
  // Groups: the master's parameters (0) and gradients (1), the replica's (2, 3); only a tensor of
  // the replica over one of the master's clashes (verify_model checked each model alone).
  std::vector<tensor_place> places;
  auto const add = [&](std::vector<tensor_ref> const& ts, int group) {
    for (std::size_t k = 0; k < ts.size(); ++k) places.push_back({ts[k], group, k});
  };
  add(mp, 0);
  add(gradient_refs(*rs.master), 1);
  add(rp, 2);
  add(gradient_refs(r), 3);
  auto const hit = find_memory_overlap(std::move(places), 4, [](int a, int b) { return (a < 2) != (b < 2); });
  if (!hit) return;
  auto const& mine = hit->first.group >= 2 ? hit->first : hit->second;
  auto const& master = hit->first.group >= 2 ? hit->second : hit->first;
  auto const kind = [](tensor_place const& t) { return t.group % 2 == 0 ? "parameter " : "gradient "; };
  throw invalid_argument("dparallel: " + where + ": " + kind(mine) + parameter_label(r, mine.index) +
                         " shares storage with the master's " + kind(master) +
                         parameter_label(*rs.master, master.index) +
                         "; a replica needs its own storage, gradients included (a copy whose parameters() or "
                         "gradients() go through pointers into the master's members aliases it): give the model a "
                         "copy constructor or make_replica that points them at the copy's own members");
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// Reduce policies: how the replicas' gradients are combined after (or during) backward.

#include <dparallel/config.hpp>
#include <dparallel/core/dp_plan.hpp>
#include <dparallel/policy/concepts.hpp>
#include <dparallel/policy/replicate.hpp>

#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace policy {

/// DataParallel: the master's gradient becomes sum_i w_i * g_i over the replicas that received a
/// shard, w_i being the shard's share of the batch, summed pairwise in device order
/// (host::weighted_sum), so results are deterministic and equal the one-device gradient of the
/// mean loss. The work is split by elements: each of the m replicas that ran reduces its part of
/// every gradient on its own stream, once every replica's step function is done, so the
/// reduction runs on all those devices at once (the sum of each element is the same expression
/// whichever device computes it: the same bits as one device doing it all). The master's stream
/// then waits for every part. A device's part is the backend's layout (core/dp_plan.hpp,
/// plan_reduce): its stripes on host::backend, one contiguous slice per gradient on cuda::backend.
/// See Note [Why stripes] (policy/concepts.hpp). On a backend with the borrowed weighted_sum a
/// device's parts are one piece of work over lists the policy keeps as members
/// (see Note [Steady-state allocations]); elsewhere each part is a call of its own
/// (detail::weighted_sums_kept).
struct reduce_to_master {
  /// Nothing to prepare.
  template <class Set>
  void on_construct(Set&) {}
  /// Nothing to prepare.
  template <class Set>
  void begin_step(Set&) {}
  /// Ignored: the reduction starts after every step function.
  template <class Set>
  void grad_ready(Set&, int, std::size_t) {}

  /// Enqueues the shard-weighted sum of the gradients onto the master.
  template <class Set>
  void finish(Set& s) {
    using backend = typename Set::backend_type;
    constexpr dp_sharing how = detail::dp_sharing_of<backend>();
    active_.clear();
    w_.clear();
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (!s.active(i)) continue;
      active_.push_back(i);
      w_.push_back(s.weight(i));
    }
    std::size_t const m = active_.size();
    // See Note [Step scratch lifetime].
    if (dst_.size() < m) dst_.resize(m);
    if (src_.size() < m) src_.resize(m);
    std::span<tensor_ref const> const grads(s.grads[0]);
    for (std::size_t k = 0; k < m; ++k) {
      auto& stream = *s.streams[active_[k]];
      for (std::size_t j : active_)
        if (j != active_[k]) stream.wait(s.compute_done[j]);
      dst_[k].clear();
      src_[k].clear();
      detail::plan_reduce(how, m, k, grads, [&](detail::reduce_slice const& r) {
        dst_[k].push_back(grads[r.tensor].subview(r.lo, r.hi - r.lo));
        for (std::size_t i : active_) src_[k].push_back(s.grads[i][r.tensor].subview(r.lo, r.hi - r.lo));
      });
      if (!dst_[k].empty())
        detail::weighted_sums_kept<backend>(stream, std::span<tensor_ref const>(dst_[k]),
                                            std::span<tensor_ref const>(src_[k]), std::span<double const>(w_));
      if (active_[k] != 0) s.streams[0]->wait(stream.record());
    }
  }

 private:
  std::vector<std::size_t> active_;  // the devices that ran a shard this step
  std::vector<double> w_;            // their shard weights
  // Per active device k: its slice of every gradient on the master, and the same slice on every
  // active device (m per gradient).
  std::vector<std::vector<tensor_ref>> dst_, src_;
};
static_assert(reduce_policy<reduce_to_master>);

/// DataParallel where every replica ends the step with the reduced gradient (so each replica can
/// run its own optimizer; pair it with replicate_once): reduce_to_master, then the master's
/// gradients are copied to every other replica, bitwise identical.
struct all_reduce_replicas : reduce_to_master {
  /// The reduction onto the master, then its result copied to every replica.
  template <class Set>
  void finish(Set& s) {
    using backend = typename Set::backend_type;
    reduce_to_master::finish(s);
    auto const reduced = s.streams[0]->record();
    for (std::size_t i = 1; i < s.size(); ++i) {
      s.streams[i]->wait(reduced);
      // s.grads is refreshed only between steps: see Note [Step scratch lifetime].
      detail::copy_all_kept<backend>(*s.streams[i], s.grads[i], s.grads[0]);
    }
  }
};
static_assert(reduce_policy<all_reduce_replicas>);

}  // namespace policy
DPARALLEL_NAMESPACE_END

#pragma once
// Reduce policies: how the replicas' gradients are combined after (or during) backward.

#include <dparallel/config.hpp>
#include <dparallel/policy/replicate.hpp>

#include <concepts>
#include <cstddef>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// A reduce policy is told when a step starts, when a replica's gradient is ready (from
/// step_context::grad_ready, on that replica's stream), and when every step function has been
/// enqueued; finish() enqueues the remaining reduction work.
template <class P>
concept reduce_policy = std::semiregular<P> && requires(P& p, detail::archetype_set& s, int r, std::size_t i) {
  p.on_construct(s);
  p.begin_step(s);
  p.grad_ready(s, r, i);
  p.finish(s);
};

namespace policy {

/// DataParallel: the master's gradient becomes sum_i w_i * g_i over the replicas that received a
/// shard, w_i being the shard's share of the batch, summed pairwise in device order
/// (host::weighted_sum), so results are deterministic and equal the one-device gradient of the
/// mean loss. The work is split by elements: each of the m replicas that ran reduces the k-th
/// of m slices of every gradient on its own stream, once every replica's step function is done,
/// so the reduction runs on all those devices at once (the sum of each element is the same
/// expression whichever device computes it: the same bits as one device doing it all). The
/// master's stream then waits for every slice.
struct reduce_to_master {
  template <class Set>
  void on_construct(Set&) {}
  template <class Set>
  void begin_step(Set&) {}
  template <class Set>
  void grad_ready(Set&, int, std::size_t) {}

  template <class Set>
  void finish(Set& s) {
    using backend = typename Set::backend_type;
    std::vector<std::size_t> active;
    std::vector<double> w;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (!s.active(i)) continue;
      active.push_back(i);
      w.push_back(s.weight(i));
    }
    std::size_t const m = active.size();
    for (std::size_t k = 0; k < m; ++k) {
      auto& stream = *s.streams[active[k]];
      for (std::size_t j : active)
        if (j != active[k]) stream.wait(s.compute_done[j]);
      for (std::size_t p = 0; p < s.grads[0].size(); ++p) {
        std::size_t const n = s.grads[0][p].size();
        std::size_t const lo = n * k / m, hi = n * (k + 1) / m;
        if (lo == hi) continue;
        std::vector<tensor_ref> src;
        src.reserve(m);
        for (std::size_t i : active) src.push_back(s.grads[i][p].subview(lo, hi - lo));
        backend::weighted_sum(stream, s.grads[0][p].subview(lo, hi - lo), std::move(src), w);
      }
      if (active[k] != 0) s.streams[0]->wait(stream.record());
    }
  }
};
static_assert(reduce_policy<reduce_to_master>);

/// DataParallel where every replica ends the step with the reduced gradient (so each replica can
/// run its own optimizer; pair it with replicate_once): reduce_to_master, then the master's
/// gradients are copied to every other replica, bitwise identical.
struct all_reduce_replicas : reduce_to_master {
  template <class Set>
  void finish(Set& s) {
    reduce_to_master::finish(s);
    auto const reduced = s.streams[0]->record();
    for (std::size_t i = 1; i < s.size(); ++i) {
      s.streams[i]->wait(reduced);
      Set::backend_type::copy_all(*s.streams[i], s.grads[i], s.grads[0]);
    }
  }
};
static_assert(reduce_policy<all_reduce_replicas>);

}  // namespace policy
DPARALLEL_NAMESPACE_END

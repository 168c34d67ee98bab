#pragma once
// Replicate policies: how replicas get the master's parameters and buffers.

#include <dparallel/config.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/detail/replica_set.hpp>

#include <concepts>
#include <cstddef>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {
struct archetype_model {
  std::vector<float> p, g;
  auto parameters() { return std::vector<tensor_ref>{}; }
  auto gradients() { return std::vector<tensor_ref>{}; }
};
struct archetype_backend {
  struct stream_type {};
  struct event_type {};
};
using archetype_set = replica_set<archetype_model, archetype_backend>;
}  // namespace detail

/// A replicate policy is told when the wrapper is built and before each step's compute.
template <class P>
concept replicate_policy = std::semiregular<P> && requires(P& p, detail::archetype_set& s) {
  p.on_construct(s);
  p.before_step(s);
};

namespace policy {

/// DataParallel: before every step, copy the master's parameters and buffers into every replica
/// that receives a shard. All tensors of a replica travel as one piece of work on its stream, and
/// the replicas persist between steps. The master's own step waits for these copies, so a step
/// function may update the master's buffers (running statistics) without racing them.
struct replicate_each_step {
  template <class Set>
  void on_construct(Set&) {}

  template <class Set>
  void before_step(Set& s) {
    using backend = typename Set::backend_type;
    auto const master_ready = s.streams[0]->record();
    for (std::size_t i = 1; i < s.size(); ++i) {
      if (!s.active(i)) continue;
      std::vector<tensor_ref> dst = s.params[i], src = s.params[0];
      dst.insert(dst.end(), s.bufs[i].begin(), s.bufs[i].end());
      src.insert(src.end(), s.bufs[0].begin(), s.bufs[0].end());
      s.streams[i]->wait(master_ready);
      s.streams[0]->wait(backend::copy_all(*s.streams[i], std::move(dst), std::move(src)));
    }
  }
};
static_assert(replicate_policy<replicate_each_step>);

}  // namespace policy
DPARALLEL_NAMESPACE_END

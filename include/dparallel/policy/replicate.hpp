#pragma once
// Replicate policies: how replicas get the master's parameters and buffers.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/dp_plan.hpp>
#include <dparallel/policy/concepts.hpp>
#include <dparallel/policy/detail/replica_set.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {
/// `out` = `a` followed by `b`, reusing out's storage.
inline void assign_joined(std::vector<tensor_ref>& out, std::vector<tensor_ref> const& a,
                          std::vector<tensor_ref> const& b) {
  out.assign(a.begin(), a.end());
  out.insert(out.end(), b.begin(), b.end());
}

/// A std::vector<T> that a policy which is not a template keeps from step to step, for a T only
/// its hooks know (the backend's event type): made at the first get<T>(), refilled in place after.
/// A copy starts empty, so two wrappers never share one.
class kept_vector {
 public:
  kept_vector() = default;
  kept_vector(kept_vector const&) {}
  kept_vector& operator=(kept_vector const& o) {
    if (this != &o) *this = kept_vector();
    return *this;
  }
  kept_vector(kept_vector&& o) noexcept : held_(std::move(o.held_)), type_(std::exchange(o.type_, nullptr)) {}
  kept_vector& operator=(kept_vector&& o) noexcept {
    held_ = std::move(o.held_);
    type_ = std::exchange(o.type_, nullptr);
    return *this;
  }
  ~kept_vector() = default;

  template <class T>
  std::vector<T>& get() {
    if (type_ != &tag<T>) {
      held_ = std::make_shared<std::vector<T>>();
      type_ = &tag<T>;
    }
    return *static_cast<std::vector<T>*>(held_.get());
  }

 private:
  template <class T>
  static constexpr char tag = 0;  // its address names T
  std::shared_ptr<void> held_;
  void const* type_ = nullptr;
};
}  // namespace detail

namespace policy {

/// DataParallel: before every step, copy the master's parameters and buffers into every replica
/// that receives a shard, and the replicas persist between steps. Every replica's step waits for
/// every copy into it, and the master's own step for every copy out of it, so a step function may
/// update the master's buffers (running statistics) without racing them.
/// Who copies what is the backend's layout (core/dp_plan.hpp, plan_replica_copies):
/// dp_sharing::stripes (host::backend): each device that runs a shard copies its stripes of every
/// master tensor into every other replica; dp_sharing::per_device (cuda::backend): each replica
/// pulls the master's tensors whole on its own stream, one copy per tensor.
/// See Note [Why stripes] (policy/concepts.hpp). On a backend with the borrowed copy_all each
/// copier's copies are one piece of work on its stream over lists the policy keeps as members
/// (see Note [Steady-state allocations]); elsewhere each copier's copies are one call over copies
/// of its lists (detail::copy_all_kept).
struct replicate_each_step {
  /// Nothing to do: replicas are refreshed before each step.
  template <class Set>
  void on_construct(Set&) {}

  /// Copies the master's parameters and buffers to every replica that receives a shard.
  template <class Set>
  void before_step(Set& s) {
    planned(s, s.streams[0]->record());
  }

 private:
  // The copiers are the master and every replica that runs a shard; copier k of m issues its
  // copies of the plan as one piece of work on its stream; then each copier waits for the copies
  // that touch it (the master's compute for the reads of its buffers, a replica's for the writes
  // into it).
  template <class Set>
  void planned(Set& s, typename Set::event_type const& master_ready) {
    using backend = typename Set::backend_type;
    constexpr dp_sharing how = detail::dp_sharing_of<backend>();
    copiers_.assign(1, 0);
    for (std::size_t i = 1; i < s.size(); ++i)
      if (s.active(i)) copiers_.push_back(i);
    std::size_t const m = copiers_.size();
    if (m < 2) return;  // no replica runs a shard
    // See Note [Step scratch lifetime].
    detail::assign_joined(master_, s.params[0], s.bufs[0]);
    if (dst_.size() < m) dst_.resize(m);
    if (src_.size() < m) src_.resize(m);
    for (std::size_t k = 0; k < m; ++k) {
      dst_[k].clear();
      src_[k].clear();
      detail::plan_replica_copies(how, m, k, std::span<tensor_ref const>(master_), [&](detail::replica_copy const& c) {
        std::size_t const r = copiers_[c.to];
        auto const& params = s.params[r];
        tensor_ref const to = c.tensor < params.size() ? params[c.tensor] : s.bufs[r][c.tensor - params.size()];
        dst_[k].push_back(to.subview(c.lo, c.hi - c.lo));
        src_[k].push_back(master_[c.tensor].subview(c.lo, c.hi - c.lo));
      });
    }
    auto& copied = copied_.get<typename Set::event_type>();
    copied.resize(m);
    for (std::size_t k = 0; k < m; ++k) {
      auto& stream = *s.streams[copiers_[k]];
      if (k != 0 && !dst_[k].empty()) stream.wait(master_ready);
      copied[k] = dst_[k].empty() ? typename Set::event_type{}
                                  : detail::copy_all_kept<backend>(stream, dst_[k], src_[k]);
    }
    for (std::size_t a = 0; a < m; ++a)
      for (std::size_t k = 0; k < m; ++k)
        if (!dst_[k].empty() && detail::replica_copies_touch(how, k, a)) s.streams[copiers_[a]]->wait(copied[k]);
  }

  std::vector<std::size_t> copiers_;                // the master, then the replicas that run a shard
  std::vector<tensor_ref> master_;                  // the master's parameters, then its buffers
  std::vector<std::vector<tensor_ref>> dst_, src_;  // per copier: its copies' targets and sources
  detail::kept_vector copied_;                      // per copier: its copies' event (the backend's event_type)
};
static_assert(replicate_policy<replicate_each_step>);

/// DataParallel whose replicas keep their own parameters (each runs its own optimizer, as with
/// policy::all_reduce_replicas): the master's parameters and buffers are copied once, at
/// construction.
struct replicate_once {
  /// Copies the master's parameters and buffers to every replica, once.
  template <class Set>
  void on_construct(Set& s) {
    for (std::size_t i = 1; i < s.size(); ++i) {
      std::vector<tensor_ref> dst = s.params[i], src = s.params[0];
      dst.insert(dst.end(), s.bufs[i].begin(), s.bufs[i].end());
      src.insert(src.end(), s.bufs[0].begin(), s.bufs[0].end());
      Set::backend_type::copy_all(*s.streams[i], std::move(dst), std::move(src));
      s.streams[i]->synchronize();
    }
  }
  /// Nothing to do: the replicas keep their own parameters.
  template <class Set>
  void before_step(Set&) {}
};
static_assert(replicate_policy<replicate_once>);

}  // namespace policy

namespace detail {
/// Broadcasts every tensor from `root` (rank 0 by default); waits for all of them.
inline void broadcast_from_root(process_group const& g, std::vector<tensor_ref> const& tensors, int root = 0) {
  std::vector<work> pending;
  pending.reserve(tensors.size());
  for (auto const& t : tensors) pending.push_back(g.broadcast(t, root));
  try {
    for (auto const& w : pending) w.wait();
  } catch (...) {
    g.drain();  // the tensors must outlive the collectives
    throw;
  }
}

/// The buffers' broadcast before each step, coalesced: one broadcast per dtype instead of one per
/// buffer. The buffers of a dtype that has several are laid out one after the other in a block of
/// the buffers' device (Backend::allocate, kept from step to step, grown when the buffers grow);
/// the root copies its buffers in, the block is broadcast, the other ranks copy it out. A dtype
/// with one buffer is broadcast in place. The copies are the backend's immediate ones: on the
/// calling stream (CUDA: the engine's collective orders after that stream's work, and the copies
/// out come after the broadcast's completion was waited for), synchronous on the host. Every
/// rank's buffers end bit for bit the root's, as with one broadcast per buffer.
class coalesced_buffer_broadcast {
 public:
  coalesced_buffer_broadcast() = default;
  // A copy starts without a block of its own (never two wrappers writing one block).
  coalesced_buffer_broadcast(coalesced_buffer_broadcast const&) {}
  coalesced_buffer_broadcast& operator=(coalesced_buffer_broadcast const& o) {
    if (this != &o) *this = coalesced_buffer_broadcast();
    return *this;
  }
  coalesced_buffer_broadcast(coalesced_buffer_broadcast&&) = default;
  coalesced_buffer_broadcast& operator=(coalesced_buffer_broadcast&&) = default;
  ~coalesced_buffer_broadcast() = default;

  /// Every rank's `bufs` (on device `where`) become rank `root`'s; waits for the broadcasts.
  template <class Backend>
  void run(process_group const& g, std::vector<tensor_ref> const& bufs, int root, device where) {
    using ops = typename Backend::immediate;
    plan(bufs);
    if (block_bytes_ > capacity_) {
      block_ = Backend::allocate(where, block_bytes_);
      capacity_ = block_bytes_;
    }
    bool const sender = g.rank() == root;
    pending_.clear();
    try {
      for (auto const& k : kinds_) {
        if (k.members.size() == 1) {
          pending_.push_back(g.broadcast(bufs[k.members[0]], root));
          continue;
        }
        if (sender) for_each_slice(k, bufs, where, [](tensor_ref slice, tensor_ref b) { ops::copy(slice, b); });
        pending_.push_back(g.broadcast(tensor_ref(block_.get() + k.offset, k.elements, k.type, where), root));
      }
      for (auto const& w : pending_) w.wait();
    } catch (...) {
      g.drain();  // the buffers and the block must outlive the collectives
      throw;
    }
    if (sender) return;
    for (auto const& k : kinds_) {
      if (k.members.size() > 1) for_each_slice(k, bufs, where, [](tensor_ref slice, tensor_ref b) { ops::copy(b, slice); });
    }
  }

 private:
  struct kind {
    dtype type = dtype::f32;
    std::vector<std::size_t> members;  // indices in the buffer list, in list order
    std::size_t elements = 0;
    std::size_t offset = 0;  // bytes into the block
  };

  // The buffers by dtype, in order of first appearance; the block's layout (64-byte aligned parts).
  void plan(std::vector<tensor_ref> const& bufs) {
    std::size_t used = 0;  // kinds_ keeps its vectors' capacity from step to step
    for (std::size_t i = 0; i < bufs.size(); ++i) {
      std::size_t k = 0;
      while (k < used && kinds_[k].type != bufs[i].dtype()) ++k;
      if (k == used) {
        if (used == kinds_.size()) kinds_.emplace_back();
        kinds_[k].type = bufs[i].dtype();
        kinds_[k].members.clear();
        ++used;
      }
      kinds_[k].members.push_back(i);
    }
    kinds_.resize(used);
    block_bytes_ = 0;
    for (auto& k : kinds_) {
      k.elements = 0;
      for (std::size_t i : k.members) k.elements += bufs[i].size();
      k.offset = block_bytes_;
      if (k.members.size() > 1) block_bytes_ += (k.elements * size_of(k.type) + 63) / 64 * 64;
    }
  }

  template <class F>
  void for_each_slice(kind const& k, std::vector<tensor_ref> const& bufs, device where, F&& f) const {
    std::size_t at = k.offset;
    for (std::size_t i : k.members) {
      f(tensor_ref(block_.get() + at, bufs[i].size(), k.type, where), bufs[i]);
      at += bufs[i].size_bytes();
    }
  }

  std::vector<kind> kinds_;
  std::vector<work> pending_;
  std::shared_ptr<std::byte> block_;
  std::size_t block_bytes_ = 0;
  std::size_t capacity_ = 0;
};

/// Verifies that every rank's parameters have the count, sizes and dtypes of rank 0's; the same
/// error is raised on every rank, naming the first rank and parameter that differ.
inline void verify_across_ranks(process_group const& g, std::vector<tensor_ref> const& params, char const* what) {
  int const world = g.size();
  std::vector<std::int64_t> count{static_cast<std::int64_t>(params.size())};
  std::vector<std::int64_t> counts(static_cast<std::size_t>(world));
  g.all_gather(view(counts), view(count)).wait();
  for (int r = 1; r < world; ++r)
    dparallel::detail::require(counts[static_cast<std::size_t>(r)] == counts[0],
                               std::string("DDP: rank ") + std::to_string(r) + " has " +
                                   std::to_string(counts[static_cast<std::size_t>(r)]) + " " + what +
                                   ", expected rank 0's " + std::to_string(counts[0]) +
                                   "; every rank must build the same model");
  std::string one(what);  // "parameters" -> "parameter 3"
  if (!one.empty() && one.back() == 's') one.pop_back();
  std::size_t const n = params.size();
  std::vector<std::int64_t> mine(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    mine[2 * i] = static_cast<std::int64_t>(params[i].size());
    mine[2 * i + 1] = static_cast<std::int64_t>(params[i].dtype());
  }
  std::vector<std::int64_t> all(2 * n * static_cast<std::size_t>(world));
  if (n != 0) g.all_gather(view(all), view(mine)).wait();
  for (int r = 1; r < world; ++r) {
    for (std::size_t i = 0; i < n; ++i) {
      auto const at = [&](int rank, std::size_t k) { return all[static_cast<std::size_t>(rank) * 2 * n + k]; };
      bool const same = at(r, 2 * i) == at(0, 2 * i) && at(r, 2 * i + 1) == at(0, 2 * i + 1);
      dparallel::detail::require(
          same, std::string("DDP: rank ") + std::to_string(r) + "'s " + one + " " + std::to_string(i) + " has " +
                    std::to_string(at(r, 2 * i)) + " elements of " +
                    std::string(name_of(static_cast<dtype>(at(r, 2 * i + 1)))) + ", expected rank 0's " +
                    std::to_string(at(0, 2 * i)) + " elements of " +
                    std::string(name_of(static_cast<dtype>(at(0, 2 * i + 1)))));
    }
  }
}
}  // namespace detail

namespace policy {

/// DDP: at construction, verify that every rank has the same parameters and buffers (count,
/// sizes, dtypes) and broadcast rank 0's values; before each step, broadcast rank 0's buffers when
/// options::broadcast_buffers is set (PyTorch's default).
struct broadcast_from_root {
  /// Checks every rank's parameters against rank 0's and broadcasts rank 0's values.
  template <class Set>
  void on_construct(Set& s) {
    detail::verify_across_ranks(s.group, s.params[0], "parameters");
    detail::verify_across_ranks(s.group, s.bufs[0], "buffers");
    std::vector<tensor_ref> all = s.params[0];
    all.insert(all.end(), s.bufs[0].begin(), s.bufs[0].end());
    detail::broadcast_from_root(s.group, all);
  }
  /// Broadcasts rank 0's buffers when options::broadcast_buffers is set (and average_buffers is
  /// not); when ranks have joined (policy/join.hpp), the lowest rank still stepping is the root.
  /// The buffers go as one broadcast per dtype (detail::coalesced_buffer_broadcast).
  template <class Set>
  void before_step(Set& s) {
    if (s.opts.broadcast_buffers && !s.opts.average_buffers && !s.bufs[0].empty() && s.world_size() > 1)
      s.streams[0]->enqueue([this, &s] {
        buffers_.run<typename Set::backend_type>(s.group, s.bufs[0], s.join.root, s.devices[0]);
      });
  }

 private:
  detail::coalesced_buffer_broadcast buffers_;
};
static_assert(replicate_policy<broadcast_from_root>);

/// DDP with reduce-to-root (a parameter-server style): rank 0 alone updates the model, so its
/// parameters and buffers are broadcast to every rank before each step.
struct broadcast_each_step : broadcast_from_root {
  /// Broadcasts rank 0's parameters and buffers.
  template <class Set>
  void before_step(Set& s) {
    if (s.world_size() == 1) return;
    s.streams[0]->enqueue([&s] {
      std::vector<tensor_ref> all = s.params[0];
      all.insert(all.end(), s.bufs[0].begin(), s.bufs[0].end());
      detail::broadcast_from_root(s.group, all);
    });
  }
};
static_assert(replicate_policy<broadcast_each_step>);

}  // namespace policy
DPARALLEL_NAMESPACE_END

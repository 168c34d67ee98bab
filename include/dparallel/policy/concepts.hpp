#pragma once
// The policy interface in one place (docs/writing-policies.md): what a policy hook may rely on in
// the set it receives (policy_set, composed from one named concept per part of the set), the four
// slot concepts a bundle's member types satisfy, the backend capabilities the shipped policies
// call through, and the archetype set the slot concepts are checked against.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/profile.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <concepts>
#include <cstddef>
#include <memory>
#include <span>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

// ---- Notes the shipped policies cite ------------------------------------------------------------
//
// Note [Step scratch lifetime]
// Lists a policy keeps as members and hands to work it enqueues (copy lists, sum lists, a bucket's
// list of gradients) are read by that work until it completes. The step drains every stream before
// it returns, or throws, so the next step may refill them; within a step they are sized before the
// first enqueue, since growing a vector afterwards would move what enqueued work reads.
//
// Note [Steady-state allocations]
// Per-step members are refilled in place (assign, clear, a resize that does not grow), so once the
// first step has sized them (and DDP's one bucket rebuild is done) a step allocates no list and no
// bucket memory; the streams' work and events still do (parallel::run_step). Checks on the per-step
// path build their message only when they fail. tests/test_perf_allocations.cpp counts this.
//
// Note [Why stripes]
// On host::backend (dp_sharing::stripes, core/dp_plan.hpp) DataParallel's work around the master is
// dealt out in stripes (core/stripes.hpp: 64 KiB or more, round robin): device k reduces its stripes
// of every gradient onto the master, an optimizer stepped through the wrapper updates the same
// stripes, and device k copies them into the other replicas before the next step. Each device keeps
// touching the cache lines it already holds, and the master's update is not serial; which thread
// sums, updates or copies an element changes no bit. cuda::backend (dp_sharing::per_device) gives
// each device one contiguous slice per gradient to reduce and has each replica pull whole tensors.

// ---- What a policy may rely on in its set ----------------------------------------------------
// i indexes the local devices (0 is the master's device), p the parameters in the model's order.

/// The set's types: `model_type` (the user's model), `backend_type`, and the backend's
/// `stream_type` and `event_type`.
template <class S>
concept policy_set_types = requires {
  typename S::model_type;
  typename S::backend_type;
  typename S::stream_type;
  typename S::event_type;
};

/// The local devices: `size()` (DataParallel: the wrapper's devices; DDP: 1), `devices[i]`,
/// `streams[i]` (a pointer to the device's ordered work queue: `enqueue(fn)` returns an event,
/// `record()`, `wait(event)`, `synchronize()`), `models[i]` (`models[0]` is `*master`) and
/// `output_slot` (the index in devices of options::output_device).
template <class S>
concept policy_set_devices = requires(S& s, S const& cs, std::size_t i) {
  { cs.size() } -> std::same_as<std::size_t>;
  { s.devices } -> std::same_as<std::vector<device>&>;
  *s.streams[i];
  *s.models[i];
  *s.master;
  { cs.output_slot } -> std::convertible_to<std::size_t>;
};

/// The models' tensors: `params[i][p]`, `grads[i][p]`, `bufs[i][k]`, tensor_refs refreshed at the
/// start of every step.
template <class S>
concept policy_set_tensors = requires(S& s) {
  { s.params } -> std::same_as<std::vector<std::vector<tensor_ref>>&>;
  { s.grads } -> std::same_as<std::vector<std::vector<tensor_ref>>&>;
  { s.bufs } -> std::same_as<std::vector<std::vector<tensor_ref>>&>;
};

/// The step's plan: `batch` (samples given to step()), `shard_sizes[i]`, `shard_offsets[i]`,
/// `active(i)` (device i received a shard), `weight(i)` (its share of the batch) and
/// `compute_done[i]` (an event: device i's step function finished).
template <class S>
concept policy_set_plan = requires(S& s, S const& cs, std::size_t i) {
  { s.batch } -> std::same_as<std::size_t&>;
  { s.shard_sizes } -> std::same_as<std::vector<std::size_t>&>;
  { s.shard_offsets } -> std::same_as<std::vector<std::size_t>&>;
  { cs.active(i) } -> std::same_as<bool>;
  { cs.weight(i) } -> std::same_as<double>;
  s.compute_done[i];
};

/// The process group: `group` (DDP: this rank's process_group; empty for DataParallel), `rank()`
/// and `world_size()` (0 and 1 without a group).
template <class S>
concept policy_set_group = requires(S& s, S const& cs) {
  { s.group } -> std::same_as<process_group&>;
  { cs.rank() } -> std::same_as<int>;
  { cs.world_size() } -> std::same_as<int>;
};

/// The wrapper's settings: `opts` (its options) and `sync` (false inside DDP's no_sync(): reduce
/// nothing, accumulate).
template <class S>
concept policy_set_options = requires(S& s) {
  { s.opts } -> std::same_as<options&>;
  { s.sync } -> std::same_as<bool&>;
};

/// This rank's part in a synchronised DDP step (options::uneven_inputs, average_mode::samples;
/// policy/join.hpp decides it before the step's other collectives): `join.scale`, the factor a DDP
/// reducer applies to this rank's gradient before averaging over the ranks (exactly 1 when every
/// rank contributes equally, 0 for a rank that has joined, world * n_r / N under sample
/// weighting), and `join.root`, the lowest rank still stepping (the root of buffer broadcasts).
/// A reducer that ignores `join.scale` gives wrong averages with uneven inputs or sample weighting.
template <class S>
concept policy_set_join = requires(S const& cs) {
  { cs.join.scale } -> std::convertible_to<double>;
  { cs.join.root } -> std::convertible_to<int>;
};

/// What a policy hook may rely on in the set it receives: the stable, documented interface of
/// replica_set (anything else in that type is the library's own and may change).
template <class S>
concept policy_set = policy_set_types<S> && policy_set_devices<S> && policy_set_tensors<S> && policy_set_plan<S> &&
                     policy_set_group<S> && policy_set_options<S> && policy_set_join<S>;

namespace detail {
/// The slot concepts' stand-in for a set: policy_set's members and nothing else, so a hook whose
/// signature asks for more than the interface fails its slot's concept.
struct archetype_set {
  struct model_type {};
  struct event_type {};
  struct stream_type {};
  struct backend_type {
    using stream_type = archetype_set::stream_type;
    using event_type = archetype_set::event_type;
  };
  struct join_part {
    double scale = 1.0;
    int root = 0;
  };

  model_type* master = nullptr;
  std::vector<device> devices;
  std::vector<model_type*> models;
  std::vector<std::unique_ptr<stream_type>> streams;
  std::size_t output_slot = 0;
  options opts;
  process_group group;
  bool sync = true;
  join_part join;
  std::vector<std::vector<tensor_ref>> params, grads, bufs;
  std::size_t batch = 0;
  std::vector<std::size_t> shard_sizes, shard_offsets;
  std::vector<event_type> compute_done;

  [[nodiscard]] std::size_t size() const noexcept { return devices.size(); }
  [[nodiscard]] int rank() const { return 0; }
  [[nodiscard]] int world_size() const { return 1; }
  [[nodiscard]] bool active(std::size_t i) const noexcept { return shard_sizes[i] != 0; }
  [[nodiscard]] double weight(std::size_t) const noexcept { return 1.0; }
};
static_assert(policy_set<archetype_set>);
}  // namespace detail

// ---- The four slots ----------------------------------------------------------------------------

/// A scatter policy maps (batch size, number of local devices, options) to per-device shard
/// sizes; entry i belongs to device i, missing or zero entries mean no shard for that device.
/// The wrapper holds one policy object and calls `p.shard_sizes(b, n, o)` on it, so a static
/// member function (the stateless policies) and a member function (policies with state) both do.
template <class P>
concept scatter_policy = std::semiregular<P> && requires(P& p, std::size_t b, std::size_t n, options const& o) {
  { p.shard_sizes(b, n, o) } -> std::same_as<std::vector<std::size_t>>;
};

/// A scatter policy that learns from the steps it planned: after every step that succeeded, the
/// wrapper calls `p.observe(profile)` with that step's step_profile (shard sizes and each
/// device's compute time among it). Optional: policies without observe() are never told.
template <class P>
concept observing_scatter_policy = scatter_policy<P> && requires(P& p, step_profile const& s) { p.observe(s); };

/// A replicate policy is told when the wrapper is built and before each step's compute.
template <class P>
concept replicate_policy = std::semiregular<P> && requires(P& p, detail::archetype_set& s) {
  p.on_construct(s);
  p.before_step(s);
};

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

/// A gather policy turns the outputs of the replicas that ran (device order) into step()'s result.
template <class P>
concept gather_policy = std::semiregular<P> && requires(std::vector<float>&& outs, detail::archetype_set& s) {
  P::gather(std::move(outs), s);
};

// ---- Backend capabilities the shipped policies call through ---------------------------------------

namespace detail {
/// Backends with the borrowed form of copy_all (host::backend, cuda::backend): the policies pass
/// it lists they keep as members instead of building new vectors every step.
template <class Backend>
concept borrowed_copy_all = requires(typename Backend::stream_type& s, std::span<tensor_ref const> t) {
  Backend::copy_all(s, t, t);
};

/// Backends with the borrowed form of weighted_sum (host::backend, cuda::backend): several sums
/// over lists the caller keeps, as one piece of work.
template <class Backend>
concept borrowed_weighted_sum = requires(typename Backend::stream_type& s, std::span<tensor_ref const> t,
                                         std::span<double const> w) { Backend::weighted_sum(s, t, t, w); };

/// Backend::copy_all over lists the caller keeps: in one call, borrowed where the backend has that
/// form, else over copies of the lists. The policies have one path either way.
template <class Backend>
auto copy_all_kept(typename Backend::stream_type& s, std::span<tensor_ref const> dst, std::span<tensor_ref const> src) {
  if constexpr (borrowed_copy_all<Backend>)
    return Backend::copy_all(s, dst, src);
  else
    return Backend::copy_all(s, std::vector<tensor_ref>(dst.begin(), dst.end()),
                             std::vector<tensor_ref>(src.begin(), src.end()));
}

/// dst[j] = sum_i w[i] * src[j * w.size() + i] for every j, over lists the caller keeps: one call
/// where the backend has the borrowed weighted_sum, one call per dst[j] otherwise.
template <class Backend>
void weighted_sums_kept(typename Backend::stream_type& s, std::span<tensor_ref const> dst,
                        std::span<tensor_ref const> src, std::span<double const> w) {
  if constexpr (borrowed_weighted_sum<Backend>) {
    Backend::weighted_sum(s, dst, src, w);
  } else {
    for (std::size_t j = 0; j < dst.size(); ++j) {
      auto const mine = src.subspan(j * w.size(), w.size());
      Backend::weighted_sum(s, dst[j], std::vector<tensor_ref>(mine.begin(), mine.end()),
                            std::vector<double>(w.begin(), w.end()));
    }
  }
}
}  // namespace detail

DPARALLEL_NAMESPACE_END

#pragma once
// The host communicator: ranks are threads of one process and collectives read and write the
// ranks' buffers in place through shared memory, with no staging copies.
//
// Each rank's communicator owns a communication thread (its "comm stream") that runs the rank's
// collectives in the order they were issued; a call returns a work at once. For an all_reduce of
// L elements over n ranks, rank r reduces its share of the elements of every rank's buffer (stripes of
// 64 KiB or more dealt out round robin: rank r takes stripes r, r + n, ...; for_each_stripe says why), in
// rank order 0..n-1, and writes the result into those elements of every rank's buffer; the ranks
// then meet before their works complete. Messages of at most 64 KiB per rank take a one-meeting path
// (the rank that arrives last computes every slice, element by element the same sums), which
// keeps the latency of small collectives low. Results are therefore the same bits on every rank,
// on either path and from run to run. reduce, broadcast, reduce_scatter and all_gather work the same way; reductions take
// F32, F64, F16 and BF16 (the 16-bit types summed in float, in the same rank order, and rounded
// once to nearest even at the end: exactly the F32 result of the widened inputs, rounded; avg
// multiplies the float sum by 1.0f / n before that rounding), broadcast and all_gather any dtype.
//
// Failures reach every rank: a rank that has not arrived within the timeout (timeout_error naming
// it), abort() (comm_error naming the aborting rank and its reason), mismatched collectives
// (comm_error showing both calls) and invalid arguments (invalid_argument on the caller; the
// group is aborted so its peers fail at once rather than at the timeout) all fail every pending
// and future collective of the group. A failed group stays failed: make a new one. A timeout
// counts from the moment a rank's thread starts the collective (its earlier ones are done), per
// phase: waiting for the peers to arrive, and waiting for them to finish their slices.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/engine_base.hpp>
#include <dparallel/comm/detail/host_group.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace host {

/// One thread rank's endpoint of a host process group. Made by make_group / make_communicators;
/// neither copyable nor movable (its thread refers to it); share it through process_group.
class communicator : public dparallel::detail::engine_base<communicator, true> {
 public:
  /// Rank `rank` of `group`; use make_group or make_communicators instead.
  communicator(std::shared_ptr<dparallel::detail::host_group> group, int rank, std::chrono::milliseconds timeout)
      : group_(std::move(group)), rank_(rank), queue_(timeout, [this](task& t) { return run(t); }) {}
  communicator(communicator const&) = delete;
  communicator& operator=(communicator const&) = delete;

  /// Joins the communication thread. Collectives still pending make the group abort first (their
  /// peers could otherwise wait for this rank until the timeout); with none pending, the rank is
  /// closed, so peers waiting for a later collective of this rank fail at once.
  ~communicator() {
    queue_.stop([&](std::string const& why) { group_->abort(rank_, why); },
                [&](std::uint64_t last) { group_->close(rank_, last); });
  }

  /// This rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of ranks.
  [[nodiscard]] int size() const noexcept { return group_->size(); }

  // all_reduce, reduce, broadcast, reduce_scatter, all_gather, barrier and the *_coalesced calls
  // (in place over every rank's buffers, summed in rank order): engine_base.

  /// Fails every pending and future collective of every rank with a comm_error naming this rank
  /// and `why`. The first failure of a group wins; later aborts change nothing.
  void abort(std::string why) { group_->abort(rank_, why); }

  /// How long a collective waits for its peers before failing with timeout_error.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return queue_.timeout(); }
  /// Applies to the collectives issued after the call.
  void set_timeout(std::chrono::milliseconds t) { queue_.set_timeout(t, "host::communicator"); }

  /// Collectives this rank has finished, successfully or not. Incremented before the work
  /// completes, so after w.wait() it counts w.
  [[nodiscard]] std::uint64_t completed_ops() const noexcept { return queue_.completed_ops(); }

  /// Blocks until every collective issued so far has finished (successfully or not). The
  /// collectives the communication thread has not started yet run on the calling thread (in
  /// order, one at a time, as that thread would): a caller that only waits costs no hand-off.
  void drain() { queue_.drain(); }

  /// When no collective of this rank is pending, the ones issued from now on do not wake the
  /// communication thread: the next drain() runs them on its caller, release() hands them to the
  /// thread (with some pending, nothing changes: they are the thread's to run). For a caller that
  /// issues a few collectives and then only waits for them (DDP's flush after backward): no
  /// hand-off and no wake-up per step. Their works complete only once one of the two is called.
  void hold() { queue_.hold(); }
  /// Ends a hold(): the communication thread runs what was held.
  void release() { queue_.release(); }

  /// This rank's subgroup of a split of this group (see process_group::split), sharing this
  /// group's timeout; empty when the rank is in none. Every rank calls it, with the same plan.
  process_group subgroup(dparallel::detail::subgroup_plan const& plan) {
    std::uint64_t const id = splits_++;  // the same on every rank: splits are collectives
    if (plan.mine < 0) return {};
    auto group = group_->subgroup(id, plan.mine, plan.members());
    return process_group(std::make_shared<communicator>(std::move(group), plan.group_rank, timeout()));
  }

  /// Declares that this rank issues no more collectives: peers waiting for a later one fail at
  /// once (timeout_error naming this rank) instead of at the timeout. Later calls throw.
  void close() {
    group_->close(rank_, queue_.last_issued([&] { closed_ = true; }));
  }

 private:
  friend class dparallel::detail::engine_base<communicator, true>;
  using task = dparallel::detail::comm_task;
  static constexpr std::string_view error_prefix = "dparallel: ";

  work issue(dparallel::detail::comm_call const& c, tensor_ref a, tensor_ref b, std::span<tensor_ref const> list) {
    return queue_.issue(c, a, b, list, [&](dparallel::detail::comm_call const& call) {
      dparallel::detail::require(!closed_, [&] {
        return "host::communicator: rank " + std::to_string(rank_) + " called " + dparallel::detail::describe(call) +
               " after it was closed (its spawn function returned)";
      });
    });
  }

  [[nodiscard]] static std::string device_problem(tensor_ref t, char const* name) {
    return host_memory_problem(t, name, "the host communicator moves host memory only");
  }
  [[nodiscard]] static std::string dtype_problem(dparallel::detail::comm_call const& c, tensor_ref) {
    if (dparallel::detail::host_reducible(c.type)) return {};
    return unreducible("host", "F32, F64, F16 and BF16", c.type);
  }

  // On the communication thread, for each collective in the order issued.
  std::exception_ptr run(task& t) {
    return dparallel::detail::failure_of([&] { return group_->execute(rank_, t.seq, t.call, t.a, t.b, t.timeout, t.list); });
  }

  std::shared_ptr<dparallel::detail::host_group> group_;
  int rank_;
  bool closed_ = false;       // under the queue's mutex
  std::uint64_t splits_ = 0;  // subgroups made so far (on the thread that issues collectives)
  dparallel::detail::queued_collectives queue_;  // last: its thread starts after the other members exist
};

static_assert(dparallel::communicator<communicator>);

/// `world_size` communicators sharing one group, rank i at index i.
inline std::vector<std::shared_ptr<communicator>> make_communicators(
    int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(300)) {
  dparallel::detail::require(world_size > 0, "host::make_group: expected a world size of at least 1, found " +
                                                 std::to_string(world_size));
  dparallel::detail::require(timeout.count() > 0, "host::make_group: expected a positive timeout, found " +
                                                      std::to_string(timeout.count()) + " ms");
  auto group = std::make_shared<dparallel::detail::host_group>(world_size);
  std::vector<std::shared_ptr<communicator>> out;
  out.reserve(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_shared<communicator>(group, r, timeout));
  return out;
}

/// The shared state of `world_size` thread ranks: one process_group per rank, rank i at index i.
/// Hand element i to the thread that plays rank i. `timeout` bounds every wait for a peer.
inline std::vector<process_group> make_group(int world_size,
                                             std::chrono::milliseconds timeout = std::chrono::seconds(300)) {
  std::vector<process_group> out;
  for (auto& c : make_communicators(world_size, timeout)) out.emplace_back(std::move(c));
  return out;
}

}  // namespace host
DPARALLEL_NAMESPACE_END

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
#include <dparallel/comm/detail/call_checks.hpp>
#include <dparallel/comm/detail/host_group.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/task_queue.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace host {

/// One thread rank's endpoint of a host process group. Made by make_group / make_communicators;
/// neither copyable nor movable (its thread refers to it); share it through process_group.
class communicator {
 public:
  /// Rank `rank` of `group`; use make_group or make_communicators instead.
  communicator(std::shared_ptr<dparallel::detail::host_group> group, int rank, std::chrono::milliseconds timeout)
      : group_(std::move(group)), rank_(rank), timeout_ms_(timeout.count()), queue_([this](task& t) { run(t); }) {}
  communicator(communicator const&) = delete;
  communicator& operator=(communicator const&) = delete;

  /// Joins the communication thread. Collectives still pending make the group abort first (their
  /// peers could otherwise wait for this rank until the timeout); with none pending, the rank is
  /// closed, so peers waiting for a later collective of this rank fail at once.
  ~communicator() {
    auto const [pending, last] = queue_.locked([&] { return std::pair(queue_.pending(), next_seq_ - 1); });
    if (pending != 0) {
      group_->abort(rank_, "its communicator was destroyed with " + std::to_string(pending) + " collective" +
                               (pending == 1 ? "" : "s") + " pending");
    } else {
      group_->close(rank_, last);
    }
    queue_.stop();
  }

  /// This rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of ranks.
  [[nodiscard]] int size() const noexcept { return group_->size(); }

  /// See communicator: in place, summed in rank order.
  work all_reduce(tensor_ref t, reduce_op op = reduce_op::sum) {
    dparallel::detail::comm_call c{dparallel::detail::comm_kind::all_reduce, t.dtype(), t.size(), t.size(), op, 0};
    check_tensor(c, t, "t");
    check_reducible(c);
    return issue(c, t, {});
  }

  /// See process_group::all_reduce_coalesced: in place over the tensors, read as one array (the
  /// same stripes, sums and bits as all_reduce of that array). `tensors` is read while the
  /// collective runs: keep it alive and unchanged until the work completes (so for the two below).
  work all_reduce_coalesced(std::span<tensor_ref const> tensors, reduce_op op = reduce_op::sum) {
    auto const c = listed(dparallel::detail::comm_kind::all_reduce, tensors, {}, op);
    check_reducible(c);
    return issue(c, {}, {}, tensors);
  }
  /// See process_group::reduce_scatter_coalesced: block rank() of every rank's array summed into
  /// `out`, read from the tensors in place (the sums and bits of reduce_scatter).
  work reduce_scatter_coalesced(tensor_ref out, std::span<tensor_ref const> in, reduce_op op = reduce_op::sum) {
    auto const c = listed(dparallel::detail::comm_kind::reduce_scatter, in, out, op);
    check_reducible(c);
    return issue(c, out, {}, in);
  }
  /// See process_group::all_gather_coalesced: this rank's block of its array copied into every
  /// other rank's array in place.
  work all_gather_coalesced(std::span<tensor_ref const> tensors) {
    return issue(listed(dparallel::detail::comm_kind::all_gather, tensors, {}, reduce_op::sum), {}, {}, tensors);
  }

  /// See communicator: in place onto `root`, summed in rank order.
  work reduce(tensor_ref t, int root, reduce_op op = reduce_op::sum) {
    dparallel::detail::comm_call c{dparallel::detail::comm_kind::reduce, t.dtype(), t.size(), t.size(), op, root};
    check_tensor(c, t, "t");
    check_reducible(c);
    check_root(c);
    return issue(c, t, {});
  }

  /// See communicator.
  work broadcast(tensor_ref t, int root) {
    dparallel::detail::comm_call c{dparallel::detail::comm_kind::broadcast, t.dtype(), t.size(), t.size(),
                                   reduce_op::sum, root};
    check_tensor(c, t, "t");
    check_root(c);
    return issue(c, t, {});
  }

  /// out: n elements; in: size()*n elements. out may be in's block rank() (in place) or disjoint from in.
  work reduce_scatter(tensor_ref out, tensor_ref in, reduce_op op = reduce_op::sum) {
    dparallel::detail::comm_call c{dparallel::detail::comm_kind::reduce_scatter, out.dtype(), out.size(), in.size(),
                                   op, 0};
    check_tensor(c, out, "out");
    check_tensor(c, in, "in");
    check_reducible(c);
    check_blocks(c, out, in, "out", "in");
    return issue(c, out, in);
  }

  /// in: n elements; out: size()*n elements. in may be out's block rank() (in place) or disjoint from out.
  work all_gather(tensor_ref out, tensor_ref in) {
    dparallel::detail::comm_call c{dparallel::detail::comm_kind::all_gather, in.dtype(), in.size(), out.size(),
                                   reduce_op::sum, 0};
    check_tensor(c, out, "out");
    check_tensor(c, in, "in");
    check_blocks(c, in, out, "in", "out");
    return issue(c, out, in);
  }

  /// See communicator.
  work barrier() { return issue(dparallel::detail::comm_call{}, {}, {}); }

  /// Fails every pending and future collective of every rank with a comm_error naming this rank
  /// and `why`. The first failure of a group wins; later aborts change nothing.
  void abort(std::string why) { group_->abort(rank_, why); }

  /// How long a collective waits for its peers before failing with timeout_error.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  /// Applies to the collectives issued after the call.
  void set_timeout(std::chrono::milliseconds t) {
    dparallel::detail::require(t.count() > 0, "host::communicator::set_timeout: expected a positive timeout, found " +
                                                  std::to_string(t.count()) + " ms");
    timeout_ms_.store(t.count(), std::memory_order_relaxed);
  }

  /// Collectives this rank has finished, successfully or not. Incremented before the work
  /// completes, so after w.wait() it counts w.
  [[nodiscard]] std::uint64_t completed_ops() const noexcept {
    return completed_.load(std::memory_order_acquire);
  }

  /// Blocks until every collective issued so far has finished (successfully or not). The
  /// collectives the communication thread has not started yet run on the calling thread (in
  /// order, one at a time, as that thread would): a caller that only waits costs no hand-off.
  void drain() {
    queue_.help_until_idle([] {});
  }

  /// When no collective of this rank is pending, the ones issued from now on do not wake the
  /// communication thread: the next drain() runs them on its caller, release() hands them to the
  /// thread (with some pending, nothing changes: they are the thread's to run). For a caller that
  /// issues a few collectives and then only waits for them (DDP's flush after backward): no
  /// hand-off and no wake-up per step. Their works complete only once one of the two is called.
  void hold() { (void)queue_.hold_if_idle(); }
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
    std::uint64_t const last = queue_.locked([&] {
      closed_ = true;
      return next_seq_ - 1;
    });
    group_->close(rank_, last);
  }

 private:
  using task = dparallel::detail::comm_task;

  work issue(dparallel::detail::comm_call const& c, tensor_ref a, tensor_ref b,
             std::span<tensor_ref const> list = {}) {
    dparallel::detail::work_promise p;
    work w = p.get_work();
    queue_.push([&] {
      dparallel::detail::require(!closed_, [&] {
        return "host::communicator: rank " + std::to_string(rank_) + " called " + dparallel::detail::describe(c) +
               " after it was closed (its spawn function returned)";
      });
      return task{next_seq_++, c, a, b, timeout(), std::move(p), list};
    });
    return w;
  }

  // Invalid arguments abort the group (its peers would otherwise wait for this rank until the
  // timeout), then throw invalid_argument on the caller.
  [[noreturn]] void reject(dparallel::detail::comm_call const& c, std::string const& what) {
    std::string const msg = std::string(dparallel::detail::kind_name(c.kind)) + " on rank " + std::to_string(rank_) +
                            ": " + what;
    group_->abort(rank_, "invalid arguments to " + msg);
    throw invalid_argument("dparallel: " + msg);
  }

  dparallel::detail::comm_call listed(dparallel::detail::comm_kind k, std::span<tensor_ref const> tensors,
                                      tensor_ref out, reduce_op op) {
    return dparallel::detail::coalesced_call(
        k, tensors, out, op, size(), [&](auto const& call, tensor_ref t, char const* name) { check_tensor(call, t, name); },
        [&](auto const& call, std::string const& problem) { reject(call, problem); });
  }

  void check_tensor(dparallel::detail::comm_call const& c, tensor_ref t, char const* name) {
    if (t.device().kind != device_kind::host) {
      reject(c, std::string("expected `") + name + "` in host memory, found a view on " + to_string(t.device()) +
                    "; the host communicator moves host memory only");
    }
    if (auto const problem = dparallel::detail::null_data_problem(t, name); !problem.empty()) reject(c, problem);
  }

  void check_reducible(dparallel::detail::comm_call const& c) {
    if (!dparallel::detail::host_reducible(c.type)) {
      reject(c, "the host communicator reduces F32, F64, F16 and BF16, found " + std::string(name_of(c.type)) +
                    "; convert the data, or use broadcast / all_gather, which move any dtype");
    }
  }

  void check_root(dparallel::detail::comm_call const& c) {
    if (auto const problem = dparallel::detail::root_problem(c.root, size()); !problem.empty()) reject(c, problem);
  }

  void check_blocks(dparallel::detail::comm_call const& c, tensor_ref small, tensor_ref big, char const* small_name,
                    char const* big_name) {
    auto const problem = dparallel::detail::blocks_problem(small, big, small_name, big_name, size(), rank_);
    if (!problem.empty()) reject(c, problem);
  }

  // On the communication thread, for each collective in the order issued.
  void run(task& t) {
    std::exception_ptr failure;
    try {
      failure = group_->execute(rank_, t.seq, t.call, t.a, t.b, t.timeout, t.list);
    } catch (...) {
      failure = std::current_exception();  // only an allocation failure can get here
    }
    // Not pending any more before anyone can see the work complete: a rank that waits for its
    // last work and then destroys its communicator must not find it still pending.
    queue_.retire([] {});
    completed_.fetch_add(1, std::memory_order_release);
    t.done.complete(std::move(failure));
  }

  std::shared_ptr<dparallel::detail::host_group> group_;
  int rank_;
  std::atomic<std::int64_t> timeout_ms_;
  std::atomic<std::uint64_t> completed_{0};
  std::uint64_t next_seq_ = 1;  // under the queue's mutex, as closed_
  bool closed_ = false;
  std::uint64_t splits_ = 0;  // subgroups made so far (on the thread that issues collectives)
  dparallel::detail::task_queue<task> queue_;  // last: its thread starts after the other members exist
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

#pragma once
// dparallel::shm — process groups whose ranks are processes of one node, exchanging data through
// one POSIX shared-memory segment (shm_open + mmap). No MPI needed: the segment's name travels
// through a bootstrap (MPI under mpirun: comm/mpi.hpp uses this engine by itself when the whole
// job is on one node; the torchrun-style variables + the TCP rendezvous otherwise).
//
//   // MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set by the launcher:
//   auto group = dparallel::shm::init_process_group();
//   dparallel::distributed_data_parallel<my_model> ddp(model, group);
//
// Results. Reductions sum every element over the ranks in rank order 0..n-1 with the host
// communicator's kernel, so every collective gives bitwise what the same number of thread ranks
// (host::make_group, spawn) gives, and DDP over N processes trains bitwise the parameters of DDP
// over N thread ranks. F32 and F64 are summed and averaged, I32, I64 and U8 summed (wrapping);
// broadcast and all_gather move any dtype. The algorithms: shm/detail/collectives.hpp.
//
// Asynchrony. As the host communicator: each rank's communicator owns a communication thread that
// runs its collectives in the order issued; a call returns a work at once, so DDP's bucket
// all-reduces overlap backward. A rank's thread touches only its own process's buffers and the
// segment: when a work completes (successfully or not), nothing touches its buffers any more.
//
// Synchronisation. Lock-free atomics in the segment (std::atomic_ref on plain words) and a futex on
// Linux; no process-shared mutex, so a process that dies leaves nothing locked. See
// shm/detail/group.hpp.
//
// Failures never hang: a rank that does not arrive within the timeout (timeout_error naming it),
// a rank whose process died (comm_error naming it, found within milliseconds while its peers
// wait; a rank in another PID namespace, e.g. another container sharing /dev/shm, only at the
// timeout), a rank that finished (destroyed its group) while its peers wait for a collective
// (comm_error naming it, at once), abort() on any rank, mismatched collectives (comm_error showing both calls), and invalid
// arguments (invalid_argument on the caller, the group aborted) fail every pending and future
// collective of every rank. A failed group stays failed.
//
// The segment. Rank 0 creates it, the name reaches the other ranks through the bootstrap, and it
// is unlinked as soon as every rank has mapped it, so nothing is left in /dev/shm whatever way the
// processes end (a setup that fails unlinks it too). See shm/detail/segment.hpp.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/detail/engine_base.hpp>
#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/comm/rendezvous.hpp>
#include <dparallel/comm/shm_options.hpp>
#include <dparallel/comm/shm/detail/bootstrap.hpp>
#include <dparallel/comm/shm/detail/collectives.hpp>
#include <dparallel/comm/shm/detail/group.hpp>
#include <dparallel/comm/shm/detail/subgroup.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace shm {

/// One rank's endpoint of a shared-memory process group. Made by make_group / init_process_group
/// (or mpi::make_group on one node); share it through process_group.
class communicator : public dparallel::detail::engine_base<communicator, true> {
 public:
  /// Rank `group.rank()` of a joined group; use make_group instead.
  communicator(std::shared_ptr<dparallel::detail::shm_group> group, std::chrono::milliseconds timeout)
      : group_(std::move(group)), runner_(*group_), queue_(timeout, [this](task& t) { return run(t); }) {}
  communicator(communicator const&) = delete;
  communicator& operator=(communicator const&) = delete;

  /// Joins the communication thread. Collectives still pending abort the group first; with none
  /// pending the rank is closed, so peers waiting for a later collective fail at once.
  ~communicator() {
    queue_.stop([&](std::string const& why) { group_->abort(rank(), why); },
                [&](std::uint64_t last) { group_->close(last); });
  }

  /// This rank.
  [[nodiscard]] int rank() const noexcept { return group_->rank(); }
  /// Number of ranks.
  [[nodiscard]] int size() const noexcept { return group_->size(); }

  // all_reduce, reduce, broadcast, reduce_scatter, all_gather, barrier and the *_coalesced calls
  // (copied into the segment and the results out of it, summed in rank order): engine_base.

  /// Fails every pending and future collective of every rank with a comm_error naming this rank and `why`.
  void abort(std::string why) { group_->abort(rank(), why); }

  /// How long a collective waits for its peers (per meeting) before failing with timeout_error.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return queue_.timeout(); }
  /// Applies to the collectives issued after the call.
  void set_timeout(std::chrono::milliseconds t) { queue_.set_timeout(t, "shm::communicator"); }
  /// Collectives this rank has finished, successfully or not (counted before the work completes).
  [[nodiscard]] std::uint64_t completed_ops() const noexcept { return queue_.completed_ops(); }
  /// Blocks until every collective issued so far has finished; runs the ones not started yet on the caller.
  void drain() { queue_.drain(); }
  /// As host::communicator::hold: with nothing pending, the collectives issued from now on wait
  /// for the next drain() (which runs them on its caller) or release(), without waking the thread.
  void hold() { queue_.hold(); }
  /// Ends a hold(): the communication thread runs what was held.
  void release() { queue_.release(); }

  /// `bytes` zeroed bytes of this rank's group memory (see process_group::allocate), or null when
  /// it has no room left; valid while the returned pointer (or a copy) lives.
  [[nodiscard]] std::shared_ptr<std::byte> allocate(std::size_t bytes) {
    std::byte* const p = group_->arena().take(bytes);
    if (p == nullptr) return nullptr;
    return std::shared_ptr<std::byte>(p, [g = group_](std::byte* q) { g->arena().give(q); });
  }

  /// This rank's subgroup of a split (see process_group::split): a shared-memory group of its
  /// own segment (shm/detail/subgroup.hpp), with this group's timeout; empty when the rank is in
  /// none. Every rank calls it, with the same plan.
  process_group subgroup(dparallel::detail::subgroup_plan const& plan) {
    auto const gather = [this](std::vector<std::uint8_t>& out, std::vector<std::uint8_t>& in) {
      all_gather(view(out), view(in)).wait();
    };
    auto group = dparallel::detail::join_shm_subgroup(plan, *group_, gather, timeout());
    if (!group) return {};
    return process_group(std::make_shared<communicator>(std::move(group), timeout()));
  }

 private:
  friend class dparallel::detail::engine_base<communicator, true>;
  using task = dparallel::detail::comm_task;
  static constexpr std::string_view error_prefix = "dparallel: shm::communicator: ";

  work issue(dparallel::detail::comm_call const& c, tensor_ref a, tensor_ref b, std::span<tensor_ref const> list) {
    return queue_.issue(c, a, b, list, [](dparallel::detail::comm_call const&) {});
  }

  [[nodiscard]] static std::string device_problem(tensor_ref t, char const* name) {
    return host_memory_problem(t, name, "the shared-memory communicator moves host memory only");
  }
  [[nodiscard]] static std::string dtype_problem(dparallel::detail::comm_call const& c, tensor_ref) {
    if (!dparallel::detail::shm_reducible(c.type))
      return unreducible("shared-memory", "F32, F64, F16, BF16, I32, I64 and U8", c.type);
    return avg_problem(c);
  }

  // On the communication thread (or a draining caller), one collective at a time, in order.
  std::exception_ptr run(task& t) {
    return dparallel::detail::failure_of([&] { return runner_.run(t.seq, t.call, t.a, t.b, t.timeout, t.list); });
  }

  std::shared_ptr<dparallel::detail::shm_group> group_;
  dparallel::detail::shm_runner runner_;
  dparallel::detail::queued_collectives queue_;  // last: its thread starts after the other members exist
};

static_assert(dparallel::communicator<communicator>);

/// Rank `rank` of a `world_size`-rank shared-memory group on this node. `share` carries rank 0's
/// bytes (the segment's name and token) to every rank (see shm::bootstrap_fn); every rank calls
/// make_group with the same world size, options and a share function of the same bootstrap.
/// Throws timeout_error naming the ranks that did not join within `timeout`.
inline process_group make_group(int rank, int world_size, bootstrap_fn const& share,
                                std::chrono::milliseconds timeout = std::chrono::seconds(300), options opts = {}) {
  auto group = dparallel::detail::join_shm_group(rank, world_size, share, timeout, opts);
  return process_group(std::make_shared<communicator>(std::move(group), timeout));
}

/// The process group of a job started by a torchrun-style launcher without MPI: RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (or init_options) as resolve_launch
/// reads them; the segment's name goes through tcp_rendezvous. Every rank must be on this node
/// (LOCAL_WORLD_SIZE == WORLD_SIZE, and the rendezvous checks the node of every rank): across
/// nodes, launch with MPI (dparallel::mpi::init_process_group), which is an invalid_argument here.
inline distributed_group init_process_group(init_options const& init = {}, options opts = {},
                                            environment const& env = process_environment()) {
  dparallel::detail::require(init.timeout.count() > 0, "shm::init_process_group: expected a positive timeout, found " +
                                                           std::to_string(init.timeout.count()) + " ms");
  launch_info info = resolve_launch(init, env);
  if (info.local_world_size != info.world_size)
    throw invalid_argument(
        "dparallel: shm::init_process_group: the job has " + std::to_string(info.world_size) + " ranks but " +
        std::to_string(info.local_world_size) + " on this node (" + info.local_source +
        "); without MPI, dparallel's process groups span one node (shared memory). Launch a job on several nodes "
        "with MPI (mpirun / srun, dparallel::mpi::init_process_group), or run all ranks on one node");
  auto const share = dparallel::detail::rendezvous_bootstrap(info, init.timeout);
  return dparallel::detail::finish_init(make_group(info.rank, info.world_size, share, init.timeout, opts),
                                        std::move(info), init, env);
}

}  // namespace shm
DPARALLEL_NAMESPACE_END

#pragma once
// dparallel::mpi — process groups over MPI: ranks are processes started by mpirun or srun, and
// collectives move host memory (device memory too, with a CUDA-aware MPI, when the user says so).
// This header includes <mpi.h>; link the add-on target dparallel::mpi. The umbrella header
// <dparallel/dparallel.hpp> never includes it.
//
//   auto group = dparallel::mpi::init_process_group();     // rank, world size, local rank from the launcher
//   dparallel::distributed_data_parallel<my_model> ddp(model, group);
//
// Threads. All MPI calls of dparallel happen on one progress thread per process (shared by every
// MPI communicator of the process), so MPI needs MPI_THREAD_SERIALIZED at least. When dparallel
// initialises MPI it asks for MPI_THREAD_MULTIPLE (so the program may call MPI itself too) and
// finalises it at exit; a program that initialised MPI itself must have asked for SERIALIZED or
// MULTIPLE, must not call MPI concurrently with dparallel unless it has MULTIPLE, and should call
// dparallel::mpi::finalize() before its own MPI_Finalize (dparallel also stops its thread from an
// MPI_COMM_SELF attribute callback at MPI_Finalize, which is safe with MULTIPLE).
//
// Collectives are asynchronous: a call queues the collective and returns a work; the progress
// thread runs each communicator's collectives one at a time in issue order with nonblocking MPI
// (MPI_Ialltoallv, MPI_Iallgatherv, MPI_Igatherv, MPI_Iallreduce, MPI_Ireduce,
// MPI_Ireduce_scatter_block, MPI_Ialltoall, MPI_Iallgather, MPI_Ibcast, MPI_Ibarrier), testing
// them (MPI_Test) while it also serves the control messages below and watches the timeout. The
// caller's thread keeps computing: DDP's bucket all-reduces overlap backward.
//
// Determinism. With options::reduce = reduction::rank_order (the default), F32/F64 reductions
// never use MPI's reduction: each rank receives its slice [r*L/n, (r+1)*L/n) of every rank's
// buffer (MPI_Ialltoallv), sums it in rank order 0..n-1 with the host communicator's kernel, and
// the slices are gathered back (MPI_Iallgatherv / MPI_Igatherv). Every element is therefore
// ((x0 + x1) + x2) + ... (times T(1)/T(n) for avg), exactly as the thread-rank host communicator
// computes it: the same bits as host DDP with the same world size, on every rank, run to run.
// It moves the same bytes as a ring reduce-scatter + all-gather. reduction::native uses
// MPI_Iallreduce / MPI_Ireduce / MPI_Ireduce_scatter_block with MPI_SUM: MPI picks the order (Open
// MPI's choice depends only on sizes, so it is repeatable, but it is not rank order: results are
// within rounding of rank_order, not bitwise equal). Integer sums (I32, I64, U8; sum only, wrapping
// like unsigned arithmetic) always take the rank-order path: they are exact in any order, and Open
// MPI 4.1's MPI_SUM saturates U8 instead of wrapping (measured). F16/BF16 (sum and avg) always take
// the rank-order path too, whatever options::reduce says (MPI has no 16-bit floating-point sum):
// each element is the F32 rank-order reduction of the widened inputs, rounded once to nearest
// even, bitwise the host communicator's result. Device memory (options::cuda_aware) of F16/BF16
// cannot be reduced through MPI: such a call is rejected.
//
// Staging. Host collectives copy the caller's data into a staging buffer owned by the
// communicator and copy results back on completion: MPI never touches the caller's memory after a
// work completed, also when it failed or was aborted (MPI cannot cancel a collective; a failed one
// stays in flight on the staging buffer). Device memory (options::cuda_aware) is passed to MPI
// directly: then buffers of failed collectives must stay allocated until the process exits.
//
// Failures never hang. Each rank's progress thread serves a control channel (a duplicate of the
// communicator) with point-to-point messages:
//  - abort(why) on any rank fails every pending and future collective of that rank and sends an
//    ABORT notice to every peer, whose collectives then fail at once with a comm_error naming the
//    aborting rank and `why` (DDP aborts the group when a step throws);
//  - a collective that has not completed within the timeout asks every peer for its status (how
//    many collectives it has issued, what it called as that number); the error names the rank
//    that did not answer (dead or stuck), did not call the collective, or called another one, and
//    is sent to every peer as an ABORT notice;
//  - mismatched collectives (another operation, dtype, element count, reduce op or root on some
//    rank) never reach MPI: each collective starts with an all_gather of every rank's descriptor
//    of it (options::check_collectives, on by default: one 64-byte MPI_Iallgather per collective,
//    which also serves as the barrier), and when they differ every rank fails at once with the
//    same comm_error naming the rank at fault and what each rank called (nothing is in flight,
//    so MPI is finalised normally at exit);
//  - MPI errors (MPI_ERRORS_RETURN on dparallel's communicators, and on MPI_COMM_WORLD when
//    dparallel initialises MPI) fail the group the same way.
//  - a communicator whose last handle is gone sends CLOSED (how many collectives it issued) to
//    every peer: a peer waiting for a later collective fails at once with a comm_error naming it
//    ("rank k finished ... after issuing n collectives"), as on thread ranks and shared memory.
//    The MPI communicators are freed once every live peer's CLOSED has arrived, so that no message
//    is left behind for a context id that MPI may give to a later communicator.
// So a wait returns or throws at most timeout + options::probe_window after its collective
// started (collectives start one after the other, each when the previous one finished).
// A failed group stays failed. A process whose group failed with a collective still in flight
// (on any rank) cannot finalise MPI cleanly: at exit, dparallel exchanges an EXIT message with the
// peers of every failed group (waiting up to options::exit_grace, so that every rank can print its
// error first), prints the reason and ends the job with MPI_Abort (called by the lowest rank that
// said EXIT; the others give it 5 s before calling it too). When every rank of a failed
// group had nothing in flight (e.g. an abort between collectives), MPI is finalised normally.
// With Open MPI, a rank killed by a signal makes mpirun end the job at once ("mpirun noticed that
// process rank 1 ... exited on signal 9"); under launchers that keep the job running, the
// survivors' timeout names the dead rank.
//
// Shared memory. When every rank of the group shares one node (MPI_Comm_split_type with
// MPI_COMM_TYPE_SHARED), make_group and init_process_group return a group of the shared-memory
// engine (comm/shm.hpp) instead: MPI broadcasts the segment's name, and the data never goes
// through MPI. Same bits (rank order), no staging copies or all-to-alls; its failures are
// reported by that engine (comm/shm.hpp, "Failures never hang"). options::shared_memory = false,
// reduction::native or cuda_aware keep the MPI path described above.


#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/engine_base.hpp>
#include <dparallel/comm/mpi/detail/common.hpp>
#include <dparallel/comm/mpi/detail/engine.hpp>
#include <dparallel/comm/mpi/detail/shm_switch.hpp>
#include <dparallel/comm/mpi/detail/state.hpp>
#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace mpi {

/// One rank's endpoint of an MPI process group (a duplicate of `parent`). Satisfies
/// dparallel::communicator; share it through process_group (make_group, init_process_group).
/// Every rank of `parent` must construct it (it is a collective), in the same order.
class communicator : public dparallel::detail::engine_base<communicator> {
 public:
  /// Duplicates `parent` (collective over its ranks). `timeout` bounds setup and each collective
  /// (timeout_error when exceeded); `opts`: reduction order, message size and the like (mpi::options).
  explicit communicator(MPI_Comm parent = MPI_COMM_WORLD,
                        std::chrono::milliseconds timeout = std::chrono::seconds(300), options opts = {})
      : engine_(dparallel::detail::mpi_engine::instance()),
        state_(std::make_shared<dparallel::detail::mpi_comm_state>(opts, timeout)) {
    dparallel::detail::require(timeout.count() > 0, "mpi::communicator: expected a positive timeout, found " +
                                                        std::to_string(timeout.count()) + " ms");
    dparallel::detail::require(opts.max_message_elements > 0,
                               "mpi::communicator: expected options::max_message_elements > 0, found 0");
    std::string problem;
    auto const deadline = dparallel::detail::mpi_clock::now() + timeout;
    engine_->call([&] { problem = state_->setup(parent, deadline); });
    if (!problem.empty()) {
      if (state_->setup_orphaned()) engine_->must_abort("rank " + std::to_string(state_->rank()) + ": " + problem);
      throw timeout_error(state_->rank(), "dparallel: mpi::communicator on rank " + std::to_string(state_->rank()) +
                                              ": " + problem);
    }
    engine_->attach(state_);
  }
  communicator(communicator const&) = delete;
  communicator& operator=(communicator const&) = delete;

  /// Collectives still pending abort the group first (their peers would otherwise wait for this
  /// rank until the timeout); then waits for them to finish and releases the MPI communicators.
  ~communicator() {
    if (engine_->stopped()) return;
    if (std::size_t const pending = state_->pending(); pending != 0) {
      state_->request_abort("its communicator was destroyed with " + std::to_string(pending) + " collective" +
                            (pending == 1 ? "" : "s") + " pending");
      engine_->wake();
    }
    state_->drain();
    state_->retire();
    engine_->wake();
  }

  /// This rank's index in the group, 0 .. size() - 1.
  [[nodiscard]] int rank() const noexcept { return state_->rank(); }
  /// The number of ranks in the group.
  [[nodiscard]] int size() const noexcept { return state_->size(); }

  // all_reduce (in place, every rank receives the result), reduce (into rank `root`'s `t`),
  // broadcast, reduce_scatter, all_gather and barrier: engine_base.

  /// Fails every pending and future collective of every rank with a comm_error naming this rank
  /// and `why` (the peers learn it through the control channel). The first failure wins.
  void abort(std::string why) {
    state_->request_abort(std::move(why));
    engine_->wake();
  }

  /// The time limit of each collective issued from now on.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return state_->timeout(); }
  /// Applies to the collectives issued after the call.
  void set_timeout(std::chrono::milliseconds t) {
    dparallel::detail::require(t.count() > 0, "mpi::communicator::set_timeout: expected a positive timeout, found " +
                                                  std::to_string(t.count()) + " ms");
    state_->set_timeout(t);
  }
  /// Collectives this rank has finished, successfully or not (counted before the work completes).
  [[nodiscard]] std::uint64_t completed_ops() const noexcept { return state_->completed_ops(); }
  /// Blocks until every collective issued so far has finished (successfully or not).
  void drain() { state_->drain(); }

  /// The options this communicator was made with.
  [[nodiscard]] options const& opts() const noexcept { return state_->opts(); }

  /// This rank's subgroup of a split (see process_group::split): MPI_Comm_split of this group's
  /// communicator, then make_group on it with this group's timeout and options, so a subgroup
  /// whose ranks share a node moves its data through shared memory (options::shared_memory).
  /// Empty when the rank is in none. Every rank calls it, with the same plan.
  process_group subgroup(dparallel::detail::subgroup_plan const& plan);

 private:
  friend class dparallel::detail::engine_base<communicator>;
  static constexpr std::string_view error_prefix = "dparallel: mpi::communicator: ";

  work issue(dparallel::detail::comm_call const& c, tensor_ref a, tensor_ref b, std::span<tensor_ref const>) {
    work w = state_->issue(c, a, b);
    engine_->wake();
    return w;
  }

  [[nodiscard]] std::string device_problem(tensor_ref t, char const* name) const {
    if (opts().cuda_aware) return {};
    return host_memory_problem(t, name, "set mpi::options::cuda_aware if this MPI is CUDA-aware");
  }

  [[nodiscard]] static std::string dtype_problem(dparallel::detail::comm_call const& c, tensor_ref t) {
    bool const floating = dparallel::detail::host_reducible(c.type);
    bool const integer = c.type == dtype::i32 || c.type == dtype::i64 || c.type == dtype::u8;
    if (!floating && !integer) return unreducible("MPI", "F32, F64, F16, BF16, I32, I64 and U8", c.type);
    if (auto problem = avg_problem(c); !problem.empty()) return problem;
    if (t.device().kind == device_kind::host) return {};
    if (dparallel::detail::is_half(c.type))
      return std::string(name_of(c.type)) + " sums of device memory are not supported through MPI (MPI has no "
             "16-bit floating-point sum); reduce them in host memory (dparallel then sums in float, in rank "
             "order) or with NCCL";
    if (c.type == dtype::u8)
      return "U8 sums of device memory are not supported through MPI (Open MPI's MPI_SUM saturates U8); use I32";
    if (c.op == reduce_op::avg)
      return "avg of device memory is not supported through MPI (MPI has no average operation); use sum and "
             "scale the result";
    return {};
  }

  // The blocks of reduce_scatter / all_gather: on one device, engine_base's rule, and what device
  // memory cannot do through MPI.
  [[nodiscard]] std::string blocks_check(dparallel::detail::comm_call const& c, tensor_ref small, tensor_ref big,
                                         char const* small_name, char const* big_name) const {
    if (big.device() != small.device())
      return std::string("expected `") + big_name + "` and `" + small_name + "` on the same device, found " +
             to_string(big.device()) + " and " + to_string(small.device());
    auto problem = engine_base::blocks_check(c, small, big, small_name, big_name);
    if (!problem.empty() || small.size() == 0 || small.device().kind == device_kind::host) return problem;
    if (c.kind == dparallel::detail::comm_kind::reduce_scatter && !dparallel::detail::disjoint(small, big))
      return "an in-place reduce_scatter of device memory is not supported; pass disjoint buffers";
    if (small.size() > opts().max_message_elements)
      return "device buffers of all_gather / reduce_scatter are limited to options::max_message_elements = " +
             std::to_string(opts().max_message_elements) + " elements per rank, found " + std::to_string(small.size());
    return {};
  }

  std::shared_ptr<dparallel::detail::mpi_engine> engine_;
  std::shared_ptr<dparallel::detail::mpi_comm_state> state_;
};

static_assert(dparallel::communicator<communicator>);

/// This rank's process group over a duplicate of `parent` (every rank of `parent` must call it).
/// When all of parent's ranks share this node, a shared-memory group (options::shared_memory).
inline process_group make_group(MPI_Comm parent = MPI_COMM_WORLD,
                                std::chrono::milliseconds timeout = std::chrono::seconds(300), options opts = {}) {
  // The MPI communicator's set-up (bounded by the timeout) proves every rank is there before the
  // node split, which has no nonblocking form.
  auto comm = std::make_shared<communicator>(parent, timeout, opts);
  if (auto shm = dparallel::detail::mpi_shared_memory_group(parent, timeout, opts)) return std::move(*shm);
  return process_group(std::move(comm));
}

inline process_group communicator::subgroup(dparallel::detail::subgroup_plan const& plan) {
  MPI_Comm sub = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
  // Blocking, on the progress thread: the split's request exchange (an all_gather of this
  // group, waited for) proved that every rank is here and has nothing in flight before it.
  dparallel::detail::split_arguments const args = dparallel::detail::split_arguments_of(plan, MPI_UNDEFINED);
  engine_->call([&] { rc = MPI_Comm_split(state_->data_comm(), args.color, args.key, &sub); });
  if (rc != MPI_SUCCESS)
    throw comm_error(rank(), "dparallel: mpi: rank " + std::to_string(rank()) +
                                 ": MPI_Comm_split for a subgroup failed: " + dparallel::detail::mpi_error_text(rc));
  if (sub == MPI_COMM_NULL) return {};
  dparallel::detail::mpi_comm_owner const owner{engine_, sub};
  auto comm = std::make_shared<communicator>(sub, timeout(), opts());  // duplicates `sub`
  comm->state_->set_parent_ranks(plan.members());
  if (auto shm = dparallel::detail::mpi_shared_memory_group(sub, timeout(), opts(), plan.members())) return *shm;
  return process_group(std::move(comm));
}

/// The process group of an MPI job (MPI_COMM_WORLD), with the rank, world size, local rank and
/// local world size read as resolve_launch describes (explicit arguments, torchrun-style
/// variables, Open MPI's, Slurm's), checked against MPI's own rank and size. The local rank and
/// size default to the ranks that share this rank's processor name (MPI_Get_processor_name).
/// Initialises MPI when the program has not. Every rank must call it.
inline distributed_group init_process_group(init_options const& init = {}, options opts = {},
                                            environment const& env = process_environment()) {
  dparallel::detail::require(init.timeout.count() > 0, "mpi::init_process_group: expected a positive timeout, found " +
                                                           std::to_string(init.timeout.count()) + " ms");
  process_group group = make_group(MPI_COMM_WORLD, init.timeout, opts);
  int const rank = group.rank();
  // 1. Each rank checks its own launch before any collective, so that every misconfigured rank
  //    reports its own error (the others fail at once through the abort, naming it).
  try {
    (void)resolve_launch(init, env, launch_fallback{rank, group.size(), {}, {}, "MPI_COMM_WORLD", true});
  } catch (std::exception const& e) {
    group.abort("init_process_group failed on rank " + std::to_string(rank) + ": " + e.what());
    throw;
  }
  // 2. Node-local rank and size, unless the launcher gave them: the ranks with this processor name.
  auto engine = dparallel::detail::mpi_engine::instance();
  std::vector<std::uint8_t> name(MPI_MAX_PROCESSOR_NAME + 1, 0);
  engine->call([&] {
    int len = 0;
    MPI_Get_processor_name(reinterpret_cast<char*>(name.data()), &len);
  });
  auto const n = static_cast<std::size_t>(group.size());
  std::vector<std::uint8_t> names(name.size() * n);
  try {
    group.all_gather(view(names), view(name)).wait();
  } catch (...) {
    group.drain();
    throw;
  }
  int local_rank = 0, local_size = 0;
  for (std::size_t j = 0; j < n; ++j) {
    if (std::equal(name.begin(), name.end(), names.begin() + static_cast<std::ptrdiff_t>(j * name.size()))) {
      if (static_cast<int>(j) < rank) ++local_rank;
      ++local_size;
    }
  }
  launch_info info = resolve_launch(
      init, env, launch_fallback{rank, group.size(), local_rank, local_size, "MPI_COMM_WORLD", true});
  return dparallel::detail::finish_init(std::move(group), std::move(info), init, env);
}

/// Ends dparallel's use of MPI before the program's own MPI_Finalize (or early): waits for the
/// running collectives, does the exit handshake of failed groups (MPI_Abort when one had a
/// collective in flight), stops the progress thread, and finalises MPI if dparallel initialised
/// it. Later MPI calls through dparallel fail. Called automatically at exit.
inline void finalize() { dparallel::detail::mpi_engine::finalize_process(); }

}  // namespace mpi
DPARALLEL_NAMESPACE_END

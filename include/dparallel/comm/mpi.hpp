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
// MPI 4.1's MPI_SUM saturates U8 instead of wrapping (measured). F16/BF16 are moved (broadcast,
// all_gather) but not reduced.
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
//  - MPI errors (MPI_ERRORS_RETURN on dparallel's communicators) fail the group the same way.
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

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the C API only: no deprecated C++ bindings
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/host_group.hpp>
#include <dparallel/comm/detail/call_checks.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace mpi {

/// How F32/F64 reductions are computed (see the top of this file).
enum class reduction : std::uint8_t {
  rank_order,  ///< each element summed in rank order 0..n-1: bitwise the host communicator's result
  native,      ///< MPI's own reduction (MPI_SUM): MPI's order, within rounding of rank_order
};

/// Options of an MPI communicator; the timeout is separate (constructor argument, set_timeout).
struct options {
  /// How F32/F64 sums are computed: rank_order (default) or MPI's own.
  reduction reduce = reduction::rank_order;
  /// Accept device (CUDA) memory and hand it to MPI as is: only with a CUDA-aware MPI. Device
  /// buffers take MPI's own reductions (sum only: avg needs a kernel dparallel does not run here).
  bool cuda_aware = false;
  /// Longest message of one MPI call, in elements; longer collectives are split (MPI counts are int).
  std::size_t max_message_elements = std::size_t{1} << 28;
  /// After a timeout, how long a rank waits for its peers to answer its status query.
  std::chrono::milliseconds probe_window = std::chrono::seconds(2);
  /// At exit, how long a rank whose group failed waits for its peers' EXIT messages before
  /// ending the job with MPI_Abort.
  std::chrono::milliseconds exit_grace = std::chrono::seconds(10);
};

}  // namespace mpi

namespace detail {

using mpi_clock = std::chrono::steady_clock;

inline std::string mpi_error_text(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(buf, static_cast<std::size_t>(len));
}

/// The MPI datatype of one element of `t` (F16/BF16 as 16-bit words: moved, never reduced).
inline MPI_Datatype mpi_type_of(dtype t) {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::f16:
    case dtype::bf16: return MPI_UINT16_T;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

/// Sums `count` integers of dtype `t` over `srcs` in rank order, wrapping (two's complement).
inline void reduce_integers(dtype t, std::span<void const* const> srcs, void* dst, std::size_t count) {
  auto const run = [&](auto zero) {
    using T = decltype(zero);
    using U = std::make_unsigned_t<T>;
    for (std::size_t i = 0; i < count; ++i) {
      U acc = 0;
      for (void const* s : srcs) acc = static_cast<U>(acc + static_cast<U>(static_cast<T const*>(s)[i]));
      static_cast<T*>(dst)[i] = static_cast<T>(acc);
    }
  };
  switch (t) {
    case dtype::i32: return run(std::int32_t{});
    case dtype::i64: return run(std::int64_t{});
    case dtype::u8: return run(std::uint8_t{});
    default: throw invalid_argument("dparallel: mpi: no integer reduction for " + std::string(name_of(t)));
  }
}

/// One rank's slice of a rank-order reduction: F32/F64 with the host communicator's kernel
/// (op applied), integers by wrapping sums.
inline void reduce_in_rank_order(dtype t, std::span<void const* const> srcs, void* dst, std::size_t count,
                                 reduce_op op, int n) {
  if (host_reducible(t)) reduce_bytes(t, srcs, std::span<void* const>(&dst, 1), count, op, n);
  else reduce_integers(t, srcs, dst, count);
}

inline std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "level " + std::to_string(level);
  }
}

// --- control messages -----------------------------------------------------------------------

inline constexpr int mpi_control_tag = 0x4450;
enum class mpi_msg : std::uint8_t { abort = 1, query = 2, status = 3, exit = 4 };

struct mpi_msg_writer {
  std::vector<std::byte> b;
  explicit mpi_msg_writer(mpi_msg type) { b.push_back(static_cast<std::byte>(type)); }
  mpi_msg_writer& u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
    return *this;
  }
  mpi_msg_writer& str(std::string const& s) {
    u64(s.size());
    for (char c : s) b.push_back(static_cast<std::byte>(c));
    return *this;
  }
};

struct mpi_msg_reader {
  std::vector<std::byte> const& b;
  std::size_t pos = 1;
  bool ok = true;
  std::uint64_t u64() {
    if (pos + 8 > b.size()) {
      ok = false;
      return 0;
    }
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(b[pos + static_cast<std::size_t>(i)]) << (8 * i);
    pos += 8;
    return v;
  }
  std::string str() {
    std::uint64_t const n = u64();
    if (!ok || n > b.size() - pos) {
      ok = false;
      return {};
    }
    std::string s(n, '\0');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(b[pos + i]);
    pos += n;
    return s;
  }
};

// --- one collective ---------------------------------------------------------------------------

struct mpi_task {
  std::uint64_t seq = 0;
  comm_call call;
  tensor_ref a;
  tensor_ref b;
  std::chrono::milliseconds timeout{};
  work_promise done;
};

/// A collective being executed: MPI requests started one after the other. On failure the whole
/// object (its request and staging memory) is kept as an orphan until MPI completes the request.
struct mpi_running {
  struct step {
    std::function<int(mpi_running&, MPI_Request*)> start;
    std::function<void(mpi_running&)> finish;
  };
  mpi_task task;
  std::vector<step> steps;
  std::size_t next = 0;
  MPI_Request req = MPI_REQUEST_NULL;
  bool in_flight = false;
  mpi_clock::time_point started;
  mpi_clock::time_point deadline;
  std::unique_ptr<std::byte[]> staging;
  std::size_t staging_bytes = 0;
  std::vector<int> c1, d1, c2, d2;  // counts and displacements of the step in flight
};

struct mpi_failure {
  int rank = 0;
  bool timeout = false;
  std::string reason;
};

class mpi_engine;

/// The state of one MPI communicator, shared by its handle (the user's threads) and the
/// progress thread. Members marked (P) are touched by the progress thread only.
class mpi_comm_state {
 public:
  struct tick {
    bool progressed = false;
    bool active = false;
  };

  mpi_comm_state(mpi::options opts, std::chrono::milliseconds timeout)
      : opts_(opts), timeout_ms_(timeout.count()) {}
  mpi_comm_state(mpi_comm_state const&) = delete;
  mpi_comm_state& operator=(mpi_comm_state const&) = delete;

  // --- set-up (progress thread, through mpi_engine::call) ---

  /// Duplicates `parent` twice (collectives, control messages) with MPI_Comm_idup, bounded by
  /// `deadline`. Returns an error message, empty on success.
  std::string setup(MPI_Comm parent, mpi_clock::time_point deadline) {
    int rc = MPI_Comm_rank(parent, &rank_);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(parent, &size_);
    if (rc != MPI_SUCCESS) return "MPI_Comm_rank/MPI_Comm_size of the parent communicator failed: " + mpi_error_text(rc);
    MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    rc = MPI_Comm_idup(parent, &data_, &reqs[0]);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_idup(parent, &control_, &reqs[1]);
    if (rc != MPI_SUCCESS) return "MPI_Comm_idup failed: " + mpi_error_text(rc);
    for (int spins = 0;; ++spins) {
      int flag = 0;
      rc = MPI_Testall(2, reqs, &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return "MPI_Comm_idup failed: " + mpi_error_text(rc);
      if (flag != 0) break;
      if (mpi_clock::now() >= deadline) {
        setup_orphaned_ = true;
        return "duplicating the parent communicator (a collective) did not complete within the timeout: not every "
               "rank created its communicator (every rank must call init_process_group / construct an "
               "mpi::communicator over the same parent, in the same order)";
      }
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 10 : 200));
    }
    MPI_Comm_set_errhandler(data_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN);
    dead_.assign(static_cast<std::size_t>(size_), 0);
    exit_from_.assign(static_cast<std::size_t>(size_), 0);
    ready_ = true;
    return {};
  }
  [[nodiscard]] bool setup_orphaned() const noexcept { return setup_orphaned_; }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] mpi::options const& opts() const noexcept { return opts_; }

  // --- the user's side ---

  work issue(comm_call const& c, tensor_ref a, tensor_ref b) {
    work_promise p;
    work w = p.get_work();
    std::unique_lock lock(m_);
    std::uint64_t const seq = next_seq_++;
    history_.emplace_back(seq, c);
    if (history_.size() > 1024) history_.pop_front();
    if (failure_ || stopped_) {
      mpi_task const t{seq, c, a, b, timeout(), {}};
      std::exception_ptr const e = stopped_error(t);
      lock.unlock();
      completed_.fetch_add(1, std::memory_order_release);
      p.complete(e);
      return w;
    }
    queue_.push_back(mpi_task{seq, c, a, b, timeout(), std::move(p)});
    ++pending_;
    return w;
  }

  void request_abort(std::string why) {
    std::lock_guard lock(m_);
    if (!failure_ && !abort_request_) abort_request_ = std::move(why);
  }

  [[nodiscard]] std::size_t pending() {
    std::lock_guard lock(m_);
    return pending_;
  }
  void drain() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return pending_ == 0; });
  }
  /// The handle is gone: free the communicators when idle (or keep them for the exit handshake).
  void retire() {
    std::lock_guard lock(m_);
    retired_ = true;
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  void set_timeout(std::chrono::milliseconds t) noexcept { timeout_ms_.store(t.count(), std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t completed_ops() const noexcept { return completed_.load(std::memory_order_acquire); }

  [[nodiscard]] bool failed() {
    std::lock_guard lock(m_);
    return failure_.has_value();
  }

  // --- the progress thread's side ---

  tick progress(mpi_clock::time_point now) {
    tick t;
    if (!ready_ || freed_) return t;
    std::optional<std::string> abort_why;
    {
      std::lock_guard lock(m_);
      abort_why = std::exchange(abort_request_, std::nullopt);
    }
    if (abort_why) {
      fail({rank_, false, "rank " + std::to_string(rank_) + " aborted the process group: " + *abort_why}, true);
      t.progressed = true;
    }
    t.progressed |= poll_control(now);
    test_sends();
    if (now >= next_orphan_test_) {
      test_orphans();
      next_orphan_test_ = now + std::chrono::milliseconds(10);
    }
    if (current_) t.progressed |= advance(now);
    if (!current_) t.progressed |= start_next(now);
    if (probe_.active && (probe_.replies.size() + 1 >= static_cast<std::size_t>(size_) || now >= probe_.deadline)) {
      conclude_probe();
      t.progressed = true;
    }
    t.active = static_cast<bool>(current_) || probe_.active || (exiting_ && !exit_done(now));
    return t;
  }

  /// (P) Whether the engine may forget this state: its handle is gone and its communicators freed.
  [[nodiscard]] bool finished() {
    if (freed_) return true;
    bool retire_now = false;
    {
      std::lock_guard lock(m_);
      retire_now = retired_ && !failure_ && !abort_request_ && queue_.empty() && !current_;
    }
    if (retire_now && ready_) {
      free_comms();
      return true;
    }
    return false;
  }

  /// (P) Whether a collective is running or queued, or a status query is open.
  [[nodiscard]] bool busy() {
    std::lock_guard lock(m_);
    return static_cast<bool>(current_) || !queue_.empty() || probe_.active;
  }

  /// (P) Starts the exit handshake of a failed group: EXIT to every peer not known dead.
  void start_exit(mpi_clock::time_point deadline) {
    if (!ready_ || freed_ || exiting_) return;
    exiting_ = true;
    exit_deadline_ = deadline;
    std::uint64_t const orphans = orphans_.empty() ? 0 : 1;
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && dead_[static_cast<std::size_t>(j)] == 0) send_to(j, mpi_msg_writer(mpi_msg::exit).u64(orphans).b);
  }
  [[nodiscard]] bool exit_done(mpi_clock::time_point now) const {
    if (!exiting_) return true;
    if (now >= exit_deadline_) return true;
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && dead_[static_cast<std::size_t>(j)] == 0 && exit_from_[static_cast<std::size_t>(j)] == 0)
        return false;
    return true;
  }
  /// After the handshake: why the job must end with MPI_Abort (empty: MPI can be finalised).
  [[nodiscard]] std::string exit_problem() {
    std::string why;
    {
      std::lock_guard lock(m_);
      if (!failure_) return {};
      why = failure_->reason;
    }
    if (setup_orphaned_) return "setting up a communicator timed out: " + why;
    if (!orphans_.empty() || current_)
      return "rank " + std::to_string(rank_) + " still had a collective in flight when its process group failed: " + why;
    std::vector<int> silent;
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && exit_from_[static_cast<std::size_t>(j)] == 0) silent.push_back(j);
    if (!silent.empty())
      return describe_ranks(silent) + (silent.size() == 1 ? " was" : " were") +
             " not seen to exit after the process group failed (dead, or still running): " + why;
    if (peer_orphans_)
      return "a peer still had a collective in flight when the process group failed: " + why;
    return {};
  }

  /// After the handshake: whether this rank should call MPI_Abort itself, being the lowest rank
  /// among itself and the peers that said EXIT (the others wait to be ended by it, so that one
  /// rank, not all, reports the abort).
  [[nodiscard]] bool abort_leader() const {
    for (int j = 0; j < rank_; ++j)
      if (exit_from_[static_cast<std::size_t>(j)] != 0) return false;
    return true;
  }

  /// (P or after the thread stopped) Fails everything, e.g. when MPI is being finalised.
  void fail_now(std::string const& reason) { fail({rank_, false, reason}, false); }

  /// Frees the MPI communicators (healthy groups, or failed ones that ended cleanly).
  void free_comms() {
    if (freed_ || !ready_) return;
    freed_ = true;
    MPI_Comm_free(&data_);
    MPI_Comm_free(&control_);
  }

 private:
  [[nodiscard]] std::exception_ptr error_for(mpi_task const& t) const {  // lock held or (P)
    std::string const msg = "dparallel: rank " + std::to_string(rank_) + ": " + describe(t.call) + " (collective #" +
                            std::to_string(t.seq) + ") failed: " + failure_->reason;
    if (failure_->timeout) return std::make_exception_ptr(timeout_error(failure_->rank, msg));
    return std::make_exception_ptr(comm_error(failure_->rank, msg));
  }
  [[nodiscard]] std::exception_ptr stopped_error(mpi_task const& t) const {  // lock held
    if (failure_) return error_for(t);
    return std::make_exception_ptr(comm_error(
        rank_, "dparallel: rank " + std::to_string(rank_) + ": " + describe(t.call) + " (collective #" +
                   std::to_string(t.seq) + ") failed: MPI is being finalised (dparallel::mpi::finalize, MPI_Finalize "
                   "or the end of the program)"));
  }

  // Not pending any more before the work completes: a caller whose wait() returned may destroy
  // the communicator at once, and must not find the collective still counted as pending.
  void finish_task(mpi_task& t, std::exception_ptr e) {
    {
      std::lock_guard lock(m_);
      if (--pending_ == 0) idle_.notify_all();
    }
    completed_.fetch_add(1, std::memory_order_release);
    t.done.complete(std::move(e));
  }

  // (P) Sets the failure (first one wins), fails the running and queued collectives, and tells the peers.
  void fail(mpi_failure f, bool notify) {
    std::deque<mpi_task> queued;
    {
      std::lock_guard lock(m_);
      if (failure_) return;
      failure_ = f;
      queued.swap(queue_);
    }
    probe_.active = false;
    if (current_) {
      std::unique_ptr<mpi_running> r = std::move(current_);
      std::exception_ptr const e = error_for(r->task);
      finish_task(r->task, e);
      if (r->in_flight) orphans_.push_back(std::move(r));
    }
    for (auto& t : queued) finish_task(t, error_for(t));
    if (notify) {
      auto const msg = mpi_msg_writer(mpi_msg::abort)
                           .u64(static_cast<std::uint64_t>(f.rank))
                           .u64(f.timeout ? 1 : 0)
                           .str(f.reason)
                           .b;
      for (int j = 0; j < size_; ++j)
        if (j != rank_ && dead_[static_cast<std::size_t>(j)] == 0) send_to(j, msg);
    }
  }

  void fail_mpi(int rc, std::string const& what) {
    std::string const call = current_ ? describe(current_->task.call) + " (collective #" +
                                            std::to_string(current_->task.seq) + ")"
                                      : std::string("a collective");
    fail({rank_, false, "MPI reported an error on rank " + std::to_string(rank_) + " in " + what + " for " + call +
                            ": " + mpi_error_text(rc)},
         true);
  }

  // (P) Drives the running collective; completes it when its last step finished.
  bool advance(mpi_clock::time_point now) {
    bool progressed = false;
    mpi_running& r = *current_;
    for (;;) {
      if (!r.in_flight) {
        if (r.next == r.steps.size()) {
          probe_.active = false;
          std::unique_ptr<mpi_running> done = std::move(current_);
          finish_task(done->task, nullptr);
          recycle(*done);
          return true;
        }
        int const rc = r.steps[r.next].start(r, &r.req);
        if (rc != MPI_SUCCESS) {
          fail_mpi(rc, "starting a step");
          return true;
        }
        r.in_flight = true;
        progressed = true;
      }
      int flag = 0;
      int const rc = MPI_Test(&r.req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        fail_mpi(rc, "MPI_Test");
        return true;
      }
      if (flag == 0) break;
      r.in_flight = false;
      if (r.steps[r.next].finish) r.steps[r.next].finish(r);
      ++r.next;
      progressed = true;
    }
    if (!probe_.active && now >= r.deadline) start_probe(now);
    return progressed;
  }

  bool start_next(mpi_clock::time_point now) {
    mpi_task t;
    {
      std::lock_guard lock(m_);
      // An abort requested since this tick began applies first: a collective issued after it
      // must never reach MPI (it would be left in flight).
      if (queue_.empty() || abort_request_) return false;
      t = std::move(queue_.front());
      queue_.pop_front();
    }
    auto r = std::make_unique<mpi_running>();
    r->task = std::move(t);
    r->started = now;
    r->deadline = now + r->task.timeout;
    try {
      build(*r);
    } catch (std::exception const& e) {  // staging memory could not be allocated
      std::string const what = describe(r->task.call) + " (collective #" + std::to_string(r->task.seq) + ")";
      current_ = std::move(r);
      fail({rank_, false, "rank " + std::to_string(rank_) + " could not start " + what + ": " + e.what()}, true);
      return true;
    }
    current_ = std::move(r);
    advance(now);
    return true;
  }

  // Staging memory is reused from one collective to the next (no allocation per bucket).
  std::byte* take_staging(mpi_running& r, std::size_t bytes) {
    if (bytes == 0) return nullptr;
    if (cache_bytes_ >= bytes) {
      r.staging = std::move(cache_);
      r.staging_bytes = cache_bytes_;
      cache_bytes_ = 0;
    } else {
      cache_.reset();
      cache_bytes_ = 0;
      r.staging = std::make_unique_for_overwrite<std::byte[]>(bytes);
      r.staging_bytes = bytes;
    }
    return r.staging.get();
  }
  void recycle(mpi_running& r) {
    if (r.staging && r.staging_bytes >= cache_bytes_) {
      cache_ = std::move(r.staging);
      cache_bytes_ = r.staging_bytes;
    }
  }

  // (P) Plans the MPI steps of a collective (see the top of the file for the algorithms).
  void build(mpi_running& r) {
    comm_call const& c = r.task.call;
    int const n = size_;
    int const me = rank_;
    auto const un = static_cast<std::size_t>(n);
    MPI_Comm const comm = data_;
    std::size_t const esz = size_of(c.type);
    MPI_Datatype const type = mpi_type_of(c.type);
    bool const direct = r.task.a.device().kind != device_kind::host;
    bool const integer = c.type == dtype::i32 || c.type == dtype::i64 || c.type == dtype::u8;
    bool const rank_order = !direct && (integer || (opts_.reduce == mpi::reduction::rank_order && host_reducible(c.type)));
    bool const scale = c.op == reduce_op::avg;
    std::size_t const limit = std::clamp<std::size_t>(opts_.max_message_elements, 1,
                                                       static_cast<std::size_t>(INT_MAX) - un - 1);
    auto* const A = static_cast<std::byte*>(r.task.a.data());
    auto* const B = static_cast<std::byte*>(r.task.b.data());
    auto const ci = [](std::size_t v) { return static_cast<int>(v); };
    dtype const ty = c.type;
    auto const scale_avg = [ty, n](std::byte* p, std::size_t count) {
      dispatch_reducible(ty, [&](auto zero) {
        using T = decltype(zero);
        T* v = reinterpret_cast<T*>(p);
        T const s = avg_scale<T>(n);
        for (std::size_t i = 0; i < count; ++i) v[i] *= s;
      });
    };
    auto const count = c.count;
    std::size_t const cl_max = std::min(limit, count);
    r.c1.assign(un, 0);
    r.d1.assign(un, 0);
    r.c2.assign(un, 0);
    r.d2.assign(un, 0);
    auto const slice = [un](std::size_t len, std::size_t j) { return len * j / un; };

    switch (c.kind) {
      case comm_kind::barrier:
        r.steps.push_back({[comm](mpi_running&, MPI_Request* q) { return MPI_Ibarrier(comm, q); }, {}});
        return;

      case comm_kind::broadcast: {
        std::byte* const S = direct ? nullptr : take_staging(r, cl_max * esz);
        int const root = c.root;
        for (std::size_t c0 = 0; c0 < count; c0 += limit) {
          std::size_t const cl = std::min(limit, count - c0);
          std::byte* const user = A + c0 * esz;
          std::byte* const buf = direct ? user : S;
          r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                               if (!direct && me == root) std::memcpy(buf, user, cl * esz);
                               return MPI_Ibcast(buf, ci(cl), type, root, comm, q);
                             },
                             [=](mpi_running&) {
                               if (!direct && me != root) std::memcpy(user, buf, cl * esz);
                             }});
        }
        return;
      }

      case comm_kind::all_gather: {  // a = out (n*m), b = in (m)
        std::size_t const m = count;
        if (direct) {
          bool const in_place = B == A + static_cast<std::size_t>(me) * m * esz;
          r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                               return MPI_Iallgather(in_place ? MPI_IN_PLACE : B, ci(m), type, A, ci(m), type, comm, q);
                             },
                             {}});
          return;
        }
        std::byte* const S = take_staging(r, (un + 1) * cl_max * esz);
        std::byte* const R = S + cl_max * esz;
        for (std::size_t c0 = 0; c0 < m; c0 += limit) {
          std::size_t const cl = std::min(limit, m - c0);
          r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                               std::memcpy(S, B + c0 * esz, cl * esz);
                               return MPI_Iallgather(S, ci(cl), type, R, ci(cl), type, comm, q);
                             },
                             [=](mpi_running&) {
                               for (std::size_t j = 0; j < un; ++j)
                                 std::memcpy(A + (j * m + c0) * esz, R + j * cl * esz, cl * esz);
                             }});
        }
        return;
      }

      case comm_kind::all_reduce:
      case comm_kind::reduce: {
        bool const to_root = c.kind == comm_kind::reduce;
        int const root = c.root;
        if (direct) {
          for (std::size_t c0 = 0; c0 < count; c0 += limit) {
            std::size_t const cl = std::min(limit, count - c0);
            std::byte* const user = A + c0 * esz;
            r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                                 if (!to_root) return MPI_Iallreduce(MPI_IN_PLACE, user, ci(cl), type, MPI_SUM, comm, q);
                                 if (me == root) return MPI_Ireduce(MPI_IN_PLACE, user, ci(cl), type, MPI_SUM, root, comm, q);
                                 return MPI_Ireduce(user, nullptr, ci(cl), type, MPI_SUM, root, comm, q);
                               },
                               {}});
          }
          return;
        }
        if (!rank_order) {
          std::byte* const S = take_staging(r, cl_max * esz);
          for (std::size_t c0 = 0; c0 < count; c0 += limit) {
            std::size_t const cl = std::min(limit, count - c0);
            std::byte* const user = A + c0 * esz;
            r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                                 std::memcpy(S, user, cl * esz);
                                 if (!to_root) return MPI_Iallreduce(MPI_IN_PLACE, S, ci(cl), type, MPI_SUM, comm, q);
                                 if (me == root) return MPI_Ireduce(MPI_IN_PLACE, S, ci(cl), type, MPI_SUM, root, comm, q);
                                 return MPI_Ireduce(S, nullptr, ci(cl), type, MPI_SUM, root, comm, q);
                               },
                               [=](mpi_running&) {
                                 if (to_root && me != root) return;
                                 if (scale) scale_avg(S, cl);
                                 std::memcpy(user, S, cl * esz);
                               }});
          }
          return;
        }
        // Rank order: S holds the chunk (then the reduced slices), R every rank's copy of my slice.
        std::size_t const recv_max = un * (cl_max / un + 1);
        std::byte* const S = take_staging(r, (cl_max + recv_max) * esz);
        std::byte* const R = S + cl_max * esz;
        reduce_op const op = c.op;
        for (std::size_t c0 = 0; c0 < count; c0 += limit) {
          std::size_t const cl = std::min(limit, count - c0);
          std::byte* const user = A + c0 * esz;
          auto const um = static_cast<std::size_t>(me);
          std::size_t const lo_me = slice(cl, um);
          std::size_t const len_me = slice(cl, um + 1) - lo_me;
          r.steps.push_back({[=](mpi_running& x, MPI_Request* q) {
                               std::memcpy(S, user, cl * esz);
                               for (std::size_t j = 0; j < un; ++j) {
                                 x.c1[j] = ci(slice(cl, j + 1) - slice(cl, j));
                                 x.d1[j] = ci(slice(cl, j));
                                 x.c2[j] = ci(len_me);
                                 x.d2[j] = ci(j * len_me);
                               }
                               return MPI_Ialltoallv(S, x.c1.data(), x.d1.data(), type, R, x.c2.data(), x.d2.data(),
                                                     type, comm, q);
                             },
                             [=](mpi_running&) {
                               std::vector<void const*> srcs(un);
                               for (std::size_t j = 0; j < un; ++j) srcs[j] = R + j * len_me * esz;
                               reduce_in_rank_order(ty, srcs, S + lo_me * esz, len_me, op, n);
                             }});
          r.steps.push_back({[=](mpi_running& x, MPI_Request* q) {
                               for (std::size_t j = 0; j < un; ++j) {
                                 x.c1[j] = ci(slice(cl, j + 1) - slice(cl, j));
                                 x.d1[j] = ci(slice(cl, j));
                               }
                               if (!to_root)
                                 return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, S, x.c1.data(), x.d1.data(),
                                                        type, comm, q);
                               if (me == root)
                                 return MPI_Igatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, S, x.c1.data(), x.d1.data(),
                                                     type, root, comm, q);
                               return MPI_Igatherv(S + lo_me * esz, ci(len_me), type, nullptr, nullptr, nullptr, type,
                                                   root, comm, q);
                             },
                             [=](mpi_running&) {
                               if (!to_root || me == root) std::memcpy(user, S, cl * esz);
                             }});
        }
        return;
      }

      case comm_kind::reduce_scatter: {  // a = out (m), b = in (n*m)
        std::size_t const m = count;
        if (direct) {
          r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                               return MPI_Ireduce_scatter_block(B, A, ci(m), type, MPI_SUM, comm, q);
                             },
                             {}});
          return;
        }
        reduce_op const op = c.op;
        std::byte* const S = take_staging(r, (rank_order ? 2 * un : un + 1) * cl_max * esz);
        std::byte* const R = S + un * cl_max * esz;
        for (std::size_t c0 = 0; c0 < m; c0 += limit) {
          std::size_t const cl = std::min(limit, m - c0);
          auto const pack = [=] {
            for (std::size_t j = 0; j < un; ++j) std::memcpy(S + j * cl * esz, B + (j * m + c0) * esz, cl * esz);
          };
          if (rank_order) {
            r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                                 pack();
                                 return MPI_Ialltoall(S, ci(cl), type, R, ci(cl), type, comm, q);
                               },
                               [=](mpi_running&) {
                                 std::vector<void const*> srcs(un);
                                 for (std::size_t j = 0; j < un; ++j) srcs[j] = R + j * cl * esz;
                                 reduce_in_rank_order(ty, srcs, A + c0 * esz, cl, op, n);
                               }});
          } else {
            r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                                 pack();
                                 return MPI_Ireduce_scatter_block(S, R, ci(cl), type, MPI_SUM, comm, q);
                               },
                               [=](mpi_running&) {
                                 if (scale) scale_avg(R, cl);
                                 std::memcpy(A + c0 * esz, R, cl * esz);
                               }});
          }
        }
        return;
      }
    }
  }

  void send_to(int dst, std::vector<std::byte> bytes) {
    sends_.push_back({std::move(bytes), MPI_REQUEST_NULL});
    auto& s = sends_.back();
    if (MPI_Isend(s.bytes.data(), static_cast<int>(s.bytes.size()), MPI_BYTE, dst, mpi_control_tag, control_,
                  &s.req) != MPI_SUCCESS)
      sends_.pop_back();  // the peer is unreachable: nothing more to do
  }
  void test_sends() {
    for (auto it = sends_.begin(); it != sends_.end();) {
      int flag = 0;
      if (MPI_Test(&it->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag != 0) it = sends_.erase(it);
      else ++it;
    }
  }
  void test_orphans() {
    for (auto it = orphans_.begin(); it != orphans_.end();) {
      int flag = 0;
      if (MPI_Test(&(*it)->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag != 0) it = orphans_.erase(it);
      else ++it;
    }
  }

  // (P) Receives and handles every control message waiting.
  bool poll_control(mpi_clock::time_point now) {
    bool any = false;
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, mpi_control_tag, control_, &flag, &st) != MPI_SUCCESS || flag == 0) break;
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      std::vector<std::byte> buf(static_cast<std::size_t>(std::max(bytes, 0)));
      if (MPI_Recv(buf.data(), bytes, MPI_BYTE, st.MPI_SOURCE, mpi_control_tag, control_, MPI_STATUS_IGNORE) !=
          MPI_SUCCESS)
        break;
      any = true;
      if (!buf.empty()) handle(st.MPI_SOURCE, buf, now);
    }
    return any;
  }

  void handle(int from, std::vector<std::byte> const& buf, mpi_clock::time_point) {
    mpi_msg_reader in{buf};
    switch (static_cast<mpi_msg>(buf[0])) {
      case mpi_msg::abort: {
        auto const rank = static_cast<int>(in.u64());
        bool const timed_out = in.u64() != 0;
        std::string reason = in.str();
        if (in.ok) fail({rank, timed_out, std::move(reason)}, false);
        return;
      }
      case mpi_msg::query: {
        std::uint64_t const seq = in.u64();
        if (!in.ok) return;
        std::uint64_t issued = 0;
        std::string at_seq, last, failure;
        {
          std::lock_guard lock(m_);
          issued = next_seq_ - 1;
          for (auto const& [s, c] : history_)
            if (s == seq) at_seq = describe(c);
          if (!history_.empty()) last = describe(history_.back().second);
          if (failure_) failure = failure_->reason;
        }
        send_to(from, mpi_msg_writer(mpi_msg::status)
                          .u64(seq)
                          .u64(issued)
                          .u64(completed_ops())
                          .str(at_seq)
                          .str(last)
                          .str(failure)
                          .b);
        return;
      }
      case mpi_msg::status: {
        peer_status s;
        s.seq = in.u64();
        s.issued = in.u64();
        s.completed = in.u64();
        s.at_seq = in.str();
        s.last = in.str();
        s.failure = in.str();
        if (in.ok && probe_.active && s.seq == probe_.seq) probe_.replies[from] = std::move(s);
        return;
      }
      case mpi_msg::exit: {
        bool const orphans = in.u64() != 0;
        if (in.ok && from >= 0 && from < size_) {
          exit_from_[static_cast<std::size_t>(from)] = 1;
          peer_orphans_ = peer_orphans_ || orphans;
        }
        return;
      }
    }
  }

  // (P) The running collective timed out: ask every peer where it is.
  void start_probe(mpi_clock::time_point now) {
    probe_.active = true;
    probe_.seq = current_->task.seq;
    probe_.call = current_->task.call;
    probe_.waited = current_->task.timeout;
    probe_.deadline = now + opts_.probe_window;
    probe_.replies.clear();
    for (int j = 0; j < size_; ++j)
      if (j != rank_) send_to(j, mpi_msg_writer(mpi_msg::query).u64(probe_.seq).b);
  }

  // (P) Names the rank(s) at fault from the answers, fails the group and tells the peers.
  void conclude_probe() {
    std::vector<int> silent, behind, other_call, failed_peers, inside;
    std::vector<std::string> notes;
    std::string const mine = describe(probe_.call);
    std::string const seq = std::to_string(probe_.seq);
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      auto const it = probe_.replies.find(j);
      if (it == probe_.replies.end()) {
        silent.push_back(j);
        dead_[static_cast<std::size_t>(j)] = 1;
        continue;
      }
      peer_status const& s = it->second;
      std::string const rj = "rank " + std::to_string(j);
      if (!s.failure.empty()) {
        failed_peers.push_back(j);
        notes.push_back(rj + " had already failed: " + s.failure);
      } else if (s.issued < probe_.seq) {
        behind.push_back(j);
        notes.push_back(rj + " has issued only " + std::to_string(s.issued) + " collective" +
                        (s.issued == 1 ? "" : "s") + (s.last.empty() ? "" : " (the last: " + s.last + ")") +
                        ", so it never called #" + seq);
      } else if (!s.at_seq.empty() && s.at_seq != mine) {
        other_call.push_back(j);
        notes.push_back(rj + " called " + s.at_seq + " as #" + seq);
      } else {
        inside.push_back(j);
      }
    }
    if (!silent.empty())
      notes.insert(notes.begin(), describe_ranks(silent) + " did not answer a status query within " +
                                      std::to_string(opts_.probe_window.count()) +
                                      " ms: its process died or hangs outside dparallel");
    if (!inside.empty()) notes.push_back(describe_ranks(inside) + " called it too");
    int const culprit = !silent.empty()         ? silent[0]
                        : !behind.empty()       ? behind[0]
                        : !other_call.empty()   ? other_call[0]
                        : !failed_peers.empty() ? failed_peers[0]
                                                : rank_;
    std::string msg = "collective #" + seq + " (" + mine + ") did not complete within " +
                      std::to_string(probe_.waited.count()) + " ms on rank " + std::to_string(rank_);
    for (std::size_t k = 0; k < notes.size(); ++k) msg += (k == 0 ? ": " : "; ") + notes[k];
    if (notes.empty()) msg += " (no other rank)";
    msg += ". Every rank must issue the same collectives in the same order; if rank " + std::to_string(culprit) +
           " is only slow, raise the timeout (init_options::timeout, process_group::set_timeout)";
    probe_.active = false;
    fail({culprit, true, std::move(msg)}, true);
  }

  struct peer_status {
    std::uint64_t seq = 0, issued = 0, completed = 0;
    std::string at_seq, last, failure;
  };
  struct probe_state {
    bool active = false;
    std::uint64_t seq = 0;
    comm_call call;
    std::chrono::milliseconds waited{};
    mpi_clock::time_point deadline;
    std::map<int, peer_status> replies;
  };
  struct pending_send {
    std::vector<std::byte> bytes;
    MPI_Request req;
  };

  mpi::options opts_;
  int rank_ = 0;
  int size_ = 1;
  MPI_Comm data_ = MPI_COMM_NULL;
  MPI_Comm control_ = MPI_COMM_NULL;
  bool ready_ = false;           // set-up done
  bool freed_ = false;           // (P) communicators freed
  bool setup_orphaned_ = false;  // (P) a set-up timed out with requests in flight
  std::atomic<std::int64_t> timeout_ms_;
  std::atomic<std::uint64_t> completed_{0};

  std::mutex m_;  // guards the members down to stopped_
  std::condition_variable idle_;
  std::deque<mpi_task> queue_;
  std::size_t pending_ = 0;  // queued or running
  std::uint64_t next_seq_ = 1;
  std::deque<std::pair<std::uint64_t, comm_call>> history_;
  std::optional<mpi_failure> failure_;
  std::optional<std::string> abort_request_;
  bool retired_ = false;
  bool stopped_ = false;  // the engine stopped: no more collectives

  // (P) members
  std::unique_ptr<mpi_running> current_;
  std::list<std::unique_ptr<mpi_running>> orphans_;
  std::list<pending_send> sends_;
  std::unique_ptr<std::byte[]> cache_;
  std::size_t cache_bytes_ = 0;
  probe_state probe_;
  std::vector<char> dead_;
  std::vector<char> exit_from_;
  bool peer_orphans_ = false;
  bool exiting_ = false;
  mpi_clock::time_point exit_deadline_;
  mpi_clock::time_point next_orphan_test_;

 public:
  /// Marks the state stopped (no more collectives) under its lock.
  void mark_stopped() {
    std::lock_guard lock(m_);
    stopped_ = true;
  }
};

/// The process-wide MPI engine: initialises MPI when needed, owns the progress thread, ends the
/// job cleanly (MPI_Finalize) or, after a failure with collectives in flight, with MPI_Abort.
class mpi_engine {
 public:
  mpi_engine() {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized != 0)
      throw error("dparallel: mpi: MPI was already finalised in this process; MPI cannot be initialised again");
    int provided = MPI_THREAD_SINGLE;
    if (initialized == 0) {
      int const rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) throw error("dparallel: mpi: MPI_Init_thread failed: " + mpi_error_text(rc));
      initialized_here_ = true;
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      std::string const msg = "dparallel: mpi: expected MPI with MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE "
                              "(dparallel calls MPI from its progress thread), found " +
                              thread_level_name(provided) +
                              (initialized_here_ ? std::string("; this MPI library does not support threads")
                                                 : std::string("; initialise MPI with MPI_Init_thread(&argc, &argv, "
                                                               "MPI_THREAD_MULTIPLE, &provided)"));
      if (initialized_here_) MPI_Finalize();
      throw error(msg);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    // Stop the progress thread when the program (or we) call MPI_Finalize.
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &mpi_engine::on_finalize, &keyval_, nullptr);
    MPI_Comm_set_attr(MPI_COMM_SELF, keyval_, this);
    thread_ = std::thread([this] { loop(); });
  }
  mpi_engine(mpi_engine const&) = delete;
  mpi_engine& operator=(mpi_engine const&) = delete;
  ~mpi_engine() { shutdown(true); }

  /// The engine of this process, made (and MPI initialised) on first use.
  static std::shared_ptr<mpi_engine> instance() {
    auto& h = holder();
    std::lock_guard lock(h.m);
    if (h.engine) return h.engine;
    if (h.shut_down)
      throw error("dparallel: mpi: MPI was finalised (dparallel::mpi::finalize, MPI_Finalize or the end of the "
                  "program); a process cannot use MPI again after that");
    h.engine = std::make_shared<mpi_engine>();
    return h.engine;
  }

  /// Ends dparallel's use of MPI: see mpi::finalize().
  static void finalize_process() {
    std::shared_ptr<mpi_engine> e;
    {
      auto& h = holder();
      std::lock_guard lock(h.m);
      e = h.engine;
      h.shut_down = true;
    }
    if (e) e->shutdown(true);
  }

  /// Runs f() on the progress thread and waits for it (its exception is rethrown here).
  void call(std::function<void()> f) {
    std::promise<void> done;
    auto fut = done.get_future();
    {
      std::lock_guard lock(m_);
      if (stopping_) throw error("dparallel: mpi: MPI is being finalised; no new MPI work can start");
      calls_.push_back([&] {
        try {
          f();
          done.set_value();
        } catch (...) {
          done.set_exception(std::current_exception());
        }
      });
    }
    cv_.notify_all();
    fut.get();
  }

  void attach(std::shared_ptr<mpi_comm_state> s) {
    {
      std::lock_guard lock(m_);
      comms_.push_back(std::move(s));
    }
    cv_.notify_all();
  }
  void wake() {
    {
      std::lock_guard lock(m_);
      woken_ = true;
    }
    cv_.notify_all();
  }
  [[nodiscard]] bool stopped() {
    std::lock_guard lock(m_);
    return stopping_;
  }
  /// A reason to end the job with MPI_Abort at exit (the first one is kept).
  void must_abort(std::string why) {
    std::lock_guard lock(m_);
    if (abort_reason_.empty()) abort_reason_ = std::move(why);
  }

 private:
  struct holder_t {
    std::mutex m;
    std::shared_ptr<mpi_engine> engine;
    bool shut_down = false;
    ~holder_t() {
      std::shared_ptr<mpi_engine> e;
      {
        std::lock_guard lock(m);
        e = engine;
        shut_down = true;
      }
      if (e) e->shutdown(true);  // at exit, whoever still holds the engine
    }
  };
  static holder_t& holder() {
    static holder_t h;
    return h;
  }

  static int on_finalize(MPI_Comm, int, void* attr, void*) {
    static_cast<mpi_engine*>(attr)->shutdown(false);
    return MPI_SUCCESS;
  }

  // Stops the progress thread (after the running collectives finished or failed and the exit
  // handshake of failed groups), then MPI_Abort or (when dparallel initialised MPI and `finalize`)
  // MPI_Finalize. Idempotent.
  void shutdown(bool finalize) {
    stop_and_settle();
    if (!finalize) return;
    std::lock_guard once(finalize_m_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized == 0 && !finalize_called_) {
      finalize_called_ = true;
      if (keyval_ != MPI_KEYVAL_INVALID) {
        MPI_Comm_delete_attr(MPI_COMM_SELF, keyval_);  // calls on_finalize: a no-op by now
        MPI_Comm_free_keyval(&keyval_);
      }
      if (initialized_here_) MPI_Finalize();
    }
  }

  void stop_and_settle() {
    std::lock_guard once(shutdown_m_);
    if (!shut_) {
      shut_ = true;
      {
        std::lock_guard lock(m_);
        stopping_ = true;
      }
      cv_.notify_all();
      if (thread_.joinable()) thread_.join();
      std::vector<std::shared_ptr<mpi_comm_state>> comms;
      {
        std::lock_guard lock(m_);
        comms = comms_;
      }
      bool leader = !abort_reason_.empty();  // a set-up that timed out: no handshake to elect anyone
      for (auto& c : comms) {
        c->mark_stopped();
        if (c->failed()) {
          if (auto p = c->exit_problem(); !p.empty()) {
            must_abort(p);
            leader = leader || c->abort_leader();
          }
        }
      }
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!abort_reason_.empty() && finalized == 0) {
        std::fflush(nullptr);
        std::fprintf(stderr, "dparallel: rank %d: the MPI job must end with MPI_Abort, because %s\n", world_rank_,
                     abort_reason_.c_str());
        std::fflush(stderr);
        // One rank ends the job (concurrent MPI_Aborts garble the launcher's report); the others
        // wait for it a little, then end it themselves.
        if (!leader) std::this_thread::sleep_for(std::chrono::seconds(5));
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      if (finalized == 0) {
        for (auto& c : comms) {
          c->fail_now("MPI is being finalised");
          c->free_comms();
        }
      }
      std::lock_guard lock(m_);
      comms_.clear();
    }
  }

  void loop() {
    int idle = 0;
    bool exit_started = false;
    for (;;) {
      std::vector<std::shared_ptr<mpi_comm_state>> comms;
      std::deque<std::function<void()>> calls;
      bool stop = false;
      {
        std::lock_guard lock(m_);
        comms = comms_;
        calls.swap(calls_);
        stop = stopping_;
        woken_ = false;
      }
      for (auto& f : calls) f();
      auto const now = mpi_clock::now();
      bool progressed = !calls.empty();
      bool active = false;
      for (auto& c : comms) {
        auto const t = c->progress(now);
        progressed |= t.progressed;
        active |= t.active;
      }
      {
        std::vector<std::shared_ptr<mpi_comm_state>> done;
        for (auto& c : comms)
          if (c->finished()) done.push_back(c);
        if (!done.empty()) {
          std::lock_guard lock(m_);
          std::erase_if(comms_, [&](auto const& c) { return std::find(done.begin(), done.end(), c) != done.end(); });
        }
      }
      if (stop) {
        // Let running collectives finish (or fail at their timeout), then the exit handshake.
        bool busy = false;
        for (auto& c : comms) busy |= c->busy();
        if (!busy) {
          if (!exit_started) {
            exit_started = true;
            for (auto& c : comms)
              if (c->failed()) c->start_exit(now + c->opts().exit_grace);
            continue;
          }
          bool done = true;
          for (auto& c : comms) done &= c->exit_done(mpi_clock::now());
          if (done) return;
        }
      }
      if (progressed) {
        idle = 0;
        continue;
      }
      if (active || stop) {
        // Poll the running collective; back off so that a waiting rank leaves the cores to compute.
        ++idle;
        if (idle < 64) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(idle < 512 ? 20 : 100));
        continue;
      }
      std::unique_lock lock(m_);
      // Idle: new collectives wake the thread at once; control messages are read every 5 ms.
      cv_.wait_for(lock, std::chrono::milliseconds(5), [&] { return woken_ || !calls_.empty() || stopping_; });
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<mpi_comm_state>> comms_;
  std::deque<std::function<void()>> calls_;
  bool woken_ = false;
  bool stopping_ = false;
  std::string abort_reason_;

  std::mutex shutdown_m_;  // stop_and_settle
  std::mutex finalize_m_;  // the MPI_Finalize part of shutdown (MPI_Comm_delete_attr re-enters shutdown)
  bool shut_ = false;
  bool finalize_called_ = false;
  bool initialized_here_ = false;
  int world_rank_ = 0;
  int keyval_ = MPI_KEYVAL_INVALID;
  std::thread thread_;
};

}  // namespace detail

namespace mpi {

/// One rank's endpoint of an MPI process group (a duplicate of `parent`). Satisfies
/// dparallel::communicator; share it through process_group (make_group, init_process_group).
/// Every rank of `parent` must construct it (it is a collective), in the same order.
class communicator {
 public:
  /// Duplicates `parent`; waits at most `timeout` for peers in each collective.
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

  /// This rank in the duplicated communicator.
  [[nodiscard]] int rank() const noexcept { return state_->rank(); }
  /// Number of ranks.
  [[nodiscard]] int size() const noexcept { return state_->size(); }

  /// See communicator: in place, in rank order unless options::reduce says native.
  work all_reduce(tensor_ref t, reduce_op op = reduce_op::sum) {
    dparallel::detail::comm_call c{dparallel::detail::comm_kind::all_reduce, t.dtype(), t.size(), t.size(), op, 0};
    check_tensor(c, t, "t");
    check_reducible(c, t);
    return issue(c, t, {});
  }
  /// See communicator: in place onto `root`.
  work reduce(tensor_ref t, int root, reduce_op op = reduce_op::sum) {
    dparallel::detail::comm_call c{dparallel::detail::comm_kind::reduce, t.dtype(), t.size(), t.size(), op, root};
    check_tensor(c, t, "t");
    check_reducible(c, t);
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
    check_reducible(c, out);
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
  /// and `why` (the peers learn it through the control channel). The first failure wins.
  void abort(std::string why) {
    state_->request_abort(std::move(why));
    engine_->wake();
  }

  /// How long a collective waits for its peers before failing with timeout_error.
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

 private:
  work issue(dparallel::detail::comm_call const& c, tensor_ref a, tensor_ref b) {
    work w = state_->issue(c, a, b);
    engine_->wake();
    return w;
  }

  [[noreturn]] void reject(dparallel::detail::comm_call const& c, std::string const& what) {
    std::string const msg = std::string(dparallel::detail::kind_name(c.kind)) + " on rank " + std::to_string(rank()) +
                            ": " + what;
    abort("invalid arguments to " + msg);
    throw invalid_argument("dparallel: mpi::communicator: " + msg);
  }

  void check_tensor(dparallel::detail::comm_call const& c, tensor_ref t, char const* name) {
    if (t.device().kind != device_kind::host && !opts().cuda_aware) {
      reject(c, std::string("expected `") + name + "` in host memory, found a view on " + to_string(t.device()) +
                    "; set mpi::options::cuda_aware if this MPI is CUDA-aware");
    }
    if (auto const problem = dparallel::detail::null_data_problem(t, name); !problem.empty()) reject(c, problem);
  }

  void check_reducible(dparallel::detail::comm_call const& c, tensor_ref t) {
    bool const floating = dparallel::detail::host_reducible(c.type);
    bool const integer = c.type == dtype::i32 || c.type == dtype::i64 || c.type == dtype::u8;
    if (!floating && !integer) {
      reject(c, "the MPI communicator reduces F32, F64, I32, I64 and U8, found " + std::string(name_of(c.type)) +
                    "; convert the data, or use broadcast / all_gather, which move any dtype");
    }
    if (c.op == reduce_op::avg && !floating) {
      reject(c, "avg needs a floating-point dtype (F32, F64), found " + std::string(name_of(c.type)) + "; use sum");
    }
    if (c.type == dtype::u8 && t.device().kind != device_kind::host) {
      reject(c, "U8 sums of device memory are not supported through MPI (Open MPI's MPI_SUM saturates U8); use I32");
    }
    if (c.op == reduce_op::avg && t.device().kind != device_kind::host) {
      reject(c, "avg of device memory is not supported through MPI (MPI has no average operation); use sum and "
                "scale the result");
    }
  }

  void check_root(dparallel::detail::comm_call const& c) {
    if (auto const problem = dparallel::detail::root_problem(c.root, size()); !problem.empty()) reject(c, problem);
  }

  void check_blocks(dparallel::detail::comm_call const& c, tensor_ref small, tensor_ref big, char const* small_name,
                    char const* big_name) {
    if (big.device() != small.device()) {
      reject(c, std::string("expected `") + big_name + "` and `" + small_name + "` on the same device, found " +
                    to_string(big.device()) + " and " + to_string(small.device()));
    }
    auto const problem = dparallel::detail::blocks_problem(small, big, small_name, big_name, size(), rank());
    if (!problem.empty()) reject(c, problem);
    if (small.size() == 0) return;
    if (small.device().kind != device_kind::host) {
      if (c.kind == dparallel::detail::comm_kind::reduce_scatter && !dparallel::detail::disjoint(small, big))
        reject(c, "an in-place reduce_scatter of device memory is not supported; pass disjoint buffers");
      if (small.size() > opts().max_message_elements)
        reject(c, "device buffers of all_gather / reduce_scatter are limited to options::max_message_elements = " +
                      std::to_string(opts().max_message_elements) + " elements per rank, found " +
                      std::to_string(small.size()));
    }
  }

  std::shared_ptr<dparallel::detail::mpi_engine> engine_;
  std::shared_ptr<dparallel::detail::mpi_comm_state> state_;
};

static_assert(dparallel::communicator<communicator>);

/// This rank's process group over a duplicate of `parent` (every rank of `parent` must call it).
inline process_group make_group(MPI_Comm parent = MPI_COMM_WORLD,
                                std::chrono::milliseconds timeout = std::chrono::seconds(300), options opts = {}) {
  return process_group(std::make_shared<communicator>(parent, timeout, opts));
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
  auto comm = std::make_shared<communicator>(MPI_COMM_WORLD, init.timeout, opts);
  process_group group(comm);
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

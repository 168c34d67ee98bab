#pragma once
// The state of one MPI communicator (see <dparallel/comm/mpi.hpp>): the user's threads queue
// collectives here; the progress thread (mpi_engine) runs them one at a time, step by step
// (mpi/detail/algorithms.hpp), serves the control channel (mpi/detail/control.hpp) and fails the group on an
// abort, an MPI error or a timeout.

#include <dparallel/config.hpp>
#include <dparallel/comm/mpi/detail/algorithms.hpp>
#include <dparallel/comm/mpi/detail/common.hpp>
#include <dparallel/comm/mpi/detail/control.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/detail/subgroup_plan.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// The state of one MPI communicator, shared by its handle (the user's threads) and the
/// progress thread. Members marked (P) are touched by the progress thread only.
class mpi_comm_state final : public mpi_control_channel {
 public:
  struct tick {
    bool progressed = false;
    bool active = false;
  };

  mpi_comm_state(mpi::options opts, std::chrono::milliseconds timeout)
      : mpi_control_channel(opts), timeout_ms_(timeout.count()) {}
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
    closed_from_.assign(static_cast<std::size_t>(size_), 0);
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
    t.progressed |= fail_for_closed_peer();
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
  /// A healthy retired state first tells every live peer how many collectives it issued (CLOSED),
  /// so that a peer waiting for a later one fails at once naming it, and frees its communicators
  /// once every live peer's CLOSED arrived (see mpi_msg::closed).
  [[nodiscard]] bool finished() {
    if (freed_) return true;
    bool retire_now = false;
    std::uint64_t issued = 0;
    {
      std::lock_guard lock(m_);
      retire_now = retired_ && !failure_ && !abort_request_ && queue_.empty() && !current_;
      issued = next_seq_ - 1;
    }
    if (!retire_now || !ready_) return false;
    if (!close_sent_) {
      close_sent_ = true;
      for (int j = 0; j < size_; ++j)
        if (j != rank_ && dead_[static_cast<std::size_t>(j)] == 0) send_to(j, mpi_msg_writer(mpi_msg::closed).u64(issued).b);
    }
    test_sends();
    if (!close_done() || !sends_.empty()) return false;
    free_comms();
    return true;
  }
  /// (P) Whether this state was retired healthy and waits for its peers' CLOSED.
  [[nodiscard]] bool closing() const noexcept { return close_sent_ && !freed_; }

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
      if (j != rank_ && !gone(j)) send_to(j, mpi_msg_writer(mpi_msg::exit).u64(orphans).b);
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
      if (j != rank_ && exit_from_[static_cast<std::size_t>(j)] == 0 && closed_from_[static_cast<std::size_t>(j)] == 0)
        silent.push_back(j);
    if (!silent.empty())
      return describe_ranks(silent) + (silent.size() == 1 ? " was" : " were") +
             " not seen to exit after the process group failed (dead, or still running): " + why;
    if (peer_orphans_)
      return "a peer still had a collective in flight when the process group failed: " + why;
    return {};
  }
  /// (P or after the thread stopped) Fails everything, e.g. when MPI is being finalised.
  void fail_now(std::string const& reason) { fail({rank_, false, reason}, false); }

  /// Frees the MPI communicators (healthy groups, or failed ones that ended cleanly).
  /// (progress thread) The communicator collectives run on; subgroups are split from it.
  [[nodiscard]] MPI_Comm data_comm() const noexcept { return data_; }
  /// A subgroup's members in its parent, named in its errors; set before its first collective.
  void set_parent_ranks(std::vector<int> ranks) { parent_ranks_ = std::move(ranks); }

  void free_comms() {
    if (freed_ || !ready_) return;
    freed_ = true;
    MPI_Comm_free(&data_);
    MPI_Comm_free(&control_);
  }

 private:
  [[nodiscard]] std::exception_ptr error_for(mpi_task const& t) const {  // lock held or (P)
    return collective_error(rank_, describe(t.call), t.seq, subgroup_failure(*failure_, parent_ranks_));
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

  // (P) A peer that closed after issuing fewer collectives than the running or next one: fails the
  // group naming it (the same cause, and error type, as on thread ranks and shared memory).
  bool fail_for_closed_peer() {
    std::uint64_t seq = 0;
    if (current_) {
      seq = current_->task.seq;
    } else {
      std::lock_guard lock(m_);
      if (failure_ || queue_.empty()) return false;
      seq = queue_.front().seq;
    }
    for (int j = 0; j < size_; ++j) {
      std::uint64_t const c = closed_from_[static_cast<std::size_t>(j)];
      if (c == 0 || c - 1 >= seq) continue;
      std::uint64_t const issued = c - 1;
      fail({j, false, finished_reason(j, "its process_group was destroyed or closed", issued, seq, rank_, "")}, true);
      return true;
    }
    return false;
  }

  // (P) Sets the failure (first one wins), fails the running and queued collectives, and tells the peers.
  void fail(mpi_failure f, bool notify) override {
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
        if (j != rank_ && !gone(j)) send_to(j, msg);
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
          cache_.recycle(*done);
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
      if (r.mismatch) {  // the descriptor check failed on every rank alike: nothing is in flight
        auto [culprit, why] = std::move(*r.mismatch);
        fail({culprit, false, std::move(why)}, true);
        return true;
      }
      ++r.next;
      progressed = true;
    }
    if (!probe_.active && now >= r.deadline) start_probe(r.task.seq, r.task.call, r.task.timeout, now);
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
      build_mpi_steps(*r, rank_, size_, data_, opts_, cache_);
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

  void test_orphans() {
    for (auto it = orphans_.begin(); it != orphans_.end();) {
      int flag = 0;
      if (MPI_Test(&(*it)->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag != 0) it = orphans_.erase(it);
      else ++it;
    }
  }

  mpi_peer_status status_for(std::uint64_t seq) override {
    mpi_peer_status s;
    s.seq = seq;
    {
      std::lock_guard lock(m_);
      s.issued = next_seq_ - 1;
      for (auto const& [q, c] : history_)
        if (q == seq) s.at_seq = describe(c);
      if (!history_.empty()) s.last = describe(history_.back().second);
      if (failure_) s.failure = failure_->reason;
    }
    s.completed = completed_ops();
    return s;
  }

  bool ready_ = false;           // set-up done
  bool freed_ = false;           // (P) communicators freed
  bool close_sent_ = false;      // (P) CLOSED sent to the peers (retired healthy)
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
  mpi_staging_cache cache_;
  mpi_clock::time_point next_orphan_test_;
  std::vector<int> parent_ranks_;  // a subgroup's members in its parent; empty otherwise

 public:
  /// Marks the state stopped (no more collectives) under its lock.
  void mark_stopped() {
    std::lock_guard lock(m_);
    stopped_ = true;
  }
};


}  // namespace detail
DPARALLEL_NAMESPACE_END

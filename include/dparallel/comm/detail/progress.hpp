#pragma once
// Engine-neutral progress of asynchronous collectives: how a failure is named (comm_failure,
// collective_error), how a timeout becomes a deadline (deadline_after), and collective_poller, the
// queue + poll thread of an engine whose collectives run on a device and complete on their own
// (NCCL: an event per collective). Every communicator names failures the same way: the host
// group, the MPI engine and the NCCL communicator all build their errors with collective_error.
//
// collective_poller's locking (the reason it exists). Its mutex guards only the queue, the
// failure and the counters: the poll thread never holds it while it polls a collective, sleeps
// between polls, calls the engine's abort, or releases a collective's resources. So a launch,
// an abort(), pending() and drain() never wait for a collective still running on the device,
// and the collectives of consecutive DDP buckets are queued while earlier ones run. (The NCCL
// poller this replaces waited with cv.wait_for(lock, t, pred) while a collective was pending:
// with pred true that call returns at once without ever releasing the mutex, so the thread spun
// holding it and every launch waited for all pending collectives.)
//
// Failure. The first failure wins and is sticky: an abort(why), a collective that did not
// complete within its timeout, a collective the engine reports failed, or an engine-wide error.
// The poll thread alone handles it, in this order: (1) it fails the group, taking every queued
// collective out of the queue; (2) it calls the engine's abort_native() once; (3) only then it
// releases each collective's resources (staging memory, events) and completes its work with the
// error. Releasing before the abort could free memory a stuck kernel still uses, or block in a
// synchronising free behind it.
//
// The launch mutex. A launch runs inside the engine (the NCCL enqueue) under the launch mutex,
// one at a time, and abort_native() normally takes the same mutex, so that the engine is not
// aborted while another thread is inside a call on it. But an enqueue can block: NCCL connects
// to a peer inside the call that first needs the connection, and waits there for a peer that
// never comes (dead, hung, or issuing other collectives). So the watchdog never waits for the
// mutex longer than launch_abort_grace: an enqueue still inside after it is blocked, and ending
// it is what the abort is for. NCCL allows exactly this: its user guide ("Fault Tolerance")
// has an application call ncclCommAbort at any point (during initialisation, communication or
// finalisation) to recover from a failed peer, and nccl.h says it "aborts any operations that
// might still be running"; a call blocked inside NCCL watches the communicator's abort flag,
// which ncclCommAbort sets first, and returns an error. A launch inside the engine is watched
// too: the poll thread knows its deadline (the collective's timeout, from the start of the
// launch) and fails the group when it passes, even with nothing queued. The launch returns once
// the abort ended its call, and fails its work with the group's error.

#include <dparallel/config.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/error.hpp>

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// Why a process group failed: the rank at fault, whether it was a timeout, and the reason.
struct comm_failure {
  int rank = 0;
  bool timeout = false;
  std::string reason;
};

/// The error rank `me` reports for its collective #`seq` (`what`, e.g. "all_reduce of 4 x F32")
/// once its group failed with `f`: a timeout_error or comm_error naming the rank at fault.
inline std::exception_ptr collective_error(int me, std::string_view what, std::uint64_t seq, comm_failure const& f) {
  std::string msg = "dparallel: rank " + std::to_string(me) + ": " + std::string(what) + " (collective #" +
                    std::to_string(seq) + ") failed: " + f.reason;
  if (f.timeout) return std::make_exception_ptr(timeout_error(f.rank, msg));
  return std::make_exception_ptr(comm_error(f.rank, msg));
}

/// now + timeout, saturated so that a huge timeout (milliseconds::max() for "forever") cannot
/// overflow the clock into the past.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  auto const now = std::chrono::steady_clock::now();
  auto const room = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::time_point::max() - now);
  return timeout >= room ? std::chrono::steady_clock::time_point::max() : now + timeout;
}

/// How long the watchdog waits for a launch inside the engine to come out before it aborts the
/// engine beside it (see the top of this file): an enqueue takes microseconds unless it blocks.
inline constexpr std::chrono::milliseconds launch_abort_grace{100};

/// What polling a launched collective found.
struct poll_result {
  enum class state : std::uint8_t { pending, done, failed };
  state st = state::pending;
  std::string why;  // failed: the engine's reason
  static poll_result pending() { return {}; }
  static poll_result done() { return {state::done, {}}; }
  static poll_result failed(std::string why) { return {state::failed, std::move(why)}; }
};

/// The queue and poll thread of one rank's communicator (see the top of this file). `Driver` is
/// the engine; every hook runs without the poller's mutex:
///   typename Driver::handle                          what a launch made (event, staging)
///   poll_result poll(handle&)                        nonblocking
///   std::string async_error()                        an engine-wide error, empty when none
///   void finish(handle&)                             succeeded: e.g. copy staged results out
///   void release(handle&) noexcept                   always, last; after abort_native() on failure
///   void abort_native() noexcept                     once, after the first failure
///   std::string late(handle&)                        optional: why a collective past its deadline is late
///   comm_failure describe_failure(comm_failure)      optional: the failure as every work reports it
///                                                    (e.g. a subgroup's parent ranks appended)
/// The driver must outlive the poller; stop() (or the destructor) joins the thread.
template <class Driver>
class collective_poller {
 public:
  using handle = typename Driver::handle;
  using clock = std::chrono::steady_clock;

  collective_poller(int rank, Driver& driver) : rank_(rank), driver_(driver), thread_([this] { loop(); }) {}
  collective_poller(collective_poller const&) = delete;
  collective_poller& operator=(collective_poller const&) = delete;
  /// Waits for the pending collectives (each fails at its timeout at the latest), then joins.
  ~collective_poller() { stop(); }

  /// Launches collective `what` with `make()` (which returns its handle; called under the launch
  /// mutex, never concurrently with abort_native()). Returns its work at once: failed when the
  /// group already failed (make() is not called) or when make() throws (that exception).
  template <class Make>
  work launch(std::string what, std::chrono::milliseconds timeout, Make&& make) {
    work_promise p;
    work w = p.get_work();
    std::unique_lock launching(launch_m_);
    std::uint64_t seq = 0;
    {
      std::unique_lock lock(m_);
      seq = next_seq_++;
      if (failure_) {
        std::exception_ptr const e = collective_error(rank_, what, seq, *failure_);
        lock.unlock();
        retire_unqueued(p, e);
        return w;
      }
      launching_ = inside{seq, &what, timeout, deadline_after(timeout)};
      if (queue_.empty()) cv_.notify_all();  // an idle poll thread learns the launch's deadline
    }
    std::optional<handle> h;
    std::exception_ptr thrown;
    try {
      h.emplace(make());
    } catch (...) {
      thrown = std::current_exception();
    }
    launching.unlock();
    std::unique_lock lock(m_);
    launching_.reset();
    if (failure_) {
      // The group failed while this collective was launched (perhaps ending its call: then the
      // engine's error is a consequence, the group's failure the cause): abort first (the poll
      // thread does it), then release.
      state_cv_.wait(lock, [&] { return native_aborted_; });
      std::exception_ptr const e = collective_error(rank_, what, seq, *failure_);
      lock.unlock();
      if (h) driver_.release(*h);
      retire_unqueued(p, e);
      return w;
    }
    if (thrown) {
      lock.unlock();
      retire_unqueued(p, thrown);
      return w;
    }
    queue_.push_back(op{seq, std::move(what), timeout, deadline_after(timeout), std::move(*h), std::move(p)});
    ++pending_;
    lock.unlock();
    cv_.notify_all();
    return w;
  }

  /// Fails every pending and later collective with a comm_error naming this rank and `why`
  /// (unless the group failed already); returns once the engine was aborted and every pending
  /// work completed.
  void abort(std::string why) {
    std::unique_lock lock(m_);
    if (!failure_ && !abort_request_) abort_request_ = std::move(why);
    cv_.notify_all();
    state_cv_.wait(lock, [&] { return settled_; });
  }

  /// Blocks until every collective launched so far has finished, successfully or not.
  void drain() {
    std::unique_lock lock(m_);
    state_cv_.wait(lock, [&] { return pending_ == 0; });
  }
  [[nodiscard]] std::size_t pending() const {
    std::lock_guard lock(m_);
    return pending_;
  }
  [[nodiscard]] bool failed() const {
    std::lock_guard lock(m_);
    return failure_.has_value();
  }
  /// Whether abort_native() has run (then the engine must not be destroyed normally).
  [[nodiscard]] bool aborted() const {
    std::lock_guard lock(m_);
    return native_aborted_;
  }
  /// Collectives finished, successfully or not (counted before their work completes).
  [[nodiscard]] std::uint64_t completed() const {
    std::lock_guard lock(m_);
    return completed_;
  }

  /// Drains, then joins the poll thread. Idempotent.
  void stop() {
    drain();
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct op {
    std::uint64_t seq = 0;
    std::string what;
    std::chrono::milliseconds timeout{};
    clock::time_point deadline;
    handle h;
    work_promise done;
  };

  void retire_unqueued(work_promise& p, std::exception_ptr e) {
    {
      std::lock_guard lock(m_);
      ++completed_;
    }
    p.complete(std::move(e));
  }

  // Not pending any more before its work completes: a caller whose wait() returned may destroy
  // the communicator at once and must not find the collective still pending.
  void retire(op& o, std::exception_ptr e) {
    {
      std::lock_guard lock(m_);
      ++completed_;
      --pending_;
    }
    state_cv_.notify_all();
    o.done.complete(std::move(e));
  }

  // (poll thread, m_ held) Fails the group with `f`: abort, then release and fail every collective.
  void fail(std::unique_lock<std::mutex>& lock, comm_failure f) {
    if constexpr (requires { { driver_.describe_failure(f) } -> std::same_as<comm_failure>; }) {
      f = driver_.describe_failure(std::move(f));
    }
    failure_ = std::move(f);
    abort_request_.reset();
    std::deque<op> dead;
    dead.swap(queue_);
    lock.unlock();
    {
      // A launch inside the engine gets launch_abort_grace to come out; one still inside is
      // blocked (see the top of this file) and the abort proceeds beside it.
      // (try_lock polled, not a timed mutex: ThreadSanitizer does not follow the clocked lock
      // that std::timed_mutex::try_lock_for uses, and this runs only once, on failure.)
      std::unique_lock launching(launch_m_, std::try_to_lock);
      for (auto const until = clock::now() + launch_abort_grace; !launching.owns_lock() && clock::now() < until;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        (void)launching.try_lock();
      }
      driver_.abort_native();
    }
    lock.lock();
    native_aborted_ = true;
    lock.unlock();
    state_cv_.notify_all();
    for (auto& o : dead) {
      driver_.release(o.h);
      retire(o, collective_error(rank_, o.what, o.seq, *failure_));
    }
    lock.lock();
    settled_ = true;
    state_cv_.notify_all();
  }

  // (poll thread, m_ not held) Why a collective is late: the driver's account when it has one
  // (`std::string late(handle&)`, e.g. the devices of a clique that did not finish), else the
  // process group's.
  std::string late_reason(handle& h) {
    if constexpr (requires { { driver_.late(h) } -> std::convertible_to<std::string>; }) {
      return driver_.late(h);
    } else {
      return " on rank " + std::to_string(rank_) +
             ": a peer did not join (dead, hung, or issuing other collectives); if it is only slow, "
             "raise the timeout (process_group::set_timeout, init_options::timeout)";
    }
  }

  void loop() {
    std::unique_lock lock(m_);
    int idle = 0;
    for (;;) {
      if (abort_request_) {
        std::string const why = *abort_request_;
        fail(lock, {rank_, false, "rank " + std::to_string(rank_) + " aborted the process group: " + why});
        continue;
      }
      // A launch inside the engine is watched until the group fails (then the abort ended it).
      bool const watch_launch = launching_.has_value() && !failure_;
      if (watch_launch && clock::now() > launching_->deadline) {
        inside const& l = *launching_;
        fail(lock, {rank_, true,
                    *l.what + " (collective #" + std::to_string(l.seq) + ") did not complete within " +
                        std::to_string(l.timeout.count()) + " ms: rank " + std::to_string(rank_) +
                        " was still inside the engine's call that launches it (it blocks there while it "
                        "waits for a peer that does not join: dead, hung, or issuing other collectives); "
                        "if the peer is only slow, raise the timeout (process_group::set_timeout, "
                        "init_options::timeout)"});
        continue;
      }
      if (queue_.empty()) {
        if (stopping_) return;
        // Nothing pending: sleep until a launch, an abort or stop (no polling, no spinning), or
        // until the deadline of a launch inside the engine.
        if (watch_launch) {
          std::uint64_t const seq = launching_->seq;
          auto const changed = [&] {
            return stopping_ || abort_request_ || !queue_.empty() || !launching_ || launching_->seq != seq;
          };
          if (launching_->deadline == clock::time_point::max()) cv_.wait(lock, changed);  // no timeout
          else cv_.wait_until(lock, launching_->deadline, changed);
        } else {
          cv_.wait(lock, [&] { return stopping_ || abort_request_ || !queue_.empty() || (launching_ && !failure_); });
        }
        continue;
      }
      // Only this thread removes collectives, so `front` stays valid while the mutex is released
      // (deque::push_back does not invalidate references to the elements).
      op& front = queue_.front();
      lock.unlock();
      std::string const async = driver_.async_error();
      poll_result const r = async.empty() ? driver_.poll(front.h) : poll_result::failed(async);
      bool const late = r.st == poll_result::state::pending && clock::now() > front.deadline;
      std::string const late_why = late ? late_reason(front.h) : std::string();
      if (r.st == poll_result::state::done) driver_.finish(front.h);
      lock.lock();
      if (r.st == poll_result::state::done) {
        op o = std::move(queue_.front());
        queue_.pop_front();
        lock.unlock();
        driver_.release(o.h);
        retire(o, nullptr);
        lock.lock();
        idle = 0;
      } else if (r.st == poll_result::state::failed) {
        fail(lock, {rank_, false,
                    (async.empty() ? "" : "an engine error while waiting: ") + r.why + " (rank " +
                        std::to_string(rank_) + ", " + front.what + ", collective #" + std::to_string(front.seq) + ")"});
      } else if (late) {
        fail(lock, {rank_, true,
                    front.what + " (collective #" + std::to_string(front.seq) + ") did not complete within " +
                        std::to_string(front.timeout.count()) + " ms" + late_why});
      } else if (!abort_request_) {
        // Still running: back off without the mutex, so launches and aborts go through.
        lock.unlock();
        ++idle;
        if (idle < 64) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(idle < 512 ? 20 : 100));
        lock.lock();
      }
    }
  }

  // A launch inside the engine (under launch_m_): its collective and deadline.
  struct inside {
    std::uint64_t seq = 0;
    std::string const* what = nullptr;  // the launch's own string, alive while it is inside
    std::chrono::milliseconds timeout{};
    clock::time_point deadline;
  };

  int rank_;
  Driver& driver_;
  std::mutex launch_m_;  // a launch inside the engine, or abort_native() (see the top of this file)
  mutable std::mutex m_;  // guards the members below
  std::condition_variable cv_;        // wakes the poll thread
  std::condition_variable state_cv_;  // pending_ and native_aborted_ changed
  std::deque<op> queue_;
  std::size_t pending_ = 0;
  std::uint64_t next_seq_ = 1;
  std::uint64_t completed_ = 0;
  std::optional<comm_failure> failure_;
  std::optional<std::string> abort_request_;
  std::optional<inside> launching_;
  bool native_aborted_ = false;
  bool settled_ = false;  // the failure's collectives all completed
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the other members exist
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// serial_worker: the thread of a communicator that wraps other process groups (the desync
// detector, the hierarchical communicator) and runs each of its collectives as a job that issues
// and waits for the wrapped groups' collectives. Jobs run one at a time, in the order submitted;
// each completes its work with what it threw (nothing: success). The caller's issue_order token
// is captured at submit and installed while the job runs, so that a collective the job forwards
// is ordered after the caller's device work, not after the worker's (which has none).

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/issue_order.hpp>
#include <dparallel/comm/work.hpp>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// A queue of jobs and the one thread that runs them (see the top of this file).
class serial_worker {
 public:
  /// A job; `seq` is its number, 1 for the first submitted. Throws to fail its work.
  using job = std::function<void(std::uint64_t seq)>;

  serial_worker() : thread_([this] { run(); }) {}
  serial_worker(serial_worker const&) = delete;
  serial_worker& operator=(serial_worker const&) = delete;
  ~serial_worker() { stop(); }

  /// Queues `j`; its work completes when it has run.
  work submit(job j) {
    work_promise p;
    work w = p.get_work();
    auto order = issue_order::capture();  // on the caller's thread
    {
      std::lock_guard lock(m_);
      queue_.push_back(task{next_seq_++, std::move(j), std::move(p), std::move(order)});
      ++pending_;
    }
    cv_.notify_all();
    return w;
  }

  /// Jobs submitted and not yet finished.
  [[nodiscard]] std::size_t pending() const {
    std::lock_guard lock(m_);
    return pending_;
  }
  /// Jobs finished, successfully or not.
  [[nodiscard]] std::uint64_t completed() const noexcept { return completed_.load(std::memory_order_acquire); }
  /// Blocks until every job submitted so far has finished.
  void drain() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return pending_ == 0; });
  }
  /// Runs the queued jobs to the end, then joins the thread. Idempotent.
  void stop() {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct task {
    std::uint64_t seq = 0;
    job run;
    work_promise done;
    issue_order::token order;
  };

  void run() {
    for (;;) {
      task t;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr failure;
      try {
        issue_order::scope const issued_by_caller(std::move(t.order));
        t.run(t.seq);
      } catch (...) {
        failure = std::current_exception();
      }
      {  // not pending before the work completes (an owner's destructor checks pending())
        std::lock_guard lock(m_);
        if (--pending_ == 0) idle_.notify_all();
      }
      completed_.fetch_add(1, std::memory_order_release);
      t.done.complete(std::move(failure));
    }
  }

  mutable std::mutex m_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<task> queue_;
  std::size_t pending_ = 0;
  std::uint64_t next_seq_ = 1;
  bool stopping_ = false;
  std::atomic<std::uint64_t> completed_{0};
  std::thread thread_;  // last: starts after every other member is constructed
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

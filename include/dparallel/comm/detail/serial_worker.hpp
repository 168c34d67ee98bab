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
#include <dparallel/core/task_queue.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// A queue of jobs and the one thread that runs them (see the top of this file): the ordered
/// worker queue (core/task_queue.hpp) of the host engines' communication threads, whose tasks
/// are jobs.
class serial_worker {
 public:
  /// A job; `seq` is its number, 1 for the first submitted. Throws to fail its work.
  using job = std::function<void(std::uint64_t seq)>;

  serial_worker() : queue_([this](task& t) { run(t); }) {}
  serial_worker(serial_worker const&) = delete;
  serial_worker& operator=(serial_worker const&) = delete;
  ~serial_worker() { stop(); }

  /// Queues `j`; its work completes when it has run.
  work submit(job j) {
    work_promise p;
    work w = p.get_work();
    auto order = issue_order::capture();  // on the caller's thread
    queue_.push([&] { return task{next_seq_++, std::move(j), std::move(p), std::move(order)}; });
    return w;
  }

  /// Jobs submitted and not yet finished.
  [[nodiscard]] std::size_t pending() const { return queue_.pending(); }
  /// Jobs finished, successfully or not.
  [[nodiscard]] std::uint64_t completed() const noexcept { return completed_.load(std::memory_order_acquire); }
  /// Blocks until every job submitted so far has finished.
  void drain() {
    queue_.wait_idle([] {});
  }
  /// Runs the queued jobs to the end, then joins the thread. Idempotent.
  void stop() { queue_.stop(); }

 private:
  struct task {
    std::uint64_t seq = 0;
    job run;
    work_promise done;
    issue_order::token order;
  };

  // On the worker, for each job in the order submitted.
  void run(task& t) {
    std::exception_ptr failure;
    try {
      issue_order::scope const issued_by_caller(std::move(t.order));
      t.run(t.seq);
    } catch (...) {
      failure = std::current_exception();
    }
    queue_.retire([] {});  // not pending before the work completes (an owner's destructor checks pending())
    completed_.fetch_add(1, std::memory_order_release);
    t.done.complete(std::move(failure));
  }

  std::atomic<std::uint64_t> completed_{0};
  std::uint64_t next_seq_ = 1;  // under the queue's mutex
  task_queue<task> queue_;      // last: its thread starts after the other members exist
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

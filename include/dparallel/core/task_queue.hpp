#pragma once
// One thread draining a FIFO queue of tasks in order: the engine behind a host stream (a logical
// host device) and behind a host communicator's communication thread.
//
// - push(make) queues make() (called under the queue's mutex, so an owner can check and number
//   its tasks atomically with queueing them) and wakes the worker;
// - the worker hands each task to the owner's handler, outside the mutex; the handler calls
//   retire(f) once per task, where it wants the task counted as finished (f runs under the mutex
//   just before: owner state that a thread finding the queue idle must see);
// - wait_idle(f) blocks until every task pushed so far is retired, then runs f under the mutex;
// - stop() lets the worker finish the queued tasks, then joins it (the destructor does too).
// Every wait spins within the spin budget before it blocks (core/spin.hpp).

#include <dparallel/config.hpp>
#include <dparallel/core/spin.hpp>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

template <class Task>
class task_queue {
 public:
  /// Starts the worker: handler(Task&) runs for each task, in the order pushed, on the worker.
  /// Make the queue the owner's last member, so the worker starts after the owner's other
  /// members exist; stop() it first thing in the owner's destructor.
  template <class Handler>
  explicit task_queue(Handler handler) : worker_([this, h = std::move(handler)]() mutable { run(h); }) {}
  task_queue(task_queue const&) = delete;
  task_queue& operator=(task_queue const&) = delete;
  ~task_queue() { stop(); }

  /// Queues make() (called under the mutex; when it throws, nothing is queued).
  template <class Make>
  void push(Make&& make) {
    {
      std::lock_guard lock(m_);
      queue_.push_back(std::forward<Make>(make)());
      pending_.fetch_add(1, std::memory_order_relaxed);
      queued_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }

  /// Runs f() under the queue's mutex: for owner state that the handler and retire() share.
  template <class F>
  decltype(auto) locked(F&& f) {
    std::lock_guard lock(m_);
    return std::forward<F>(f)();
  }

  /// For the handler, once per task: runs f() under the mutex, then counts the task finished.
  template <class F>
  void retire(F&& f) {
    std::lock_guard lock(m_);
    std::forward<F>(f)();
    if (pending_.fetch_sub(1, std::memory_order_release) == 1) idle_.notify_all();
  }

  /// Tasks pushed and not yet retired.
  [[nodiscard]] std::size_t pending() const noexcept { return pending_.load(std::memory_order_acquire); }

  /// Blocks until every task pushed so far is retired, then returns f() run under the mutex.
  template <class F>
  decltype(auto) wait_idle(F&& f) {
    spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return pending_.load(std::memory_order_relaxed) == 0; });
    return std::forward<F>(f)();
  }

  /// Finishes the queued tasks, then joins the worker.
  void stop() {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

 private:
  template <class Handler>
  void run(Handler& handler) {
    for (;;) {
      Task t;
      spin_until([&] { return queued_.load(std::memory_order_acquire) != 0; });
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        t = std::move(queue_.front());
        queue_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
      }
      handler(t);
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<Task> queue_;
  // Changed under m_, also read without it (for spinning): tasks pushed and not yet retired, and
  // queue_.size().
  std::atomic<std::size_t> pending_{0};
  std::atomic<std::size_t> queued_{0};
  bool stopping_ = false;
  std::thread worker_;  // last: starts after every other member is constructed
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// One thread draining a FIFO queue of tasks in order: the engine behind a host stream (a logical
// host device), behind the communication thread of the thread-rank and shared-memory engines, and
// behind the serial worker of the communicators that wrap other groups.
//
// - push(make) queues make() (called under the queue's mutex, so an owner can check and number
//   its tasks atomically with queueing them) and wakes the worker;
// - the worker hands each task to the owner's handler, outside the mutex; the handler calls
//   retire(f) once per task, where it wants the task counted as finished (f runs under the mutex
//   just before: owner state that a thread finding the queue idle must see);
// - wait_idle(f) blocks until every task pushed so far is retired, then runs f under the mutex;
// - help_until_idle(f) is wait_idle for a caller that would only block: while the worker is not
//   running a task, the caller takes the next one and runs the handler itself (one task at a time,
//   in order, whoever runs it: a token passes between the worker and the helper), so work that the
//   worker has not picked up yet costs no hand-off and no wake-up;
// - hold() keeps the worker asleep for the tasks pushed from then on, for an owner that will call
//   help_until_idle (which runs them), wait_idle or release() (which wake the worker) next;
// - stop() lets the worker finish the queued tasks, then joins it (the destructor does too).
// Every wait spins within the spin budget before it blocks (core/spin.hpp).

#include <dparallel/config.hpp>
#include <dparallel/core/spin.hpp>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
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
  explicit task_queue(Handler handler) : handler_(std::move(handler)), worker_([this] { run(); }) {}
  task_queue(task_queue const&) = delete;
  task_queue& operator=(task_queue const&) = delete;
  ~task_queue() { stop(); }

  /// Queues make() (called under the mutex; when it throws, nothing is queued).
  template <class Make>
  void push(Make&& make) {
    bool wake = false;
    {
      std::lock_guard lock(m_);
      queue_.push_back(std::forward<Make>(make)());
      pending_.fetch_add(1, std::memory_order_relaxed);
      queued_.fetch_add(1, std::memory_order_release);
      wake = !held_.load(std::memory_order_relaxed);
    }
    if (wake) cv_.notify_all();
  }

  /// Tasks pushed from now on do not wake the worker until the next help_until_idle (which runs
  /// them on its caller) or wait_idle (which wakes the worker): call one of them next.
  void hold() {
    std::lock_guard lock(m_);
    held_.store(true, std::memory_order_relaxed);
  }

  /// hold() when no task is pending (those pushed before stay the worker's); true when it held.
  bool hold_if_idle() {
    std::lock_guard lock(m_);
    if (pending_.load(std::memory_order_relaxed) != 0) return false;
    held_.store(true, std::memory_order_relaxed);
    return true;
  }

  /// Ends a hold(): the worker takes the held tasks (and is woken for them).
  void release() {
    {
      std::lock_guard lock(m_);
      if (!held_.load(std::memory_order_relaxed)) return;
      held_.store(false, std::memory_order_relaxed);
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
    release();
    spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return pending_.load(std::memory_order_relaxed) == 0; });
    return std::forward<F>(f)();
  }

  /// wait_idle that runs the queued tasks on the calling thread while the worker is not running
  /// one (the handler then runs on this thread; tasks still run one at a time, in order). Ends a
  /// hold(). Returns f() run under the mutex once every task pushed so far is retired.
  template <class F>
  decltype(auto) help_until_idle(F&& f) {
    std::unique_lock lock(m_);
    for (;;) {
      if (pending_.load(std::memory_order_relaxed) == 0) {
        held_.store(false, std::memory_order_relaxed);
        return std::forward<F>(f)();
      }
      if (!running_.load(std::memory_order_relaxed) && !queue_.empty()) {
        Task t = take();
        lock.unlock();
        handler_(t);
        lock.lock();
        running_.store(false, std::memory_order_release);
        continue;
      }
      // The worker runs a task: wait for it to finish the queue or to leave the next task.
      auto const can_go_on = [&] {
        return pending_.load(std::memory_order_acquire) == 0 ||
               (!running_.load(std::memory_order_acquire) && queued_.load(std::memory_order_acquire) != 0);
      };
      lock.unlock();
      spin_until(can_go_on);
      lock.lock();
      idle_.wait(lock, [&] { return pending_.load(std::memory_order_relaxed) == 0 || (!running_ && !queue_.empty()); });
    }
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
  // Under the mutex: takes the token and the next task.
  Task take() {
    running_.store(true, std::memory_order_relaxed);
    Task t = std::move(queue_.front());
    queue_.pop_front();
    queued_.fetch_sub(1, std::memory_order_relaxed);
    return t;
  }

  void run() {
    // A task is the worker's to take when no helper runs one and no hold keeps it back.
    auto const takeable = [&] {
      return !queue_.empty() && !running_.load(std::memory_order_relaxed) &&
             (stopping_ || !held_.load(std::memory_order_relaxed));
    };
    for (;;) {
      Task t;
      spin_until([&] {
        return queued_.load(std::memory_order_acquire) != 0 && !running_.load(std::memory_order_acquire) &&
               !held_.load(std::memory_order_acquire);
      });
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return takeable() || (stopping_ && queue_.empty()); });
        if (!takeable()) return;  // stopping and drained
        t = take();
      }
      handler_(t);
      bool more = false;
      {
        std::lock_guard lock(m_);
        running_.store(false, std::memory_order_release);
        more = !queue_.empty();
      }
      if (more) idle_.notify_all();  // a helper may be waiting for the token (held tasks)
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<Task> queue_;
  // Changed under m_, also read without it (for spinning): tasks pushed and not yet retired,
  // queue_.size(), whether a thread (the worker or a helper) runs a task, and whether hold() keeps
  // the worker from the queue.
  std::atomic<std::size_t> pending_{0};
  std::atomic<std::size_t> queued_{0};
  std::atomic<bool> running_{false};
  std::atomic<bool> held_{false};
  bool stopping_ = false;
  std::function<void(Task&)> handler_;
  std::thread worker_;  // last: starts after every other member is constructed
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

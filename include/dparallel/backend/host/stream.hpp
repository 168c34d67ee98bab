#pragma once
// Host streams and events: each logical host device is a worker thread draining a FIFO queue,
// with the ordering and error semantics of a CUDA stream.
//
// - enqueue(fn) runs fn after everything enqueued before it and returns an event for it;
// - wait(event) makes later work on this stream wait for an event of any stream;
// - an exception thrown by work becomes the stream's sticky error: later work on the stream is
//   skipped and its events carry the same error, until synchronize() rethrows and clears it;
// - an exception from work is reported as a device_error naming the stream's device, with the
//   original exception nested (std::rethrow_if_nested recovers it).

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/spin.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace host {

/// Completion of one piece of enqueued work; a default-constructed event is already complete.
class event {
 public:
  event() = default;

  /// True when the work finished (successfully or not).
  [[nodiscard]] bool ready() const { return !s_ || s_->ready(); }
  /// Blocks until the work finished; rethrows its error.
  void wait() const {
    if (auto e = wait_nothrow()) std::rethrow_exception(e);
  }
  /// Blocks until the work finished; returns its error (null on success).
  [[nodiscard]] std::exception_ptr wait_nothrow() const {
    if (!s_) return nullptr;
    auto const lock = s_->wait_done();
    return s_->error;
  }
  /// Waits at most `timeout`; true when the work finished.
  template <class Rep, class Period>
  [[nodiscard]] bool wait_for(std::chrono::duration<Rep, Period> timeout) const {
    return !s_ || s_->wait_done_for(timeout);
  }

 private:
  friend class stream;
  struct state : dparallel::detail::completion {
    std::exception_ptr error;
  };
  static event make() {
    event e;
    e.s_ = std::make_shared<state>();
    return e;
  }
  void complete(std::exception_ptr error) const {
    s_->complete([&] { s_->error = std::move(error); });
  }
  std::shared_ptr<state> s_;
};

/// The queue of one logical host device, drained in order by its own worker thread.
class stream {
 public:
  explicit stream(int device_index) : device_(device_index), worker_([this] { run(); }) {}
  /// The stream of logical device `d` (its index names the device in errors).
  explicit stream(device d) : stream(d.index) {}
  stream(stream const&) = delete;
  stream& operator=(stream const&) = delete;
  /// Finishes the queued work, then joins the worker.
  ~stream() {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  [[nodiscard]] int device_index() const noexcept { return device_; }

  /// Runs `fn()` on this stream after all earlier work; returns its completion event.
  template <class F>
  event enqueue(F&& fn) {
    event done = event::make();
    {
      std::lock_guard lock(m_);
      queue_.push_back(task{std::function<void()>(std::forward<F>(fn)), done});
      pending_.fetch_add(1, std::memory_order_relaxed);
      queued_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    return done;
  }

  /// Later work on this stream waits for `e`; an error carried by `e` becomes this stream's error.
  void wait(event e) {
    if (e.ready() && !e.wait_nothrow()) return;
    enqueue([e] { e.wait(); });
  }

  /// An event that completes when all work enqueued so far has finished.
  event record() {
    return enqueue([] {});
  }

  /// Blocks until the queue is drained; rethrows (and clears) the stream's sticky error.
  void synchronize() {
    std::exception_ptr e;
    dparallel::detail::spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    {
      std::unique_lock lock(m_);
      idle_.wait(lock, [&] { return pending_.load(std::memory_order_relaxed) == 0; });
      e = std::exchange(error_, nullptr);
    }
    if (e) std::rethrow_exception(e);
  }

 private:
  struct task {
    std::function<void()> fn;
    event done;
  };

  void run() {
    for (;;) {
      task t;
      std::exception_ptr sticky;
      dparallel::detail::spin_until([&] { return queued_.load(std::memory_order_acquire) != 0; });
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        t = std::move(queue_.front());
        queue_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
        sticky = error_;
      }
      std::exception_ptr failure = sticky;
      if (!sticky) failure = invoke(t.fn);
      t.fn = nullptr;  // the work's captures die before the work counts as done
      t.done.complete(failure);
      {
        std::lock_guard lock(m_);
        if (failure && !error_) error_ = failure;
        // This thread's references to the error and the event go under the mutex, so a thread
        // that then finds the stream idle is ordered after them: it may drop the last reference
        // and destroy the exception (ThreadSanitizer does not see exception_ptr's count).
        failure = nullptr;
        sticky = nullptr;
        t.done = event{};
        if (pending_.fetch_sub(1, std::memory_order_release) == 1) idle_.notify_all();
      }
    }
  }

  // Errors already attributed to a device or rank pass through; anything else is wrapped in a
  // device_error for this device with the original nested.
  std::exception_ptr invoke(std::function<void()>& fn) const {
    try {
      fn();
      return nullptr;
    } catch (device_error const&) {
      return std::current_exception();
    } catch (comm_error const&) {
      return std::current_exception();
    } catch (std::exception const& ex) {
      try {
        std::throw_with_nested(device_error(device_, ex.what()));
      } catch (...) {
        return std::current_exception();
      }
    } catch (...) {
      try {
        std::throw_with_nested(device_error(device_, "unknown exception"));
      } catch (...) {
        return std::current_exception();
      }
    }
  }

  int device_;
  std::mutex m_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<task> queue_;
  // Changed under m_, also read without it (for spinning): work enqueued and not yet finished,
  // and queue_.size().
  std::atomic<std::size_t> pending_{0};
  std::atomic<std::size_t> queued_{0};
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread worker_;  // last: starts after every other member is constructed
};

}  // namespace host
DPARALLEL_NAMESPACE_END

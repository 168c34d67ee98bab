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
#include <dparallel/core/task_queue.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
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
  /// Starts the worker thread of logical device `device_index`.
  explicit stream(int device_index) : device_(device_index), queue_([this](task& t) { run(t); }) {}
  /// The stream of logical device `d` (its index names the device in errors).
  explicit stream(device d) : stream(d.index) {}
  stream(stream const&) = delete;
  stream& operator=(stream const&) = delete;
  /// Finishes the queued work, then joins the worker.
  ~stream() { queue_.stop(); }

  /// The index of this stream's logical device.
  [[nodiscard]] int device_index() const noexcept { return device_; }

  /// Runs `fn()` on this stream after all earlier work; returns its completion event.
  template <class F>
  event enqueue(F&& fn) {
    event done = event::make();
    queue_.push([&] { return task{std::function<void()>(std::forward<F>(fn)), done}; });
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
    if (std::exception_ptr e = queue_.wait_idle([&] { return std::exchange(error_, nullptr); }))
      std::rethrow_exception(e);
  }

 private:
  struct task {
    std::function<void()> fn;
    event done;
  };

  // On the worker, for each task in order: skipped while the stream holds an error.
  void run(task& t) {
    std::exception_ptr sticky = queue_.locked([&] { return error_; });
    std::exception_ptr failure = sticky;
    if (!sticky) failure = invoke(t.fn);
    t.fn = nullptr;  // the work's captures die before the work counts as done
    t.done.complete(failure);
    queue_.retire([&] {
      if (failure && !error_) error_ = failure;
      // This thread's references to the error and the event go under the mutex, so a thread
      // that then finds the stream idle is ordered after them: it may drop the last reference
      // and destroy the exception (ThreadSanitizer does not see exception_ptr's count).
      failure = nullptr;
      sticky = nullptr;
      t.done = event{};
    });
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
  std::exception_ptr error_;  // the sticky error; under the queue's mutex
  dparallel::detail::task_queue<task> queue_;  // last: its worker starts after the other members exist
};

}  // namespace host
DPARALLEL_NAMESPACE_END

#pragma once
// CUDA streams and events for the policies: the same contract as host::stream (ordered work,
// cross-stream waits, sticky errors reported at synchronize) over a real cudaStream_t.
//
// A cuda::stream is a launch thread plus a CUDA stream. enqueue(fn) runs fn on the launch thread
// with the stream's GPU current and cuda::current_stream() set, so whatever fn launches goes to
// this stream in order; the returned event is recorded on the GPU right after fn's launches.
// wait(e) orders this stream's later GPU work after e with cudaStreamWaitEvent: no host
// synchronisation between devices inside a step (the wait is folded into the next piece of work,
// so it costs no hand-off of its own). Host-side exceptions and launch errors become the
// stream's sticky error (device_error naming the logical device) until synchronize() reports them;
// GPU-side faults are reported by synchronize() and by event::wait().

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/memory.hpp>
#include <dparallel/backend/host/stream.hpp>
#include <dparallel/core/device.hpp>

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

class stream;

namespace detail {
/// The completion events of one stream, recycled: an event is created once and recorded again
/// after its last holder let it go. Re-recording is safe even if an earlier cudaStreamWaitEvent
/// used it: that wait captured the event's state when it was called (CUDA Runtime API,
/// cudaStreamWaitEvent and cudaEventRecord: "uses the most recent call to cudaEventRecord").
class event_pool {
 public:
  /// Events of `d`'s GPU made with `flags` (cudaEventDisableTiming, or 0 for timing events).
  event_pool(device d, unsigned flags) : dev_(d), flags_(flags) {}
  event_pool(event_pool const&) = delete;
  event_pool& operator=(event_pool const&) = delete;
  ~event_pool() {
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
  }
  /// An event of the stream's GPU; called on its launch thread, with that GPU current.
  cudaEvent_t take() {
    {
      std::lock_guard lock(m_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, flags_), "cudaEventCreateWithFlags", dev_);
    return e;
  }
  void give_back(cudaEvent_t e) noexcept {
    std::lock_guard lock(m_);
    try {
      free_.push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(e);
    }
  }

 private:
  device dev_;
  unsigned flags_ = cudaEventDisableTiming;
  std::mutex m_;
  std::vector<cudaEvent_t> free_;
};
}  // namespace detail

/// Completion of enqueued work: its launches on the host, then its GPU work.
/// A default-constructed event is complete.
class event {
 public:
  event() = default;
  /// True when the work was launched and the GPU finished it (successfully or not).
  [[nodiscard]] bool ready() const {
    if (!launched_.ready()) return false;
    if (!gpu_ || gpu_->ev == nullptr) return true;
    cudaError_t const e = cudaEventQuery(gpu_->ev);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    return true;
  }
  /// Blocks until the GPU finished the work; rethrows the launch error or the GPU's fault.
  void wait() const {
    if (auto e = wait_nothrow()) std::rethrow_exception(e);
  }
  /// Waits like wait(), but returns the failure instead of throwing it (null on success).
  [[nodiscard]] std::exception_ptr wait_nothrow() const {
    if (auto e = launched_.wait_nothrow()) return e;
    if (!gpu_ || gpu_->ev == nullptr) return nullptr;
    try {
      check(cudaEventSynchronize(gpu_->ev), "cudaEventSynchronize", gpu_->dev);
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }
  /// For work enqueued with stream::enqueue_timed, once it completed: the GPU time from the start
  /// of its work to its end (timing events around it on its stream), which is what the work cost
  /// the GPU, not how long its launches took on the host. Empty for other events, or before the
  /// work completed.
  [[nodiscard]] std::optional<std::chrono::nanoseconds> gpu_elapsed() const {
    if (!gpu_ || gpu_->start == nullptr || gpu_->ev == nullptr || !launched_.ready()) return std::nullopt;
    float ms = 0;
    if (cudaEventElapsedTime(&ms, gpu_->start, gpu_->ev) != cudaSuccess) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    return std::chrono::nanoseconds(static_cast<std::int64_t>(static_cast<double>(ms) * 1e6));
  }

 private:
  friend class stream;
  struct gpu_event {
    cudaEvent_t ev = nullptr;     // written by the launch thread before `launched` completes
    cudaEvent_t start = nullptr;  // timed work only: recorded before it
    device dev;
    std::shared_ptr<detail::event_pool> pool;  // ev's (timing events for timed work)
    gpu_event() = default;
    gpu_event(gpu_event const&) = delete;
    gpu_event& operator=(gpu_event const&) = delete;
    ~gpu_event() {
      if (ev != nullptr) pool->give_back(ev);
      if (start != nullptr) pool->give_back(start);
    }
  };
  host::event launched_;
  std::shared_ptr<gpu_event> gpu_;
};

/// The queue of one logical CUDA device.
class stream {
 public:
  /// A stream on logical device `d` (its GPU must exist).
  explicit stream(device d)
      : dev_(d),
        events_(std::make_shared<detail::event_pool>(d, cudaEventDisableTiming)),
        timing_(std::make_shared<detail::event_pool>(d, 0u)) {
    check_device(d);
    device_guard g(d.index);
    (void)own_pool(d.index);  // made before any step (its first use takes a lock)
    check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", d);
    for (auto& b : staging_) b = staging_buffer(d, s_);
    worker_ = std::make_unique<host::stream>(d.index);
  }
  /// A stream on lane 0 of GPU `ordinal`.
  explicit stream(int ordinal) : stream(device{device_kind::cuda, ordinal, 0}) {}
  stream(stream const&) = delete;
  stream& operator=(stream const&) = delete;
  /// Finishes the queued launches and the GPU work, then releases the stream.
  ~stream() {
    worker_.reset();
    device_guard g(dev_.index);
    (void)cudaStreamSynchronize(s_);
    for (auto& b : staging_) b = staging_buffer();  // freed in this stream's order, before it goes
    pinned_ = pinned_buffer<std::byte>();
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
  }

  /// The logical device (GPU ordinal and lane) this stream belongs to.
  [[nodiscard]] device logical_device() const noexcept { return dev_; }
  /// The GPU ordinal of this stream.
  [[nodiscard]] int device_index() const noexcept { return dev_.index; }
  /// The CUDA stream this queue launches on.
  [[nodiscard]] cudaStream_t native() const noexcept { return s_; }

  /// Runs fn() on the launch thread after all earlier work was launched, with this stream current.
  template <class F>
  event enqueue(F&& fn) {
    return enqueue_work(std::forward<F>(fn), false);
  }
  /// enqueue, with timing events recorded around fn's GPU work: the returned event's
  /// gpu_elapsed() says how long the GPU spent on it (auto_balance's measure of a device's speed).
  template <class F>
  event enqueue_timed(F&& fn) {
    return enqueue_work(std::forward<F>(fn), true);
  }

  /// Later work on this stream waits for `e` on the GPU; a launch error carried by `e` becomes this
  /// stream's error. Costs nothing until the next enqueue, whose work makes the wait first.
  void wait(event const& e) {
    if (!e.gpu_ && e.launched_.ready()) return;
    std::lock_guard lock(m_);
    waits_.push_back(e);
  }

  /// Later work on this stream waits, on the GPU, for the work issued so far to the legacy default
  /// stream of its GPU (stream 0, where libtorch and plain CUDA code run unless told otherwise).
  /// This stream is cudaStreamNonBlocking, so nothing else orders the two (CUDA Runtime API,
  /// "stream synchronization behavior"). Like wait(), it costs nothing until the next enqueue,
  /// whose work, on the launch thread, records an event on the legacy stream and waits for it
  /// first (what was issued there by then, which includes what was issued before this call).
  void wait_for_legacy_stream() {
    std::lock_guard lock(m_);
    legacy_wait_ = true;
  }

  /// An event that completes when all work enqueued so far has finished on the GPU.
  event record() {
    return enqueue([] {});
  }

  /// Blocks until every launch and all GPU work of this stream finished, then rethrows (and
  /// clears) the sticky error, or the GPU's fault. The GPU work is waited for even when a launch
  /// failed: memory the caller frees after an error must not be in use by a running kernel.
  /// Ends a hold(): the launch thread launches the held work.
  void synchronize() { finish(false); }

  /// Work enqueued from now on does not wake the launch thread: the caller promises to call
  /// synchronize_here() (which launches it on the calling thread) or synchronize() (which wakes
  /// the launch thread) next, and not to block on that work in between. Other streams may wait
  /// for it meanwhile. parallel<> holds the master's stream during a step, as on the host backend.
  void hold() { worker_->hold(); }

  /// synchronize() that launches the work the launch thread has not started on the calling
  /// thread, in order, with this stream's GPU and stream current while each piece runs (the
  /// calling thread's own current GPU is back afterwards), then waits for the GPU. Ends a hold().
  void synchronize_here() { finish(true); }

  /// Persistent scratch on this stream's GPU (`slot` 0: shards, 1: the reduction's staging), at
  /// least `bytes`; for work running on this stream only (its contents are the stream's until its
  /// later work overwrites them).
  std::byte* staging(std::size_t slot, std::size_t bytes) { return staging_.at(slot).reserve(bytes); }
  /// Persistent page-locked host scratch of at least `bytes`, for work on this stream: host batches
  /// pass through it on their way to the GPU. Growing waits for the stream first (earlier copies
  /// may still read the old buffer; cudaFreeHost would also wait for the device).
  std::byte* pinned_staging(std::size_t bytes) {
    if (bytes > pinned_.size()) {
      check(cudaStreamSynchronize(s_), "cudaStreamSynchronize", dev_);
      pinned_ = pinned_buffer<std::byte>();
      pinned_ = pinned_buffer<std::byte>(bytes);
    }
    return pinned_.data();
  }

 private:
  template <class F>
  event enqueue_work(F&& fn, bool timed) {
    event done;
    done.gpu_ = std::make_shared<event::gpu_event>();
    done.gpu_->dev = dev_;
    done.gpu_->pool = timed ? timing_ : events_;
    std::lock_guard lock(m_);  // the waits folded into this work are the ones asked for before it
    done.launched_ = worker_->enqueue(
        [this, gpu = done.gpu_, timed, legacy = std::exchange(legacy_wait_, false), waits = std::exchange(waits_, {}),
         fn = std::forward<F>(fn)]() mutable {
          scope current(*this);
          if (legacy) wait_for_legacy_now();
          for (event const& e : waits) {
            e.launched_.wait();  // its cudaEvent_t exists once its work was launched
            // The event may belong to another GPU (CUDA Runtime API, cudaStreamWaitEvent: "event
            // may be from a different device than stream").
            if (e.gpu_ && e.gpu_->ev != nullptr)
              check(cudaStreamWaitEvent(s_, e.gpu_->ev, 0), "cudaStreamWaitEvent", dev_);
          }
          if (timed) {
            gpu->start = timing_->take();
            check(cudaEventRecord(gpu->start, s_), "cudaEventRecord", dev_);
          }
          fn();
          check(cudaGetLastError(), "a kernel launch", dev_);
          // fn may have left another GPU current; the event must be made and recorded on this
          // stream's GPU (CUDA Runtime API, cudaEventRecord: event and stream on one device).
          check(cudaSetDevice(dev_.index), "cudaSetDevice", dev_);
          gpu->ev = gpu->pool->take();
          check(cudaEventRecord(gpu->ev, s_), "cudaEventRecord", dev_);
        });
    return done;
  }

  // wait_for_legacy_stream()'s wait, made on the launch thread with this stream's GPU current. The
  // wait holds on the GPU from then on, so the event goes back to the pool at once.
  void wait_for_legacy_now() {
    cudaEvent_t const ev = events_->take();
    cudaError_t const recorded = cudaEventRecord(ev, cudaStreamLegacy);
    cudaError_t const waited = recorded == cudaSuccess ? cudaStreamWaitEvent(s_, ev, 0) : recorded;
    events_->give_back(ev);
    check(waited, recorded == cudaSuccess ? "cudaStreamWaitEvent" : "cudaEventRecord", dev_);
  }

  // Launches (here, or on the launch thread) and waits for everything enqueued; see synchronize().
  void finish(bool here) {
    {
      std::unique_lock lock(m_);
      // Waits not yet folded into work: make them, so their errors surface here.
      if (!waits_.empty() || legacy_wait_) {
        lock.unlock();
        (void)record();
      }
    }
    std::exception_ptr failed;
    try {
      if (here) worker_->synchronize_here();
      else worker_->synchronize();
    } catch (...) {
      failed = std::current_exception();
    }
    device_guard g(dev_.index);
    cudaError_t const e = cudaStreamSynchronize(s_);
    if (failed) {
      (void)cudaGetLastError();
      std::rethrow_exception(failed);
    }
    check(e, "cudaStreamSynchronize", dev_);
  }

  // Sets the calling thread's current device and stream for the work it runs, and gives the
  // thread its own current device back afterwards: the work may run on the caller's thread
  // (synchronize_here), whose current GPU is the user's, not only on the launch thread.
  struct scope {
    device_guard on;
    detail::current_scope current;
    explicit scope(stream const& s) : on(s.dev_.index), current(detail::current_state{s.s_, s.dev_, true}) {}
  };

  device dev_;
  cudaStream_t s_ = nullptr;
  std::shared_ptr<detail::event_pool> events_, timing_;
  std::mutex m_;
  std::vector<event> waits_;  // asked for since the last enqueue
  bool legacy_wait_ = false;  // wait_for_legacy_stream() asked for since the last enqueue
  std::array<staging_buffer, 2> staging_;
  pinned_buffer<std::byte> pinned_;
  std::unique_ptr<host::stream> worker_;
};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

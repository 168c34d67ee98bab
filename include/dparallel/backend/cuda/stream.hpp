#pragma once
// CUDA streams and events for the policies: the same contract as host::stream (ordered work,
// cross-stream waits, sticky errors reported at synchronize) over a real cudaStream_t.
//
// A cuda::stream is a launch thread plus a CUDA stream. enqueue(fn) runs fn on the launch thread
// with the stream's GPU current and cuda::current_stream() set, so whatever fn launches goes to
// this stream in order; the returned event is recorded on the GPU right after fn's launches.
// wait(e) orders this stream's later GPU work after e with cudaStreamWaitEvent: no host
// synchronisation between devices inside a step. Host-side exceptions and launch errors become the
// stream's sticky error (device_error naming the logical device) until synchronize() reports them;
// GPU-side faults are reported by synchronize() and by event::wait().

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/host/stream.hpp>
#include <dparallel/core/device.hpp>

#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

class stream;

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

 private:
  friend class stream;
  struct gpu_event {
    cudaEvent_t ev = nullptr;  // written by the launch thread before `launched` completes
    device dev;
    gpu_event() = default;
    gpu_event(gpu_event const&) = delete;
    gpu_event& operator=(gpu_event const&) = delete;
    ~gpu_event() {
      if (ev != nullptr) (void)cudaEventDestroy(ev);
    }
  };
  host::event launched_;
  std::shared_ptr<gpu_event> gpu_;
};

/// The queue of one logical CUDA device.
class stream {
 public:
  /// A stream on logical device `d` (its GPU must exist).
  explicit stream(device d) : dev_(d) {
    check_device(d);
    device_guard g(d.index);
    check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", d);
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
    event done;
    done.gpu_ = std::make_shared<event::gpu_event>();
    done.gpu_->dev = dev_;
    done.launched_ = worker_->enqueue([this, gpu = done.gpu_, fn = std::forward<F>(fn)]() mutable {
      scope current(*this);
      fn();
      check(cudaGetLastError(), "a kernel launch", dev_);
      check(cudaEventCreateWithFlags(&gpu->ev, cudaEventDisableTiming), "cudaEventCreateWithFlags", dev_);
      check(cudaEventRecord(gpu->ev, s_), "cudaEventRecord", dev_);
    });
    return done;
  }

  /// Later work on this stream waits for `e` on the GPU; a launch error carried by `e` becomes this
  /// stream's error.
  void wait(event const& e) {
    if (!e.gpu_ && e.launched_.ready()) return;
    enqueue([e, this] {
      e.launched_.wait();
      if (e.gpu_ && e.gpu_->ev != nullptr) check(cudaStreamWaitEvent(s_, e.gpu_->ev, 0), "cudaStreamWaitEvent", dev_);
    });
  }

  /// An event that completes when all work enqueued so far has finished on the GPU.
  event record() {
    return enqueue([] {});
  }

  /// Blocks until every launch and all GPU work of this stream finished; rethrows (and clears) the
  /// sticky error, or the GPU's fault.
  void synchronize() {
    worker_->synchronize();
    device_guard g(dev_.index);
    check(cudaStreamSynchronize(s_), "cudaStreamSynchronize", dev_);
  }

 private:
  // Sets the calling thread's current device and stream for the work it runs.
  struct scope {
    detail::current_state saved;
    explicit scope(stream const& s) : saved(detail::current()) {
      check(cudaSetDevice(s.dev_.index), "cudaSetDevice", s.dev_);
      detail::current() = detail::current_state{s.s_, s.dev_, true};
    }
    scope(scope const&) = delete;
    scope& operator=(scope const&) = delete;
    ~scope() { detail::current() = saved; }
  };

  device dev_;
  cudaStream_t s_ = nullptr;
  std::unique_ptr<host::stream> worker_;
};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

#pragma once
// What one NCCL communicator allocates once and reuses (see <dparallel/comm/nccl.hpp>): its
// completion events (a pool, not one cudaEventCreate/Destroy per collective), its host staging
// blocks (pinned + device memory, allocated the first time a size is needed and kept until the
// communicator is destroyed: cudaMallocHost and cudaFreeHost synchronise, so neither may run per
// collective, and a free must never wait behind a stuck NCCL kernel), and how a collective is
// ordered after the GPU work of the thread that issued it (issue_order).

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/stream.hpp>
#include <dparallel/comm/detail/issue_order.hpp>
#include <dparallel/core/device.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace nccl::detail {

/// Reusable completion events of one GPU: the CUDA stream's pool, made with
/// cudaEventDisableTiming (only ordering is needed). Recording a pooled event again is fine:
/// cudaEventRecord overwrites the work it captures, and earlier waits keep what they captured.
using event_pool = cuda::detail::event_pool;

/// Host staging blocks of one communicator: each a pinned host buffer and a device buffer of the
/// same size. A collective leases one block for its lifetime; blocks are never freed before the
/// communicator (the destructor frees them after its stream finished or was aborted).
class staging_pool {
 public:
  struct block {
    std::byte* pinned = nullptr;
    std::byte* dev = nullptr;
    std::size_t bytes = 0;
    bool free = true;
  };

  explicit staging_pool(device d) : dev_(d) {}
  staging_pool(staging_pool const&) = delete;
  staging_pool& operator=(staging_pool const&) = delete;
  ~staging_pool() {
    for (auto const& b : all_) {
      (void)cudaFreeHost(b.pinned);
      (void)cudaFree(b.dev);
    }
  }

  /// A block of at least `bytes` (the smallest free one that fits, else a new one of at least 64
  /// KiB); the caller has dev_'s GPU current.
  block* lease(std::size_t bytes) {
    std::lock_guard lock(m_);
    block* best = nullptr;
    for (auto& b : all_)
      if (b.free && b.bytes >= bytes && (best == nullptr || b.bytes < best->bytes)) best = &b;
    if (best == nullptr) {
      block b;
      b.bytes = std::max<std::size_t>(bytes, std::size_t{64} << 10);
      void* h = nullptr;
      cuda::check(cudaMallocHost(&h, b.bytes), "cudaMallocHost (NCCL host staging)", dev_);
      void* d = nullptr;
      cudaError_t const e = cudaMalloc(&d, b.bytes);
      if (e != cudaSuccess) {
        (void)cudaFreeHost(h);
        cuda::check(e, "cudaMalloc (NCCL host staging)", dev_);
      }
      b.pinned = static_cast<std::byte*>(h);
      b.dev = static_cast<std::byte*>(d);
      all_.push_back(b);  // a deque: the blocks already leased keep their addresses
      best = &all_.back();
    }
    best->free = false;
    return best;
  }
  /// Returns a leased block (only once its collective finished, or after the communicator was
  /// aborted: see nccl.hpp).
  void give(block* b) noexcept {
    if (b == nullptr) return;
    std::lock_guard lock(m_);
    b->free = true;
  }

 private:
  device dev_;
  std::mutex m_;
  std::deque<block> all_;
};

/// An event recorded on the issuing thread's stream (issue_order's token for CUDA).
struct issued_event {
  cudaEvent_t ev = nullptr;
  issued_event() = default;
  issued_event(issued_event const&) = delete;
  issued_event& operator=(issued_event const&) = delete;
  ~issued_event() {
    if (ev != nullptr) (void)cudaEventDestroy(ev);
  }
};

/// The CUDA capture for dparallel::detail::issue_order: inside work running on a dparallel CUDA
/// stream, an event recorded on that stream (cuda::current_stream()); elsewhere null (the engine
/// then orders after the legacy default stream itself, see nccl.hpp).
inline std::shared_ptr<void> capture_cuda_issue() {
  auto const& cur = cuda::detail::current();
  if (!cur.set) return nullptr;
  auto t = std::make_shared<issued_event>();
  cuda::device_guard g(cur.dev.index);  // an event is recorded on a stream of its own device
  cuda::check(cudaEventCreateWithFlags(&t->ev, cudaEventDisableTiming), "cudaEventCreateWithFlags", cur.dev);
  cuda::check(cudaEventRecord(t->ev, cur.stream), "cudaEventRecord", cur.dev);
  return t;
}

/// Registers capture_cuda_issue with issue_order once per program (any TU including nccl.hpp).
inline bool const cuda_issue_capture_registered = [] {
  dparallel::detail::issue_order::install(&capture_cuda_issue);
  return true;
}();

}  // namespace nccl::detail
DPARALLEL_NAMESPACE_END

#pragma once
// A Stage for dparallel::loader (data/loader.hpp) that puts each batch on a GPU before the training
// loop asks for it: on the worker thread that made the batch, its elements are copied into that
// worker's page-locked (pinned) staging buffer, then to device memory with an asynchronous copy on
// the worker's own copy stream. The worker waits for its copy (the training loop does not), so a
// batch handed out is already on the GPU.
//
//   dparallel::loader batches(sampler, 128, make_host_batch, {.num_workers = 2},
//                             dparallel::cuda::to_device{dparallel::device{dparallel::device_kind::cuda, 0}});
//   for (auto& b : batches) dp.step(b.view(), step_fn);   // b: cuda::device_batch<float>
//
// The batch type make returns is a contiguous range of trivially copyable elements (std::vector<T>,
// std::array, a buffer) plus, optionally, its number of samples through `rows` (see device_batch).

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/memory.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

/// One batch in GPU memory, made by to_device: `rows` samples of size()/rows elements each.
template <class T>
struct device_batch {
  /// The batch's elements in device memory.
  device_buffer<T> data;
  /// Number of samples (the batch dimension).
  std::size_t rows = 0;
  /// The batch as a view on its GPU, with its samples as rows (what DataParallel slices).
  [[nodiscard]] tensor_view<T const> view() const {
    return tensor_view<T const>(data.data(), data.size(), rows, data.where());
  }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return data.size(); }
};

/// The Stage: copies a host batch to GPU `dev` through pinned memory, on the worker's copy stream.
/// `rows_of(batch)` gives the number of samples (default: one element per sample).
struct to_device {
  /// The GPU (or lane) the batches are copied to.
  device dev{device_kind::cuda, 0, 0};

  /// Copies a host batch to `dev` (run by the loader's workers).
  template <class C>
  auto operator()(C&& host) const {
    using T = std::remove_cv_t<std::remove_reference_t<decltype(*std::data(host))>>;
    static_assert(std::is_trivially_copyable_v<T>, "cuda::to_device: the batch's elements must be trivially copyable");
    std::size_t const n = std::size(host);
    std::size_t rows = n;
    if constexpr (requires { host.rows(); }) rows = host.rows();
    worker& w = this_worker();
    device_guard g(dev.index);
    if (w.stream == nullptr || w.ordinal != dev.index) w.open(dev);
    if (w.staging.size() < n * sizeof(T)) w.staging = pinned_buffer<std::byte>(n * sizeof(T));
    if (n != 0) std::memcpy(w.staging.data(), std::data(host), n * sizeof(T));
    // Allocated on the copy's own stream and left uninitialised (the copy writes all of it): an
    // allocation or memset on the legacy stream would not be ordered before a copy on this
    // non-blocking stream (CUDA Runtime API, "Stream synchronization behavior").
    device_batch<T> out{device_buffer<T>(n, dev, w.stream, uninitialized), rows};
    if (n != 0) {
      check(cudaMemcpyAsync(out.data.data(), w.staging.data(), n * sizeof(T), cudaMemcpyHostToDevice, w.stream),
            "cudaMemcpyAsync", dev);
    }
    // The staging buffer is reused for this worker's next batch, and the batch must be complete
    // when it is handed out: wait here, on the worker.
    check(cudaStreamSynchronize(w.stream), "cudaStreamSynchronize", dev);
    // The copy stream is the worker's (thread_local) and is destroyed when the worker thread ends,
    // which can be before the training loop frees this batch: the batch is freed on the legacy
    // default stream instead, which lives as long as the GPU's context. Its allocation is complete.
    out.data.free_on(nullptr);
    return out;
  }

 private:
  struct worker {
    cudaStream_t stream = nullptr;
    int ordinal = -1;
    pinned_buffer<std::byte> staging;
    void open(device d) {
      close();
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", d);
      ordinal = d.index;
    }
    void close() noexcept {
      if (stream != nullptr) (void)cudaStreamDestroy(stream);
      stream = nullptr;
    }
    worker() = default;
    worker(worker const&) = delete;
    worker& operator=(worker const&) = delete;
    ~worker() { close(); }
  };
  static worker& this_worker() {
    thread_local worker w;
    return w;
  }
};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

#pragma once
// Owning CUDA memory: device buffers (stream-ordered allocation) and pinned host buffers.

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

/// `size()` elements of T in the memory of one GPU, allocated and freed in the order of a stream
/// (cudaMallocAsync / cudaFreeAsync), zero-initialised. Move-only.
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "cuda::device_buffer<T>: T must be trivially copyable");

 public:
  device_buffer() = default;
  /// Allocates on `d`'s GPU in the order of `s` (nullptr: the legacy default stream).
  device_buffer(std::size_t size, device d, cudaStream_t s = nullptr) : size_(size), dev_(d), stream_(s) {
    if (size_ == 0) return;
    device_guard g(d.index);
    void* p = nullptr;
    check(cudaMallocAsync(&p, size_ * sizeof(T), s), "cudaMallocAsync", d);
    data_ = static_cast<T*>(p);
    check(cudaMemsetAsync(data_, 0, size_ * sizeof(T), s), "cudaMemsetAsync", d);
  }
  /// Takes over `o`'s memory; `o` becomes empty.
  device_buffer(device_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), dev_(o.dev_), stream_(o.stream_) {}
  /// Frees this buffer's memory (stream-ordered) and takes over `o`'s.
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      dev_ = o.dev_;
      stream_ = o.stream_;
    }
    return *this;
  }
  device_buffer(device_buffer const&) = delete;
  device_buffer& operator=(device_buffer const&) = delete;
  ~device_buffer() { release(); }

  /// Device pointer to the first element.
  [[nodiscard]] T* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The device the memory lives on.
  [[nodiscard]] device where() const noexcept { return dev_; }
  /// A view tagged with the buffer's device (`rows` samples when given).
  [[nodiscard]] tensor_view<T> view() const noexcept { return tensor_view<T>(data_, size_, dev_); }
  /// A view of the whole buffer holding `rows` samples.
  [[nodiscard]] tensor_view<T> view(std::size_t rows) const { return tensor_view<T>(data_, size_, rows, dev_); }

 private:
  void release() noexcept {
    if (data_ == nullptr) return;
    int previous = 0;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(dev_.index);
    (void)cudaFreeAsync(data_, stream_);
    (void)cudaSetDevice(previous);
    data_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
  device dev_{device_kind::cuda, 0, 0};
  cudaStream_t stream_ = nullptr;
};

/// `size()` elements of T in page-locked host memory (cudaMallocHost): the staging memory from
/// which copies to a GPU run asynchronously. Views of it are host views. Move-only.
template <class T>
class pinned_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "cuda::pinned_buffer<T>: T must be trivially copyable");

 public:
  pinned_buffer() = default;
  /// Allocates `size` elements of page-locked host memory.
  explicit pinned_buffer(std::size_t size) : size_(size) {
    if (size_ == 0) return;
    void* p = nullptr;
    check(cudaMallocHost(&p, size_ * sizeof(T)), "cudaMallocHost");
    data_.reset(static_cast<T*>(p));
  }
  /// Host pointer to the first element.
  [[nodiscard]] T* data() const noexcept { return data_.get(); }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// A view of the whole buffer (host memory, one element per row).
  [[nodiscard]] tensor_view<T> view() const noexcept { return tensor_view<T>(data_.get(), size_); }

 private:
  struct deleter {
    void operator()(T* p) const noexcept { (void)cudaFreeHost(p); }
  };
  std::unique_ptr<T, deleter> data_;
  std::size_t size_ = 0;
};

/// `bytes` zeroed bytes on `d`'s GPU, shared ownership (freed with cudaFree when the last owner
/// goes): the storage of DDP's buckets.
inline std::shared_ptr<std::byte> allocate(device d, std::size_t bytes) {
  device_guard g(d.index);
  void* p = nullptr;
  if (bytes != 0) {
    check(cudaMalloc(&p, bytes), "cudaMalloc", d);
    cudaError_t const e = cudaMemset(p, 0, bytes);
    if (e != cudaSuccess) {
      (void)cudaFree(p);
      check(e, "cudaMemset", d);
    }
  }
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) {
    if (q != nullptr) (void)cudaFree(q);
  });
}

}  // namespace cuda
DPARALLEL_NAMESPACE_END

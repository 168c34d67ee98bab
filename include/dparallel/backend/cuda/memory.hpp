#pragma once
// Owning CUDA memory: device buffers (stream-ordered allocation) and pinned host buffers.

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

/// Tag for device_buffer's constructor that leaves the memory uninitialised (the next write
/// covers all of it, so a memset would be wasted work).
struct uninitialized_t {
  explicit uninitialized_t() = default;
};
/// The tag value: `device_buffer<float>(n, d, s, cuda::uninitialized)`.
inline constexpr uninitialized_t uninitialized{};

/// `size()` elements of T in the memory of one GPU, allocated and freed in the order of a stream
/// (cudaMallocFromPoolAsync from dparallel's own pool, own_pool, / cudaFreeAsync),
/// zero-initialised unless made with `uninitialized`.
/// Move-only.
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "cuda::device_buffer<T>: T must be trivially copyable");

 public:
  device_buffer() = default;
  /// Allocates and zeroes on `d`'s GPU in the order of `s` (nullptr: the legacy default stream).
  /// Work on another stream may use the buffer only once it is ordered after `s`.
  device_buffer(std::size_t size, device d, cudaStream_t s = nullptr) : device_buffer(size, d, s, uninitialized) {
    if (size_ != 0) {
      device_guard g(d.index);
      check(cudaMemsetAsync(data_, 0, size_ * sizeof(T), s), "cudaMemsetAsync", d);
    }
  }
  /// Allocates on `d`'s GPU in the order of `s`, leaving the memory uninitialised.
  device_buffer(std::size_t size, device d, cudaStream_t s, uninitialized_t) : size_(size), dev_(d), stream_(s) {
    if (size_ == 0) return;
    device_guard g(d.index);
    void* p = nullptr;
    if (cudaMemPool_t const pool = own_pool(d.index))
      check(cudaMallocFromPoolAsync(&p, size_ * sizeof(T), pool, s), "cudaMallocFromPoolAsync", d);
    else
      check(cudaMallocAsync(&p, size_ * sizeof(T), s), "cudaMallocAsync", d);
    data_ = static_cast<T*>(p);
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
  /// Frees the memory, when the buffer goes, in the order of `s` rather than of the stream it was
  /// allocated on: for a buffer that outlives that stream (cudaFreeAsync on a destroyed stream is
  /// undefined). The caller orders `s` after the allocation and after the work that uses the buffer.
  void free_on(cudaStream_t s) noexcept { stream_ = s; }

 private:
  void release() noexcept {
    if (data_ == nullptr) return;
    try {
      device_guard g(dev_.index);
      (void)cudaFreeAsync(data_, stream_);
    } catch (...) {  // the driver is gone (process exit): nothing left to free
    }
    (void)cudaGetLastError();
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
/// goes): the storage of DDP's buckets and accumulation buffers. The memory is zeroed on
/// `consumer`, the stream that will use it; when that is the legacy stream (nullptr: the caller
/// runs outside any cuda::stream work), the zeroing is waited for here, because work on a
/// non-blocking stream is not ordered after the legacy stream (CUDA Runtime API, "Stream
/// synchronization behavior": cudaStreamNonBlocking streams do not synchronise with stream 0).
/// cudaMalloc, unlike cudaMallocAsync, is not stream-ordered: the memory is usable at once.
inline std::shared_ptr<std::byte> allocate(device d, std::size_t bytes, cudaStream_t consumer) {
  device_guard g(d.index);
  void* p = nullptr;
  if (bytes != 0) {
    check(cudaMalloc(&p, bytes), "cudaMalloc", d);
    cudaError_t e = cudaMemsetAsync(p, 0, bytes, consumer);
    if (e == cudaSuccess && consumer == nullptr) e = cudaStreamSynchronize(nullptr);
    if (e != cudaSuccess) {
      (void)cudaFree(p);
      check(e, "cudaMemsetAsync", d);
    }
  }
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) {
    if (q != nullptr) (void)cudaFree(q);
  });
}

/// Grow-only scratch memory on one GPU, owned by one stream and used only by work on it: a
/// persistent staging buffer (shards, peers' gradient slices). reserve() reallocates in the
/// stream's order (cudaFreeAsync then cudaMallocAsync on the same stream), so earlier work on
/// that stream still reading the old memory finishes first.
class staging_buffer {
 public:
  staging_buffer() = default;
  /// The scratch of stream `s` on `d`'s GPU.
  staging_buffer(device d, cudaStream_t s) : dev_(d), stream_(s) {}
  /// At least `bytes` bytes (contents not kept across growth); call from work on the stream.
  std::byte* reserve(std::size_t bytes) {
    if (bytes > buf_.size()) {
      buf_ = device_buffer<std::byte>();  // freed in the stream's order first
      buf_ = device_buffer<std::byte>(bytes, dev_, stream_, uninitialized);
    }
    return buf_.data();
  }

 private:
  device dev_{device_kind::cuda, 0, 0};
  cudaStream_t stream_ = nullptr;
  device_buffer<std::byte> buf_;
};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

#pragma once
// The staging buffer of a load (io/state_dict.hpp): every tensor is read into it before any is
// copied into the model, so that a failed load changes nothing. On Linux it is an anonymous
// mapping advised to use transparent huge pages: a buffer the size of a model is fresh memory on
// every load, and faulting it in 2 MiB pages instead of 4 KiB ones is several times cheaper
// (benchmarks/io_costs.cpp measures the load).

#include <dparallel/config.hpp>

#include <cstddef>
#include <memory>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

DPARALLEL_NAMESPACE_BEGIN

namespace detail {

/// `size` bytes of uninitialised host memory; throws std::bad_alloc when there is none.
class staging_buffer {
 public:
  explicit staging_buffer(std::size_t size) : size_(size) {
    if (size == 0) return;
#if defined(__linux__)
    if (size >= (std::size_t{2} << 20)) {
      void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
      (void)::madvise(p, size, MADV_HUGEPAGE);  // advice only: without huge pages it still works
#endif
      data_ = static_cast<std::byte*>(p);
      mapped_ = true;
      return;
    }
#endif
    owned_ = std::make_unique_for_overwrite<std::byte[]>(size);
    data_ = owned_.get();
  }
  staging_buffer(staging_buffer const&) = delete;
  staging_buffer& operator=(staging_buffer const&) = delete;
  ~staging_buffer() {
#if defined(__linux__)
    if (mapped_) ::munmap(data_, size_);
#endif
  }
  [[nodiscard]] std::byte* data() const noexcept { return data_; }

 private:
  std::size_t size_ = 0;
  std::byte* data_ = nullptr;
  std::unique_ptr<std::byte[]> owned_;
  bool mapped_ = false;
};

}  // namespace detail

DPARALLEL_NAMESPACE_END

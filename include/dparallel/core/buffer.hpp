#pragma once
// buffer<T>: an owning, fixed-size allocation of host memory. Device buffers are provided by
// the backends that have device memory (backend/cuda).

#include <dparallel/config.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>

DPARALLEL_NAMESPACE_BEGIN

/// An owning array of `size()` value-initialised elements of T in host memory, aligned to 64 bytes
/// (one cache line) so vectorised kernels and false-sharing-free slices need no special cases.
template <class T>
class buffer {
  static_assert(std::is_trivially_destructible_v<T>, "dparallel::buffer<T>: T must be trivially destructible");

 public:
  static constexpr std::size_t alignment = 64;

  buffer() = default;
  explicit buffer(std::size_t size, std::size_t rows = npos) : size_(size), rows_(rows == npos ? size : rows) {
    if (size_ != 0) {
      data_.reset(static_cast<T*>(::operator new[](size_ * sizeof(T), std::align_val_t{alignment})));
      std::uninitialized_value_construct_n(data_.get(), size_);
    }
    (void)tensor_view<T>(data_.get(), size_, rows_);  // validates rows
  }
  buffer(buffer&&) noexcept = default;
  buffer& operator=(buffer&&) noexcept = default;
  buffer(buffer const& o) : buffer(o.size_, o.rows_) { std::copy_n(o.data(), size_, data()); }
  buffer& operator=(buffer const& o) {
    if (this != &o) *this = buffer(o);
    return *this;
  }
  ~buffer() = default;

  [[nodiscard]] T* data() noexcept { return data_.get(); }
  [[nodiscard]] T const* data() const noexcept { return data_.get(); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  T& operator[](std::size_t i) noexcept { return data_.get()[i]; }
  T const& operator[](std::size_t i) const noexcept { return data_.get()[i]; }
  T* begin() noexcept { return data(); }
  T* end() noexcept { return data() + size_; }
  T const* begin() const noexcept { return data(); }
  T const* end() const noexcept { return data() + size_; }

  [[nodiscard]] tensor_view<T> view() noexcept { return {data(), size_, rows_}; }
  [[nodiscard]] tensor_view<T const> view() const noexcept { return {data(), size_, rows_}; }

 private:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  struct deleter {
    void operator()(T* p) const noexcept { ::operator delete[](p, std::align_val_t{alignment}); }
  };
  std::unique_ptr<T, deleter> data_;
  std::size_t size_ = 0;
  std::size_t rows_ = 0;
};

DPARALLEL_NAMESPACE_END

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
  /// Byte alignment of the allocation.
  static constexpr std::size_t alignment = 64;

  buffer() = default;
  /// Allocates `size` zeroed elements holding `rows` samples (default: one element per row).
  explicit buffer(std::size_t size, std::size_t rows = npos) : size_(size), rows_(rows == npos ? size : rows) {
    if (size_ != 0) {
      data_.reset(static_cast<T*>(::operator new[](size_ * sizeof(T), std::align_val_t{alignment})));
      std::uninitialized_value_construct_n(data_.get(), size_);
    }
    (void)tensor_view<T>(data_.get(), size_, rows_);  // validates rows
  }
  /// Takes over the other buffer's memory.
  buffer(buffer&&) noexcept = default;
  /// Takes over the other buffer's memory.
  buffer& operator=(buffer&&) noexcept = default;
  /// Copies the elements and the row count.
  buffer(buffer const& o) : buffer(o.size_, o.rows_) { std::copy_n(o.data(), size_, data()); }
  /// Copies the elements and the row count.
  buffer& operator=(buffer const& o) {
    if (this != &o) *this = buffer(o);
    return *this;
  }
  ~buffer() = default;

  /// Pointer to the first element.
  [[nodiscard]] T* data() noexcept { return data_.get(); }
  /// Pointer to the first element.
  [[nodiscard]] T const* data() const noexcept { return data_.get(); }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Number of samples (the batch dimension).
  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  /// True when the buffer holds no element.
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// Element `i`.
  T& operator[](std::size_t i) noexcept { return data_.get()[i]; }
  /// Element `i`.
  T const& operator[](std::size_t i) const noexcept { return data_.get()[i]; }
  /// Iterator to the first element.
  T* begin() noexcept { return data(); }
  /// Iterator past the last element.
  T* end() noexcept { return data() + size_; }
  /// Iterator to the first element.
  T const* begin() const noexcept { return data(); }
  /// Iterator past the last element.
  T const* end() const noexcept { return data() + size_; }

  /// A view of the whole buffer, rows included.
  [[nodiscard]] tensor_view<T> view() noexcept { return {data(), size_, rows_}; }
  /// A read-only view of the whole buffer, rows included.
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

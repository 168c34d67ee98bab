#pragma once
// Non-owning views of device memory: tensor_view<T> (typed) and tensor_ref (dtype at runtime).

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// A non-owning view of `size()` elements of T on `device()`. The first dimension (`rows()`) is
/// the batch dimension: a view of a [64, 784] image batch has size 64*784 and rows 64, and
/// slicing by rows keeps whole samples together. A view made without rows has one element per row.
template <class T>
class tensor_view {
 public:
  /// The element type, const included.
  using element_type = T;
  /// The element type without const.
  using value_type = std::remove_cv_t<T>;

  constexpr tensor_view() noexcept = default;
  /// A view of `size` elements at `data` on `dev`, one element per row.
  constexpr tensor_view(T* data, std::size_t size, device dev = host_memory) noexcept
      : data_(data), size_(size), rows_(size), device_(dev) {}
  /// A view with an explicit batch dimension; `size` must be a multiple of `rows`.
  tensor_view(T* data, std::size_t size, std::size_t rows, device dev = host_memory)
      : data_(data), size_(size), rows_(rows), device_(dev) {
    detail::require(rows == 0 ? size == 0 : size % rows == 0,
                    "tensor_view: expected the element count to be a multiple of the rows, found " +
                        std::to_string(size) + " elements and " + std::to_string(rows) + " rows");
  }
  /// Views convert from non-const to const element type.
  template <class U>
    requires(std::is_same_v<T, U const>)
  constexpr tensor_view(tensor_view<U> other) noexcept
      : data_(other.data()), size_(other.size()), rows_(other.rows()), device_(other.device()) {}

  /// Pointer to the first element (device memory for a device view).
  [[nodiscard]] constexpr T* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
  /// Number of bytes.
  [[nodiscard]] constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  /// True when the view has no element.
  [[nodiscard]] constexpr bool empty() const noexcept { return size_ == 0; }
  /// Number of samples (the batch dimension).
  [[nodiscard]] constexpr std::size_t rows() const noexcept { return rows_; }
  /// Elements per row (per sample); 0 for an empty view.
  [[nodiscard]] constexpr std::size_t row_size() const noexcept { return rows_ == 0 ? 0 : size_ / rows_; }
  /// The device the memory lives on.
  [[nodiscard]] constexpr dparallel::device device() const noexcept { return device_; }
  /// The dtype of the elements.
  [[nodiscard]] static constexpr dparallel::dtype dtype() noexcept { return dtype_v<value_type>; }

  /// Host access; meaningful only for views of host memory.
  constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  /// Host iteration: the first element.
  constexpr T* begin() const noexcept { return data_; }
  /// Host iteration: past the last element.
  constexpr T* end() const noexcept { return data_ + size_; }

  /// Rows [first, last) as a view on the same device.
  [[nodiscard]] tensor_view slice_rows(std::size_t first, std::size_t last) const {
    detail::require(first <= last && last <= rows_,
                    "tensor_view::slice_rows: expected 0 <= first <= last <= " + std::to_string(rows_) +
                        ", found [" + std::to_string(first) + ", " + std::to_string(last) + ")");
    std::size_t const rs = row_size();
    tensor_view v;
    v.data_ = data_ + first * rs;
    v.size_ = (last - first) * rs;
    v.rows_ = last - first;
    v.device_ = device_;
    return v;
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t rows_ = 0;
  dparallel::device device_ = host_memory;
};

/// A view of a contiguous host container (std::vector, std::array, ...), one element per row.
template <class C>
  requires requires(C& c) {
    std::data(c);
    std::size(c);
  }
auto view(C& c) noexcept {
  using T = std::remove_reference_t<decltype(*std::data(c))>;
  return tensor_view<T>(std::data(c), std::size(c));
}
/// A view of a host container holding `rows` samples.
template <class C>
auto view(C& c, std::size_t rows) {
  using T = std::remove_reference_t<decltype(*std::data(c))>;
  return tensor_view<T>(std::data(c), std::size(c), rows);
}

/// The dtype-erased form of a view: what dparallel's policies and communicators move around.
/// Every tensor_view converts to it implicitly, so a model may describe parameters of several
/// element types as a range of tensor_ref.
class tensor_ref {
 public:
  constexpr tensor_ref() noexcept = default;
  /// A view of `size` elements of dtype `t` at `data` on `dev`.
  constexpr tensor_ref(void* data, std::size_t size, dparallel::dtype t, device dev = host_memory) noexcept
      : data_(data), size_(size), dtype_(t), device_(dev) {}
  /// The dtype-erased form of a view of mutable elements.
  template <class T>
    requires(!std::is_const_v<T> && element<T>)
  constexpr tensor_ref(tensor_view<T> v) noexcept  // NOLINT(google-explicit-constructor)
      : data_(v.data()), size_(v.size()), dtype_(dtype_v<T>), device_(v.device()) {}

  /// Pointer to the first element.
  [[nodiscard]] constexpr void* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
  /// Number of bytes.
  [[nodiscard]] constexpr std::size_t size_bytes() const noexcept { return size_ * size_of(dtype_); }
  /// The dtype of the elements.
  [[nodiscard]] constexpr dparallel::dtype dtype() const noexcept { return dtype_; }
  /// The device the memory lives on.
  [[nodiscard]] constexpr dparallel::device device() const noexcept { return device_; }

  /// The typed view; throws invalid_argument when T is not this view's dtype.
  template <element T>
  [[nodiscard]] tensor_view<T> as() const {
    detail::require(dtype_v<T> == dtype_, [&] {  // the text only on failure: this runs every step
      return "tensor_ref::as: expected dtype " + std::string(name_of(dtype_)) + ", asked for " +
             std::string(name_of(dtype_v<T>));
    });
    return tensor_view<T>(static_cast<T*>(data_), size_, device_);
  }
  /// Elements [first, first + count) as a view of the same dtype and device.
  [[nodiscard]] tensor_ref subview(std::size_t first, std::size_t count) const noexcept {
    return {static_cast<char*>(data_) + first * size_of(dtype_), count, dtype_, device_};
  }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
  dparallel::dtype dtype_ = dparallel::dtype::f32;
  dparallel::device device_ = host_memory;
};

DPARALLEL_NAMESPACE_END

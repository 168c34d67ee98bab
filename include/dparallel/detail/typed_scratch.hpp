#pragma once
// Helpers of parallel<>: the storage-overlap test of its replica checks, and the per-step scratch
// whose type depends on the step function's output.

#include <dparallel/config.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <memory>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {
inline bool overlaps(tensor_ref a, tensor_ref b) {
  auto const* a0 = static_cast<char const*>(a.data());
  auto const* b0 = static_cast<char const*>(b.data());
  return a.size() != 0 && b.size() != 0 && a0 < b0 + b.size_bytes() && b0 < a0 + a.size_bytes();
}

/// Scratch whose type is known only inside one instantiation of step() (it depends on the step
/// function's output type), kept across steps: get<T>() makes a T the first time and whenever the
/// previous call asked for another type, and otherwise returns the same T, capacity and all.
class typed_scratch {
 public:
  template <class T>
  T& get() {
    if (tag_ != &tag_of<T>) {
      holder_ = std::make_unique<holder<T>>();
      tag_ = &tag_of<T>;
    }
    return static_cast<holder<T>&>(*holder_).value;
  }

 private:
  struct holder_base {
    holder_base() = default;
    holder_base(holder_base const&) = delete;
    holder_base& operator=(holder_base const&) = delete;
    virtual ~holder_base() = default;
  };
  template <class T>
  struct holder final : holder_base {
    T value{};
  };
  template <class T>
  static constexpr char tag_of = 0;  // one address per type
  std::unique_ptr<holder_base> holder_;
  void const* tag_ = nullptr;
};
}  // namespace detail
DPARALLEL_NAMESPACE_END

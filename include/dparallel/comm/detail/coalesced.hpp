#pragma once
// A list of tensors read as one array (all_reduce_coalesced): their elements one after the other,
// in list order. The host engine deals stripes of that array out to the ranks; each rank may cut
// its array into tensors differently (one buffer, or a list), so a stripe is reduced in pieces
// that lie within one tensor on every rank.

#include <dparallel/config.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <span>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// Finds elements of a list of tensors read as one array, for increasing element indices.
class coalesced_cursor {
 public:
  coalesced_cursor() = default;
  /// Over `parts`, whose elements are `elem_bytes` wide.
  coalesced_cursor(std::span<tensor_ref const> parts, std::size_t elem_bytes) noexcept
      : parts_(parts), esz_(elem_bytes) {}

  /// Where element `i` of the concatenation lies, and how many elements from there on lie in the
  /// same tensor (at least 1); `i` must be below the total, and at least the previous call's `i`
  /// (the cursor only moves forward).
  std::pair<char*, std::size_t> locate(std::size_t i) noexcept {
    while (start_ + parts_[part_].size() <= i) start_ += parts_[part_++].size();
    auto* const base = static_cast<char*>(parts_[part_].data());
    return {base + (i - start_) * esz_, start_ + parts_[part_].size() - i};
  }

 private:
  std::span<tensor_ref const> parts_;
  std::size_t esz_ = 1;
  std::size_t part_ = 0;   // the tensor holding the last element located
  std::size_t start_ = 0;  // its first element's index in the concatenation
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

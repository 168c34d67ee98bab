#pragma once
// The argument checks of the engines' checked front (comm/detail/engine_base.hpp). Each returns what
// is wrong with a collective's arguments, worded for the user, or an empty string when nothing
// is; engine_base adds the engine's own checks and rejects the call (it aborts the group so the
// peers fail at once, then throws invalid_argument on the caller).

#include <dparallel/config.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// A view with elements must have memory.
inline std::string null_data_problem(tensor_ref t, char const* name) {
  if (t.size() == 0 || t.data() != nullptr) return {};
  return std::string("`") + name + "` has " + std::to_string(t.size()) + " elements but a null data pointer";
}

/// reduce / broadcast: the root must be a rank of the group.
inline std::string root_problem(int root, int size) {
  if (root >= 0 && root < size) return {};
  return "expected a root in [0, " + std::to_string(size) + "), found " + std::to_string(root);
}

/// True when the two views share no byte.
inline bool disjoint(tensor_ref a, tensor_ref b) noexcept {
  auto const a0 = reinterpret_cast<std::uintptr_t>(a.data());
  auto const b0 = reinterpret_cast<std::uintptr_t>(b.data());
  return a0 + a.size_bytes() <= b0 || b0 + b.size_bytes() <= a0;
}

/// reduce_scatter / all_gather on rank `rank` of `size`: `small` has n elements and `big`
/// size * n of the same dtype; `small` is big's block `rank` (in place) or disjoint from `big`
/// (a partial overlap would race with the peers' reads and writes).
inline std::string blocks_problem(tensor_ref small, tensor_ref big, char const* small_name, char const* big_name,
                                  int size, int rank) {
  auto const n = static_cast<std::size_t>(size);
  if (big.dtype() != small.dtype()) {
    return std::string("expected `") + big_name + "` and `" + small_name + "` of the same dtype, found " +
           std::string(name_of(big.dtype())) + " and " + std::string(name_of(small.dtype()));
  }
  if (big.size() != n * small.size()) {
    return std::string("expected `") + big_name + "` to hold size() * " + small_name + ".size() = " +
           std::to_string(n) + " * " + std::to_string(small.size()) + " = " + std::to_string(n * small.size()) +
           " elements, found " + std::to_string(big.size());
  }
  if (small.size() == 0 || disjoint(small, big)) return {};
  auto const own_block = static_cast<std::byte const*>(big.data()) + static_cast<std::size_t>(rank) * small.size_bytes();
  if (small.data() == own_block) return {};
  return std::string("`") + small_name + "` overlaps `" + big_name + "` other than as its block " +
         std::to_string(rank) + " (this rank's); pass that block for an in-place call, or disjoint buffers";
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

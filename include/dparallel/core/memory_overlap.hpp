#pragma once
// Tensors that share memory where each needs its own: a gradient over its parameter, two
// gradients over one buffer, a replica's tensor over the master's. A reduction that reads or
// writes one of them then changes the other, and the sums come out wrong without an error. One
// sort and one pass over the tensors, at construction.

#include <dparallel/config.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// A tensor in an overlap search: its memory, its group (what it is: a parameter, a gradient, the
/// master's or a replica's; numbered from 0) and its index in that group.
struct tensor_place {
  tensor_ref tensor;
  int group = 0;
  std::size_t index = 0;
};

/// Two tensors that share memory; `first` starts at the lower address (at the same address: the
/// lower group, then the lower index).
struct memory_overlap {
  tensor_place first, second;
};

/// The first pair, in address order, of tensors in `places` that share memory and whose groups
/// clash (`clash(a, b)`, symmetric, for groups a and b below `groups`). Tensors of no elements
/// share nothing.
template <class Clash>
std::optional<memory_overlap> find_memory_overlap(std::vector<tensor_place> places, int groups, Clash clash) {
  auto const begin = [](tensor_place const& p) { return reinterpret_cast<std::uintptr_t>(p.tensor.data()); };
  auto const end = [&](tensor_place const& p) { return begin(p) + p.tensor.size_bytes(); };
  std::erase_if(places, [](tensor_place const& p) { return p.tensor.size() == 0; });
  std::sort(places.begin(), places.end(), [&](tensor_place const& a, tensor_place const& b) {
    if (begin(a) != begin(b)) return begin(a) < begin(b);
    return a.group != b.group ? a.group < b.group : a.index < b.index;  // the same pair whatever the input order
  });
  // For each group, the tensor seen so far that reaches furthest: a tensor overlaps an earlier one
  // of a group exactly when it overlaps that group's furthest-reaching one.
  std::vector<std::optional<std::size_t>> reach(static_cast<std::size_t>(groups));
  for (std::size_t k = 0; k < places.size(); ++k) {
    auto const& p = places[k];
    for (int g = 0; g < groups; ++g) {
      auto const& r = reach[static_cast<std::size_t>(g)];
      if (r && clash(g, p.group) && end(places[*r]) > begin(p)) return memory_overlap{places[*r], p};
    }
    auto& mine = reach[static_cast<std::size_t>(p.group)];
    if (!mine || end(places[*mine]) < end(p)) mine = k;
  }
  return std::nullopt;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// The subgroups of a shared-memory process group (process_group::split / new_group on
// comm/shm.hpp's communicator): each subgroup of two or more ranks gets a segment of its own,
// created by its group rank 0 as any shm group's; the names travel to the members through one
// all_gather over the parent (a fixed slot of bytes per parent rank, empty but for the subgroups'
// group ranks 0), which every parent rank issues exactly once, members or not. A subgroup of one
// rank maps a segment nobody else needs to find. The subgroup keeps the parent's message sizes
// (options::small_bytes, chunk_bytes); a segment left behind by nobody: the names are unlinked as
// soon as every member mapped them, as for any shm group.

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/subgroup_plan.hpp>
#include <dparallel/comm/shm/detail/bootstrap.hpp>
#include <dparallel/comm/shm/detail/group.hpp>
#include <dparallel/comm/shm_options.hpp>
#include <dparallel/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// Bytes per parent rank in the all_gather that carries the subgroups' segment names.
inline constexpr std::size_t shm_subgroup_slot = 512;

/// This rank's shm group for `plan` (null when in no subgroup). `gather(out, in)`: an all_gather
/// of `in` (shm_subgroup_slot bytes) over the parent, waited for; `parent`: the parent's group.
inline std::shared_ptr<shm_group> join_shm_subgroup(
    subgroup_plan const& plan, shm_group const& parent,
    std::function<void(std::vector<std::uint8_t>&, std::vector<std::uint8_t>&)> const& gather,
    std::chrono::milliseconds timeout) {
  auto const& h = parent.segment().header();
  shm::options const opts{.small_bytes = static_cast<std::size_t>(h.small_bytes),
                          .chunk_bytes = static_cast<std::size_t>(h.chunk_bytes),
                          .arena_bytes = static_cast<std::size_t>(h.arena_bytes)};
  bool exchanged = false;
  auto const exchange = [&](std::span<std::byte const> bytes) {
    exchanged = true;
    std::vector<std::uint8_t> mine(shm_subgroup_slot, 0);
    std::uint32_t const len = static_cast<std::uint32_t>(bytes.size());
    if (bytes.size() > shm_subgroup_slot - sizeof len)
      throw comm_error(plan.parent_rank, "dparallel: shm subgroup: a segment name of " + std::to_string(bytes.size()) +
                                             " bytes does not fit the exchange");
    std::memcpy(mine.data(), &len, sizeof len);
    if (!bytes.empty()) std::memcpy(mine.data() + sizeof len, bytes.data(), bytes.size());
    std::vector<std::uint8_t> all(shm_subgroup_slot * static_cast<std::size_t>(plan.parent_size));
    gather(all, mine);
    if (plan.mine < 0) return std::vector<std::byte>{};
    auto const* leader = all.data() + shm_subgroup_slot * static_cast<std::size_t>(plan.members()[0]);
    std::uint32_t l = 0;
    std::memcpy(&l, leader, sizeof l);
    auto const* first = reinterpret_cast<std::byte const*>(leader + sizeof l);
    return std::vector<std::byte>(first, first + std::min<std::size_t>(l, shm_subgroup_slot - sizeof l));
  };
  std::shared_ptr<shm_group> group;
  if (plan.mine >= 0) {
    auto const n = static_cast<int>(plan.members().size());
    group = join_shm_group(plan.group_rank, n, exchange, timeout, opts);
    group->set_parent_ranks(plan.members());
  }
  if (!exchanged) (void)exchange({});  // in no subgroup, or in one of one rank: still one all_gather
  return group;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

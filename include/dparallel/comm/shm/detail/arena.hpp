#pragma once
// Group memory of a shared-memory process group (see <dparallel/comm/shm.hpp>): one rank's region
// of the segment (shm/detail/segment.hpp, "Group memory"), handed out by process_group::allocate.
//
// First fit over a list of free blocks, blocks aligned to 256 bytes (a whole number of cache lines
// and of any element type), freed blocks merged with their neighbours. A block's pages are
// reserved when it is handed out (shm_segment::reserve), and it is zeroed, as every allocation of
// the library is. The memory stays valid while any block is alive: each block's deleter holds
// the group that maps the segment. Allocation and freeing may happen on any thread.

#include <dparallel/config.hpp>
#include <dparallel/comm/shm/detail/segment.hpp>

#include <cstddef>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

class shm_arena {
 public:
  static constexpr std::size_t align = 256;

  /// The region [offset, offset + bytes) of `seg`.
  shm_arena(shm_segment const& seg, std::size_t offset, std::size_t bytes) : seg_(seg), base_(offset), bytes_(bytes) {
    if (bytes_ >= align) free_[0] = bytes_ / align * align;
  }

  /// A zeroed block of at least `bytes` bytes in the region (its address), or null when no free
  /// block is large enough or /dev/shm cannot back it.
  [[nodiscard]] std::byte* take(std::size_t bytes) {
    std::size_t const want = bytes == 0 ? align : (bytes + align - 1) / align * align;
    std::lock_guard lock(m_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < want) continue;
      std::size_t const at = it->first;
      if (!seg_.reserve(base_ + at, want)) return nullptr;
      std::size_t const rest = it->second - want;
      free_.erase(it);
      if (rest != 0) free_[at + want] = rest;
      taken_[at] = want;
      std::byte* const p = seg_.at(base_ + at);
      std::memset(p, 0, want);
      return p;
    }
    return nullptr;
  }

  /// Returns the block at `p` (from take()).
  void give(std::byte* p) {
    std::lock_guard lock(m_);
    auto const t = taken_.find(static_cast<std::size_t>(p - seg_.at(base_)));
    if (t == taken_.end()) return;
    auto [at, len] = *t;
    taken_.erase(t);
    auto next = free_.lower_bound(at);
    if (next != free_.end() && at + len == next->first) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == at) {
        prev->second += len;
        return;
      }
    }
    free_[at] = len;
  }

  /// The offset in the segment of [p, p + bytes) when it lies inside one block of the region, else 0
  /// (never a valid offset: the region lies past the segment's header).
  [[nodiscard]] std::size_t offset_of(void const* p, std::size_t bytes) const {
    auto const* b = static_cast<std::byte const*>(p);
    std::byte const* const lo = seg_.at(base_);
    if (b < lo || b >= lo + bytes_) return 0;
    auto const at = static_cast<std::size_t>(b - lo);
    std::lock_guard lock(m_);
    auto t = taken_.upper_bound(at);
    if (t == taken_.begin()) return 0;
    --t;
    return at + bytes <= t->first + t->second ? base_ + at : 0;
  }

 private:
  shm_segment const& seg_;
  std::size_t base_;
  std::size_t bytes_;
  mutable std::mutex m_;
  std::map<std::size_t, std::size_t> free_;   // offset in the region -> bytes
  std::map<std::size_t, std::size_t> taken_;  // offset in the region -> bytes
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

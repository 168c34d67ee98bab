#pragma once
// The epoch of the distributed_sampler a thread made or set last, for DDP's per-step cross-rank
// check under desync detection (detail/rank_checks.hpp: a rank that forgot set_epoch reads the last
// epoch's order again). A thread-local word: the sampler writes it, the step reads it.

#include <dparallel/config.hpp>

#include <cstdint>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// This thread's last sampler epoch plus one (0: no sampler on this thread yet).
inline std::uint64_t& sampler_epoch_note() noexcept {
  thread_local std::uint64_t epoch_plus_one = 0;
  return epoch_plus_one;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

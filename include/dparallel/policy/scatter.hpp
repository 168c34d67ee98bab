#pragma once
// Scatter policies: how many samples of the batch given to step() each local device receives.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/partition.hpp>

#include <concepts>
#include <cstddef>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// A scatter policy maps (batch size, number of local devices, options) to per-device shard
/// sizes; entry i belongs to device i, missing or zero entries mean no shard for that device.
template <class P>
concept scatter_policy = std::semiregular<P> && requires(std::size_t b, std::size_t n, options const& o) {
  { P::shard_sizes(b, n, o) } -> std::same_as<std::vector<std::size_t>>;
};

namespace policy {

/// DataParallel: split the batch on dim 0 as options::chunking says (torch.chunk by default).
struct split_batch {
  static std::vector<std::size_t> shard_sizes(std::size_t batch, std::size_t n, options const& o) {
    return partition(batch, n, o.chunking, o.chunk_weights, o.chunk_sizes);
  }
};
static_assert(scatter_policy<split_batch>);

/// DDP: no scatter; each rank's single local replica takes the whole batch it was given.
struct no_scatter {
  static std::vector<std::size_t> shard_sizes(std::size_t batch, std::size_t n, options const&) {
    detail::require(batch > 0, "step: expected a batch of at least one sample, found an empty batch");
    std::vector<std::size_t> s(n, 0);
    s[0] = batch;
    return s;
  }
};
static_assert(scatter_policy<no_scatter>);

}  // namespace policy
DPARALLEL_NAMESPACE_END

#pragma once
// How a batch of B samples is cut into per-device shards.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <cmath>
#include <cstddef>
#include <numeric>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// torch.chunk(B, n): every chunk holds ceil(B/n) samples except the last, which holds the rest.
/// There are ceil(B / ceil(B/n)) chunks, so fewer than n when B < n or when the rounding leaves
/// nothing for the last devices (B = 5, n = 4 gives 2, 2, 1). B = 0 is an error.
inline std::vector<std::size_t> chunk_sizes(std::size_t batch, std::size_t n) {
  detail::require(n > 0, "chunk_sizes: expected at least one device, found 0");
  detail::require(batch > 0, "chunk_sizes: expected a batch of at least one sample, found an empty batch");
  std::size_t const c = (batch + n - 1) / n;
  std::vector<std::size_t> sizes;
  for (std::size_t left = batch; left > 0; left -= std::min(c, left)) sizes.push_back(std::min(c, left));
  return sizes;
}

/// torch.tensor_split(B, n): min(B, n) chunks whose sizes differ by at most one, larger first.
inline std::vector<std::size_t> even_sizes(std::size_t batch, std::size_t n) {
  detail::require(n > 0, "even_sizes: expected at least one device, found 0");
  detail::require(batch > 0, "even_sizes: expected a batch of at least one sample, found an empty batch");
  std::size_t const k = std::min(batch, n);
  std::vector<std::size_t> sizes(k, batch / k);
  for (std::size_t i = 0; i < batch % k; ++i) ++sizes[i];
  return sizes;
}

/// Sizes proportional to `weights` (one per device, >= 0, not all 0) by the largest-remainder
/// rule, ties to the lower index; deterministic. A device may get 0 samples.
inline std::vector<std::size_t> weighted_sizes(std::size_t batch, std::vector<double> const& weights) {
  detail::require(!weights.empty(), "weighted_sizes: expected one weight per device, found none");
  detail::require(batch > 0, "weighted_sizes: expected a batch of at least one sample, found an empty batch");
  double total = 0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    detail::require(std::isfinite(weights[i]) && weights[i] >= 0,
                    "weighted_sizes: expected finite weights >= 0, found weight " + std::to_string(weights[i]) +
                        " for device " + std::to_string(i));
    total += weights[i];
  }
  detail::require(total > 0, "weighted_sizes: expected at least one positive weight, found all zero");
  std::vector<std::size_t> sizes(weights.size());
  std::vector<double> rest(weights.size());
  std::size_t given = 0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    double const exact = static_cast<double>(batch) * weights[i] / total;
    sizes[i] = static_cast<std::size_t>(std::floor(exact));
    rest[i] = exact - std::floor(exact);
    given += sizes[i];
  }
  while (given < batch) {  // at most weights.size() rounds
    std::size_t best = 0;
    for (std::size_t i = 1; i < rest.size(); ++i)
      if (rest[i] > rest[best]) best = i;
    ++sizes[best];
    rest[best] = -1;
    ++given;
  }
  return sizes;
}

/// How DataParallel cuts the global batch (options::chunking).
enum class chunking {
  torch_chunk,  ///< chunk_sizes(): torch.chunk, PyTorch DataParallel's behaviour (the default)
  even,         ///< even_sizes(): torch.tensor_split
  weights,      ///< weighted_sizes() with options::chunk_weights
  sizes,        ///< options::chunk_sizes verbatim (must sum to the batch size)
};

/// Shard sizes for `batch` samples over `n` devices; element i belongs to device i. Trailing or
/// zero entries mean a device receives no shard in this step.
inline std::vector<std::size_t> partition(std::size_t batch, std::size_t n, chunking how,
                                          std::vector<double> const& weights = {},
                                          std::vector<std::size_t> const& sizes = {}) {
  switch (how) {
    case chunking::torch_chunk: return chunk_sizes(batch, n);
    case chunking::even: return even_sizes(batch, n);
    case chunking::weights:
      detail::require(weights.size() == n, "partition: expected " + std::to_string(n) +
                                               " chunk weights (one per device), found " +
                                               std::to_string(weights.size()));
      return weighted_sizes(batch, weights);
    case chunking::sizes: {
      detail::require(batch > 0, "partition: expected a batch of at least one sample, found an empty batch");
      detail::require(sizes.size() == n, "partition: expected " + std::to_string(n) +
                                             " chunk sizes (one per device), found " + std::to_string(sizes.size()));
      std::size_t const sum = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
      detail::require(sum == batch, "partition: expected chunk sizes summing to the batch size " +
                                        std::to_string(batch) + ", found a sum of " + std::to_string(sum));
      return sizes;
    }
  }
  return {};
}

DPARALLEL_NAMESPACE_END

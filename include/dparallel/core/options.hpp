#pragma once
// options: the values that tune a wrapper (as opposed to its policies, which are types).

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/partition.hpp>

#include <cstddef>
#include <optional>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Options of parallel<>; every field has the default a PyTorch user expects. Use designated
/// initialisers: `dparallel::options{.output_device = dev, .chunking = dparallel::chunking::even}`.
struct options {
  // --- DataParallel ---
  /// Where gathered outputs land; default: the first device (as torch's output_device).
  std::optional<device> output_device;
  /// How the global batch is cut into shards; torch.chunk by default.
  dparallel::chunking chunking = dparallel::chunking::torch_chunk;
  /// With chunking::weights: one relative weight per device (e.g. {0.5, 1, 1} relieves the master).
  std::vector<double> chunk_weights;
  /// With chunking::sizes: one shard size per device, summing to each batch's size.
  std::vector<std::size_t> chunk_sizes;
};

DPARALLEL_NAMESPACE_END

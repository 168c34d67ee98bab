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

  // --- DistributedDataParallel ---
  /// Bucket capacity in MiB (PyTorch's bucket_cap_mb); fractions allowed (tests force many buckets).
  double bucket_cap_mb = 25.0;
  /// Capacity of the first bucket in MiB, small so that communication starts early.
  double first_bucket_cap_mb = 1.0;
  /// Broadcast rank 0's buffers (running statistics) to every rank before each step.
  bool broadcast_buffers = true;
  /// Tolerate parameters that a step which uses step_context::grad_ready never marks ready: they
  /// contribute a zero gradient instead of raising an error.
  bool find_unused_parameters = false;
  /// The device of this rank's replica; default: device index = rank on the host backend.
  std::optional<device> local_device;
};

DPARALLEL_NAMESPACE_END

#pragma once
// options: the values that tune a wrapper (as opposed to its policies, which are types).

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/partition.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// The default options::warning_sink: "dparallel: warning: <line>" on std::cerr.
inline void warn_to_stderr(std::string_view line) { std::cerr << "dparallel: warning: " << line << '\n'; }

/// How DDP averages the ranks' gradients (options::average); see docs/join.md.
enum class average_mode {
  /// The mean of the ranks' gradients (PyTorch's default): each contributing rank weighs the same.
  ranks,
  /// Weighted by the samples each rank saw since the last synchronised step: the result is the
  /// one-device gradient of the mean loss over every sample seen, whatever each rank's batch size.
  samples,
};

/// Options of parallel<>; every field has the default a PyTorch user expects. Use designated
/// initialisers: `dparallel::options{.output_device = dev, .chunking = dparallel::chunking::even}`.
struct options {
  // --- DataParallel ---
  /// Where gathered outputs land; default: the first device (as torch's output_device).
  std::optional<device> output_device{};
  /// How the global batch is cut into shards; torch.chunk by default.
  dparallel::chunking chunking = dparallel::chunking::torch_chunk;
  /// With chunking::weights: one relative weight per device (e.g. {0.5, 1, 1} relieves the master).
  std::vector<double> chunk_weights{};
  /// With chunking::sizes: one shard size per device, summing to each batch's size.
  std::vector<std::size_t> chunk_sizes{};

  // --- DistributedDataParallel ---
  /// Bucket capacity in MiB (PyTorch's bucket_cap_mb); fractions allowed (tests force many buckets).
  double bucket_cap_mb = 25.0;
  /// Capacity of the first bucket in MiB, small so that communication starts early.
  double first_bucket_cap_mb = 1.0;
  /// Broadcast rank 0's buffers (running statistics) to every rank before each step.
  bool broadcast_buffers = true;
  /// All-reduce-average the floating-point buffers (running statistics) over the ranks after each
  /// synchronised step (SyncBatchNorm-style), instead of broadcasting rank 0's before it; buffers
  /// of integer dtype are still broadcast. Ranks that have joined do not contribute.
  bool average_buffers = false;
  /// How gradients are averaged over the ranks; average_mode::ranks keeps today's bits.
  average_mode average = average_mode::ranks;
  /// Ranks may run different numbers of steps: each synchronised step adds one small all-gather
  /// (whether each rank is still stepping, and its sample count), and a rank whose data ran out
  /// calls join() (see docs/join.md). Every rank must pass the same value.
  bool uneven_inputs = false;
  /// Tolerate parameters that a step which uses step_context::grad_ready never marks ready: they
  /// contribute a zero gradient instead of raising an error.
  bool find_unused_parameters = false;
  /// The device of this rank's replica; default: device index = rank on the host backend.
  std::optional<device> local_device{};
  /// PyTorch's gradient_as_bucket_view: no bucket storage and no second copy of the gradients.
  /// The buckets are views of the model's own gradient memory and are all-reduced in place, so
  /// the model should keep its gradients in one flat buffer (say, in parameter order): gradients
  /// adjacent in memory share a bucket, walking the memory from its end to its start (reverse
  /// parameter order for such a buffer), split at the bucket caps, at gaps and where the dtype
  /// changes; the plan is not rebuilt from the ready order. Every rank must lay its gradients out
  /// the same way: the wrapper checks that every rank made the same buckets and raises an error
  /// on every rank otherwise. Results are bitwise those of the default (copying) mode.
  /// A model with bind_gradients (core/gradient_memory.hpp) has its gradients laid out by DDP
  /// instead, as PyTorch does: moved at construction into one block from the process group
  /// (process_group::allocate, group memory on a shared-memory group), in parameter order.
  bool gradient_as_bucket_view = false;

  // --- Failure ---
  /// How long a collective the wrapper launches between its devices may take before the wrapper
  /// gives up on it: nccl::dp's grouped broadcast and reduce are then aborted (their NCCL
  /// communicators end for good) and the step fails with a timeout_error naming the device(s).
  std::chrono::milliseconds timeout = std::chrono::seconds(300);

  // --- Diagnostics ---
  /// Where the wrapper's warnings go, one line each (no trailing newline): DataParallel's, at
  /// construction, about devices that differ by more than 25% in memory or multiprocessors
  /// (backends that describe their devices only), and DDP's under desync detection, once, about
  /// ranks feeding different batch sizes. An empty function silences them.
  std::function<void(std::string_view)> warning_sink = warn_to_stderr;
  /// Contract checking, a debug mode: true or false turns it on or off; left empty, the
  /// environment variable DPARALLEL_CHECK_CONTRACTS decides (on when set to anything but 0), so a
  /// whole run can be checked without changing code. Just before each step function its replica's
  /// gradients are filled: one that is not zero with a NaN pattern (it must be overwritten: an
  /// element left is an error naming the parameter, the elements and the device or rank), one of
  /// zeros with -0.0 (it may be added into: a step that writes none of them is an error). It
  /// catches a model trained as a copy (taken by value), a gradient written in part or added into
  /// without zeroing, and DataParallel replicas sharing gradient memory. It costs a few passes over
  /// every gradient per step; off, nothing (see core/contract_check.hpp). A step function that
  /// writes no gradient on purpose (a forward pass only) fails with it on: give such a wrapper
  /// check_contracts = false.
  std::optional<bool> check_contracts{};
  /// A directory to write this wrapper's timeline of steps to, as a Chrome trace event file
  /// (core/trace.hpp; Perfetto and chrome://tracing load it, scripts/merge-traces joins the
  /// ranks'). Left empty, the environment variable DPARALLEL_TRACE decides; neither: no trace.
  std::string trace{};
};

DPARALLEL_NAMESPACE_END

#pragma once
// The semantics bundles: which scatter, replicate, reduce and gather policy parallel<> composes.
// dp and ddp are the two PyTorch behaviours; a user's own bundle derives from one and replaces a
// member type.

#include <dparallel/config.hpp>
#include <dparallel/policy/bucketed_reduce.hpp>
#include <dparallel/policy/bucketed_reduce_scatter.hpp>
#include <dparallel/policy/gather.hpp>
#include <dparallel/policy/reduce.hpp>
#include <dparallel/policy/replicate.hpp>
#include <dparallel/policy/scatter.hpp>

DPARALLEL_NAMESPACE_BEGIN

/// A bundle of policies: what parallel<> is parameterised on.
template <class S>
concept semantics = scatter_policy<typename S::scatter> && replicate_policy<typename S::replicate> &&
                    reduce_policy<typename S::reduce> && gather_policy<typename S::gather>;

/// DataParallel semantics (torch.nn.DataParallel): one process, several local devices; the batch
/// is split on dim 0, the master's parameters are copied to every replica before each step, the
/// gradients are summed shard-weighted onto the master, the outputs are concatenated.
/// Derive from it and replace a member type to mix policies.
struct dp {
  /// torch.chunk split of the global batch.
  using scatter = policy::split_batch;
  /// The master's parameters copied to every replica before each step.
  using replicate = policy::replicate_each_step;
  /// Shard-weighted gradients summed onto the master.
  using reduce = policy::reduce_to_master;
  /// Outputs concatenated in device order.
  using gather = policy::concat_outputs;
};
static_assert(semantics<dp>);

/// DataParallel whose shard sizes follow each device's measured speed (policy::auto_balance):
/// for devices of unequal speed. Results equal the one-device gradient, but shard sizes depend
/// on timing, so runs are reproducible only up to rounding.
struct dp_balanced : dparallel::dp {
  /// Shard sizes that follow each device's measured speed.
  using scatter = policy::auto_balance;
};
static_assert(semantics<dp_balanced>);

/// DistributedDataParallel semantics (torch.nn.parallel.DistributedDataParallel): one replica per
/// rank of a process group, each rank feeding its own batch (see distributed_sampler); rank 0's
/// parameters broadcast at construction, gradients averaged by a bucketed all-reduce overlapped
/// with backward, outputs left local. `distributed` selects the process-group constructor.
struct ddp {
  /// Marks a bundle whose wrappers span a process group (see is_distributed_v).
  static constexpr bool distributed = true;
  /// Each rank's replica takes the whole batch it is given.
  using scatter = policy::no_scatter;
  /// Rank 0's parameters broadcast at construction.
  using replicate = policy::broadcast_from_root;
  /// Bucketed all-reduce, averaged over the ranks, overlapped with backward.
  using reduce = policy::bucketed_all_reduce;
  /// Each rank's output returned as it is.
  using gather = policy::local_output;
};
static_assert(semantics<ddp>);

/// DDP with ZeRO stage 1 (PyTorch's ZeroRedundancyOptimizer over DDP): each bucket's gradient is
/// reduce-scattered instead of all-reduced, overlapped with backward as in ddp, so each rank ends
/// the step with its shard of the averaged gradient; a zero_redundancy_optimizer over the wrapper
/// updates that shard with 1/N of the optimizer state and all-gathers the parameters.
struct ddp_zero1 : dparallel::ddp {
  /// Bucketed reduce-scatter, averaged over the ranks, overlapped with backward.
  using reduce = policy::bucketed_reduce_scatter;
};
static_assert(semantics<ddp_zero1>);

/// True for bundles whose wrappers span the ranks of a process group (DDP and its variants).
template <class S>
inline constexpr bool is_distributed_v = requires { requires S::distributed; };

DPARALLEL_NAMESPACE_END

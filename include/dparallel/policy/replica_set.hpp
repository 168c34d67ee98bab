#pragma once
// The interface a policy works on (docs/writing-policies.md). Every policy hook receives the
// wrapper's replica_set<Model, Backend>: the local devices and their streams, the model on each,
// their tensors, the current step's shard plan and, under DDP, the process group. The members
// listed in policy_set are the stable, documented interface; anything else in the type is the
// library's own and may change.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/detail/replica_set.hpp>

#include <concepts>
#include <cstddef>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// What a policy hook receives: one wrapper's state (see policy_set for the members a policy may
/// use). Template arguments: the user's model type and the backend.
template <class Model, class Backend>
using replica_set = detail::replica_set<Model, Backend>;

/// The stable members of a replica_set, for policy authors (i indexes the local devices, 0 is the
/// master's device; p indexes parameters in the model's order):
/// - `size()`: local devices (DataParallel: the wrapper's devices; DDP: 1);
/// - `devices[i]`, `streams[i]` (the device's ordered work queue: `enqueue(fn)` returns an event,
///   `record()`, `wait(event)`, `synchronize()`), `models[i]` (`models[0]` is `*master`);
/// - `params[i][p]`, `grads[i][p]`, `bufs[i][k]`: tensor_refs of each model's tensors, refreshed at
///   the start of every step;
/// - the step's plan: `batch` (samples given to step()), `shard_sizes[i]`, `shard_offsets[i]`,
///   `active(i)` (device i received a shard), `weight(i)` (its share of the batch),
///   `compute_done[i]` (event: device i's step function finished);
/// - `group` (DDP: this rank's process_group; empty for DataParallel), `rank()`, `world_size()`;
/// - `opts` (the wrapper's options), `sync` (false inside DDP's no_sync()).
template <class S>
concept policy_set = requires(S& s, S const& cs, std::size_t i) {
  typename S::model_type;
  typename S::backend_type;
  typename S::stream_type;
  typename S::event_type;
  { cs.size() } -> std::same_as<std::size_t>;
  { cs.rank() } -> std::same_as<int>;
  { cs.world_size() } -> std::same_as<int>;
  { cs.active(i) } -> std::same_as<bool>;
  { cs.weight(i) } -> std::same_as<double>;
  { s.devices } -> std::same_as<std::vector<device>&>;
  { s.params } -> std::same_as<std::vector<std::vector<tensor_ref>>&>;
  { s.grads } -> std::same_as<std::vector<std::vector<tensor_ref>>&>;
  { s.bufs } -> std::same_as<std::vector<std::vector<tensor_ref>>&>;
  { s.batch } -> std::same_as<std::size_t&>;
  { s.shard_sizes } -> std::same_as<std::vector<std::size_t>&>;
  { s.shard_offsets } -> std::same_as<std::vector<std::size_t>&>;
  { s.group } -> std::same_as<process_group&>;
  { s.opts } -> std::same_as<options&>;
  { s.sync } -> std::same_as<bool&>;
  s.streams[i];
  s.models[i];
  s.compute_done[i];
  s.master;
};

DPARALLEL_NAMESPACE_END

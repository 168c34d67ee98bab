#pragma once
// The interface a policy works on (docs/writing-policies.md). Every policy hook receives the
// wrapper's replica_set<Model, Backend>: the local devices and their streams, the model on each,
// their tensors, the current step's shard plan and, under DDP, the process group. The members
// listed in policy_set (policy/concepts.hpp, one named concept per part) are the stable,
// documented interface; anything else in the type is the library's own and may change.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/concepts.hpp>
#include <dparallel/policy/detail/replica_set.hpp>

DPARALLEL_NAMESPACE_BEGIN

/// What a policy hook receives: one wrapper's state (see policy_set for the members a policy may
/// use). Template arguments: the user's model type and the backend.
template <class Model, class Backend>
using replica_set = detail::replica_set<Model, Backend>;

DPARALLEL_NAMESPACE_END

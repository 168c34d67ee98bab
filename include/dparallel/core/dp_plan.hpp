#pragma once
// How DataParallel's devices share a step's data movement: the replicate copies (the master's
// parameters and buffers into every replica that runs a shard) and the reduce sums (the replicas'
// gradients onto the master). The backend chooses the layout (dp_sharing); the plans are pure
// functions of the number of devices and the tensors' sizes, which policy::replicate_each_step
// and policy::reduce_to_master follow and the host tests check (tests/test_dp_plan.cpp).

#include <dparallel/config.hpp>
#include <dparallel/core/stripes.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <concepts>
#include <cstddef>
#include <span>

DPARALLEL_NAMESPACE_BEGIN

/// How a backend wants DataParallel's copies and sums shared among the devices of a step. A
/// backend declares it as `static constexpr dparallel::dp_sharing dp_share = ...;`; one that does
/// not gets dp_sharing::per_device.
enum class dp_sharing {
  /// For host threads (host::backend): device k of the m that run a shard copies its stripes
  /// (core/stripes.hpp) of every master tensor into every other replica and sums its stripes of
  /// every gradient, each as one piece of work on its stream. A stripe a device reduced is still
  /// in its cache when it copies it out. Needs the borrowed forms of copy_all and weighted_sum
  /// (lists the policies keep); without them a backend gets per_device.
  stripes,
  /// For GPUs (cuda::backend): each replica pulls the master's tensors whole on its own stream
  /// (one copy per tensor, between the master's device and its own, so every copy has the
  /// issuing stream's device as an endpoint), and device k of m sums the k-th of m contiguous
  /// slices of every gradient (one slice per device and gradient).
  per_device,
};

namespace detail {

/// Whether Backend has the borrowed (span) forms of copy_all and weighted_sum.
template <class Backend>
concept borrowed_dp_lists = requires(typename Backend::stream_type& s, std::span<tensor_ref const> t,
                                     std::span<double const> w) {
  Backend::copy_all(s, t, t);
  Backend::weighted_sum(s, t, t, w);
};

/// The layout DataParallel's policies use on Backend: what it declares (dp_share), stripes only
/// when it also has the borrowed forms; per_device when it declares nothing.
template <class Backend>
consteval dp_sharing dp_sharing_of() {
  if constexpr (requires {
                  { Backend::dp_share } -> std::convertible_to<dp_sharing>;
                }) {
    if (Backend::dp_share == dp_sharing::stripes && !borrowed_dp_lists<Backend>) return dp_sharing::per_device;
    return Backend::dp_share;
  } else {
    return dp_sharing::per_device;
  }
}

/// One copy of the replicate plan: elements [lo, hi) of the master's tensor `tensor` into the same
/// elements of copier `to`'s replica, issued on copier `on`'s stream. Copiers are numbered 0..m-1,
/// copier 0 being the master and the others the replicas that run a shard.
struct replica_copy {
  std::size_t on = 0;      ///< the copier whose stream issues the copy
  std::size_t to = 0;      ///< the copier whose replica receives it (never 0)
  std::size_t tensor = 0;  ///< index in the master's parameters, then buffers
  std::size_t lo = 0;      ///< first element
  std::size_t hi = 0;      ///< one past the last element
};

/// Calls f(replica_copy) for each copy that copier `k` of `m` issues to refresh the replicas from
/// the master's tensors `master`, in issue order. stripes: for each tensor, each of k's stripes
/// into every replica (copier 0 copies too). per_device: copier k > 0 copies every non-empty
/// tensor whole into its own replica; copier 0 copies nothing.
template <class F>
void plan_replica_copies(dp_sharing how, std::size_t m, std::size_t k, std::span<tensor_ref const> master, F&& f) {
  if (m < 2) return;
  for (std::size_t t = 0; t < master.size(); ++t) {
    tensor_ref const from = master[t];
    if (how == dp_sharing::per_device) {
      if (k != 0 && from.size() != 0) f(replica_copy{k, k, t, 0, from.size()});
      continue;
    }
    for_each_stripe(from.size(), static_cast<int>(m), static_cast<int>(k), size_of(from.dtype()),
                    [&](std::size_t lo, std::size_t hi) {
                      for (std::size_t a = 1; a < m; ++a) f(replica_copy{k, a, t, lo, hi});
                    });
  }
}

/// Whether copier `a` must wait for copier `k`'s copies before its step function runs (or, for
/// the master, before it writes its buffers): k writes into a's replica, or reads the master.
constexpr bool replica_copies_touch(dp_sharing how, std::size_t k, std::size_t a) noexcept {
  if (k == a) return false;
  if (how == dp_sharing::stripes) return true;
  return a == 0;  // per_device: replica k writes only its own tensors and reads the master's
}

/// One sum of the reduce plan: elements [lo, hi) of gradient `tensor`, summed over every device
/// that ran a shard, on device `on`'s stream (an index among those devices).
struct reduce_slice {
  std::size_t on = 0;      ///< the device (among the m that ran a shard) whose stream sums it
  std::size_t tensor = 0;  ///< index in the gradients
  std::size_t lo = 0;      ///< first element
  std::size_t hi = 0;      ///< one past the last element
};

/// Calls f(reduce_slice) for each part of the gradients `grads` that device `k` of `m` sums, in
/// order: its stripes of each gradient (stripes), or the k-th of m contiguous slices of each
/// non-empty one (per_device).
template <class F>
void plan_reduce(dp_sharing how, std::size_t m, std::size_t k, std::span<tensor_ref const> grads, F&& f) {
  for (std::size_t p = 0; p < grads.size(); ++p) {
    std::size_t const n = grads[p].size();
    if (how == dp_sharing::stripes) {
      for_each_stripe(n, static_cast<int>(m), static_cast<int>(k), size_of(grads[p].dtype()),
                      [&](std::size_t lo, std::size_t hi) { f(reduce_slice{k, p, lo, hi}); });
      continue;
    }
    std::size_t const lo = n * k / m, hi = n * (k + 1) / m;
    if (lo != hi) f(reduce_slice{k, p, lo, hi});
  }
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

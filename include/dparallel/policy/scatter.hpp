#pragma once
// Scatter policies: how many samples of the batch given to step() each local device receives.

#include <dparallel/config.hpp>
#include <dparallel/core/batch.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/partition.hpp>
#include <dparallel/core/profile.hpp>
#include <dparallel/policy/concepts.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {
/// Backends that move each DataParallel shard to its device (cuda::backend):
/// `Backend::place_shard(stream, views)` runs in the shard's work on `stream` and rewrites the
/// views it must copy to views of the stream's device. Backends without it (host::backend) hand
/// the step function zero-copy views of the caller's batch.
template <class Backend>
concept places_shards = requires(typename Backend::stream_type& s, std::span<tensor_ref> v) {
  Backend::place_shard(s, v);
};

/// Calls f(view) for every tensor_view inside a shard: the shard itself, the members of a tuple,
/// pair or plain aggregate (recursively). Other members (std::span, ...) are left alone.
template <class S, class F>
void for_each_view(S& shard, F&& f) {
  if constexpr (requires { typename S::element_type; shard.slice_rows(0, 0); }) {
    f(shard);
  } else if constexpr (tuple_like<S>) {
    std::apply([&](auto&... m) { (for_each_view(m, f), ...); }, shard);
  } else if constexpr (batch_aggregate<S>) {
    // members_of gives const references; `shard` itself is not const.
    std::apply([&](auto const&... m) { (for_each_view(const_cast<std::remove_cvref_t<decltype(m)>&>(m), f), ...); },
               members_of(std::as_const(shard)));
  }
}

/// DataParallel's scatter step on device `s`: the shard with every view the backend must move
/// replaced by its copy on `s`'s device (Backend::place_shard); unchanged on other backends.
template <class Backend, class Shard>
Shard place_shard(typename Backend::stream_type& s, Shard shard) {
  if constexpr (places_shards<Backend>) {
    thread_local std::vector<tensor_ref> views;  // the launch thread's own list, refilled in place
    views.clear();
    // Read-only views too: the backend only reads through them (they are the sources of its copies).
    for_each_view(shard, [](auto const& v) {
      views.emplace_back(const_cast<void*>(static_cast<void const*>(v.data())), v.size(), v.dtype(), v.device());
    });
    if (views.empty()) return shard;
    Backend::place_shard(s, std::span<tensor_ref>(views));
    std::size_t k = 0;
    for_each_view(shard, [&k](auto& v) {
      using view = std::remove_cvref_t<decltype(v)>;
      tensor_ref const r = views[k++];
      v = view(static_cast<typename view::element_type*>(r.data()), v.size(), v.rows(), r.device());
    });
  }
  return shard;
}
}  // namespace detail

namespace policy {

/// DataParallel: split the batch on dim 0 as options::chunking says (torch.chunk by default).
struct split_batch {
  /// The shard sizes options::chunking asks for.
  static std::vector<std::size_t> shard_sizes(std::size_t batch, std::size_t n, options const& o) {
    return partition(batch, n, o.chunking, o.chunk_weights, o.chunk_sizes);
  }
};
static_assert(scatter_policy<split_batch>);

/// DDP: no scatter; each rank's single local replica takes the whole batch it was given.
struct no_scatter {
  /// The whole batch to the single local replica.
  static std::vector<std::size_t> shard_sizes(std::size_t batch, std::size_t n, options const&) {
    detail::require(batch > 0, "step: expected a batch of at least one sample, found an empty batch");
    std::vector<std::size_t> s(n, 0);
    s[0] = batch;
    return s;
  }
};
static_assert(scatter_policy<no_scatter>);

/// DataParallel with shard sizes proportional to each device's measured speed, so that devices
/// of unequal speed finish their step functions at about the same time.
///
/// - Speed: samples per second of compute (shard size / step_profile::device_compute), one
///   exponential moving average per device: rate <- smoothing * new + (1 - smoothing) * rate.
/// - Until every device has been measured once (the first step, or a new device count), the batch
///   is split evenly (even_sizes(): sizes differ by at most one, every device gets a sample when
///   batch >= devices); then weighted_sizes() with the rates as weights.
/// - At least one sample per device whenever batch >= devices, except for a hopeless device: one
///   whose single sample would take longer than the other devices need for the whole batch
///   (rate * (batch + 1) < sum of all rates). It gets no shard, so it is no longer measured; its
///   last rate stays and is judged again for every batch size. With batch >= devices at least one
///   device is never hopeless. With batch < devices, shards follow the weights (zeros allowed).
/// - The per-sample cost is assumed not to depend on which samples a shard holds.
///
/// The gradient is still the one-device gradient (shards are weighted by their size), but shard
/// sizes now depend on measured times, so docs/design.md contract 3 (bitwise identical results run to run)
/// holds only up to rounding: two runs may cut their batches differently. Use split_batch with
/// options::chunk_weights where bitwise reproducibility matters.
struct auto_balance {
  /// Weight of the newest measurement in the moving average, in (0, 1]; 1 = the last step only.
  double smoothing = 0.5;

  /// Even sizes until every device was measured, then sizes proportional to the rates.
  std::vector<std::size_t> shard_sizes(std::size_t batch, std::size_t n, options const&) const {
    detail::require(n > 0, "auto_balance: expected at least one device, found 0");
    bool measured = rate_.size() == n;
    for (double r : rate_) measured = measured && r > 0;
    if (!measured) return even_sizes(batch, n);
    std::vector<double> w = rate_;
    if (batch >= n) {
      double total = 0;
      for (double r : rate_) total += r;
      for (auto& r : w)
        if (r * static_cast<double>(batch + 1) < total) r = 0;  // hopeless: see above
    }
    auto sizes = weighted_sizes(batch, w);
    if (batch >= n) {
      for (std::size_t i = 0; i < n; ++i) {
        if (w[i] == 0 || sizes[i] != 0) continue;
        auto const largest = static_cast<std::size_t>(std::max_element(sizes.begin(), sizes.end()) - sizes.begin());
        --sizes[largest];  // >= 2: batch >= n samples lie in fewer than n non-empty shards
        sizes[i] = 1;
      }
    }
    return sizes;
  }

  /// Folds one step's measurements into the rates; devices without a shard or without a
  /// measurable compute time keep their rate.
  void observe(step_profile const& p) {
    detail::require(smoothing > 0 && smoothing <= 1,
                    "auto_balance: expected smoothing in (0, 1], found " + std::to_string(smoothing));
    std::size_t const n = p.shard_sizes.size();
    if (rate_.size() != n) rate_.assign(n, 0.0);
    for (std::size_t i = 0; i < n && i < p.device_compute.size(); ++i) {
      double const t = p.device_compute[i].count();
      if (p.shard_sizes[i] == 0 || !(t > 0)) continue;
      double const r = static_cast<double>(p.shard_sizes[i]) / t;
      rate_[i] = rate_[i] > 0 ? smoothing * r + (1 - smoothing) * rate_[i] : r;
    }
  }

  /// The smoothed speed of each device in samples per second (0 = not measured yet).
  [[nodiscard]] std::vector<double> const& rates() const noexcept { return rate_; }
  /// Forgets the measurements: the next step splits evenly again.
  void reset() noexcept { rate_.clear(); }

 private:
  std::vector<double> rate_;
};
static_assert(observing_scatter_policy<auto_balance>);

}  // namespace policy
DPARALLEL_NAMESPACE_END

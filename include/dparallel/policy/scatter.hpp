#pragma once
// Scatter policies: how many samples of the batch given to step() each local device receives.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/partition.hpp>
#include <dparallel/core/profile.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// A scatter policy maps (batch size, number of local devices, options) to per-device shard
/// sizes; entry i belongs to device i, missing or zero entries mean no shard for that device.
/// The wrapper holds one policy object and calls `p.shard_sizes(b, n, o)` on it, so a static
/// member function (the stateless policies below) and a member function (policies with state)
/// both do.
template <class P>
concept scatter_policy = std::semiregular<P> && requires(P& p, std::size_t b, std::size_t n, options const& o) {
  { p.shard_sizes(b, n, o) } -> std::same_as<std::vector<std::size_t>>;
};

/// A scatter policy that learns from the steps it planned: after every step that succeeded, the
/// wrapper calls `p.observe(profile)` with that step's step_profile (shard sizes and each
/// device's compute time among it). Optional: policies without observe() are never told.
template <class P>
concept observing_scatter_policy = scatter_policy<P> && requires(P& p, step_profile const& s) { p.observe(s); };

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

#pragma once
// Per-step diagnostics: where the wall time of one step() went (scatter, replicate, compute on each
// device, reduce, gather), a running mean over steps, a short text table of either, and the
// comparison of device properties behind the "devices differ" warning.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// The clock of every profile: monotonic and comparable across threads.
using profile_clock = std::chrono::steady_clock;
/// Seconds as a double: the unit of every profile field.
using profile_duration = std::chrono::duration<double>;

/// How unevenly the devices' step functions took their time.
struct compute_imbalance {
  /// max / mean of the compute times of the devices that had a shard (1 = perfectly balanced;
  /// 1 also when there is nothing to compare).
  double ratio = 1.0;
  /// Index (into step_profile::devices) of the device whose step function ran longest.
  std::size_t slowest = 0;
};

/// Where the wall time of one step() went. The five phases cut the step's wall time, as seen by
/// the thread that calls step(), into consecutive intervals:
///
///   scatter    step() entered -> shards planned (the scatter policy's shard sizes and offsets;
///              each shard is sliced, a view, on its device just before its step function);
///   replicate  -> the first step function starts: replication work ahead of compute on the
///              streams (DP: the master's parameters copied to the replicas; DDP: the broadcast of
///              rank 0's buffers), plus enqueueing;
///   compute    -> the last step function returns (the window in which the devices compute;
///              each device's own time is in device_compute);
///   reduce     -> every stream of the wrapper is drained: the reduce policy's work that had not
///              finished when the last step function returned. DP: the shard-weighted sum of the
///              gradients onto the master. DDP: flushing the pending buckets and waiting for their
///              all-reduces (the part of the communication that backward did not hide), then
///              writing the results back;
///   gather     -> step() returns (the gather policy joining the outputs; ~0 for void steps).
///
/// So scatter + replicate + compute + reduce + gather == total up to rounding (a step's time is
/// all in one phase or another). data_wait is outside the step: the time the training loop waited
/// for this step's batch, as told by parallel::note_data_wait() before the step.
///
/// device_compute[i] is the run time of the step function on devices[i], measured inside the
/// work enqueued on that device's stream (zero for a device without a shard). Under DDP it
/// includes what step_context::grad_ready does on the stream (copying gradients into buckets).
/// On a backend whose step functions only launch asynchronous kernels, it is the host time of the
/// launches.
struct step_profile {
  /// Time the loop reported with note_data_wait() before this step.
  profile_duration data_wait{};
  /// Planning the shards.
  profile_duration scatter{};
  /// From the plan until the first step function started (replication).
  profile_duration replicate{};
  /// From the first step function's start to the last one's end.
  profile_duration compute{};
  /// From there until every stream was drained (the reduction not hidden by compute).
  profile_duration reduce{};
  /// Gathering the outputs.
  profile_duration gather{};
  profile_duration total{};  ///< step() entered -> step() returned
  std::size_t batch = 0;     ///< samples given to step()
  int rank = 0;              ///< the process-group rank (0 for DataParallel)
  int world_size = 1;        ///< the process-group size (1 for DataParallel)
  std::vector<device> devices;                ///< the wrapper's local devices
  std::vector<std::size_t> shard_sizes;       ///< per device; 0 = no shard
  std::vector<profile_duration> device_compute;  ///< per device; zero without a shard

  /// The sum of the five phases (data_wait excluded).
  [[nodiscard]] profile_duration phases() const noexcept { return scatter + replicate + compute + reduce + gather; }

  /// max / mean compute over the devices that had a shard, and the slowest of them.
  [[nodiscard]] compute_imbalance imbalance() const {
    compute_imbalance out;
    double sum = 0, max = -1;
    std::size_t active = 0;
    for (std::size_t i = 0; i < device_compute.size(); ++i) {
      if (i < shard_sizes.size() && shard_sizes[i] == 0) continue;
      double const t = device_compute[i].count();
      sum += t;
      ++active;
      if (t > max) {
        max = t;
        out.slowest = i;
      }
    }
    if (active > 0 && sum > 0) out.ratio = max / (sum / static_cast<double>(active));
    return out;
  }
};

/// The running mean of the profiles of several steps.
class profile_summary {
 public:
  /// Adds one step.
  void add(step_profile const& p) {
    ++steps_;
    sum_.data_wait += p.data_wait;
    sum_.scatter += p.scatter;
    sum_.replicate += p.replicate;
    sum_.compute += p.compute;
    sum_.reduce += p.reduce;
    sum_.gather += p.gather;
    sum_.total += p.total;
    sum_.batch += p.batch;
    sum_.rank = p.rank;
    sum_.world_size = p.world_size;
    sum_.devices = p.devices;
    std::size_t const n = p.device_compute.size();
    if (sum_.device_compute.size() < n) {
      sum_.device_compute.resize(n);
      sum_.shard_sizes.resize(n, 0);
      active_.resize(n, 0);
    }
    for (std::size_t i = 0; i < n; ++i) {
      std::size_t const s = i < p.shard_sizes.size() ? p.shard_sizes[i] : 0;
      if (s == 0) continue;
      ++active_[i];
      sum_.shard_sizes[i] += s;
      sum_.device_compute[i] += p.device_compute[i];
    }
  }
  /// Forgets every step.
  void reset() noexcept { *this = profile_summary{}; }
  /// Steps added since construction or the last reset().
  [[nodiscard]] std::size_t steps() const noexcept { return steps_; }

  /// The mean step: each phase, and batch, averaged over steps(); each device's compute time and
  /// shard size averaged over the steps in which that device had a shard (so a device that had
  /// one keeps a non-zero shard size). All zero when no step was added.
  [[nodiscard]] step_profile mean() const {
    step_profile m = sum_;
    if (steps_ == 0) return m;
    double const k = static_cast<double>(steps_);
    for (auto* d : {&m.data_wait, &m.scatter, &m.replicate, &m.compute, &m.reduce, &m.gather, &m.total}) *d /= k;
    m.batch = static_cast<std::size_t>(std::llround(static_cast<double>(sum_.batch) / k));
    for (std::size_t i = 0; i < m.device_compute.size(); ++i) {
      if (active_[i] == 0) continue;
      double const a = static_cast<double>(active_[i]);
      m.device_compute[i] /= a;
      m.shard_sizes[i] = std::max<std::size_t>(1, static_cast<std::size_t>(std::llround(static_cast<double>(sum_.shard_sizes[i]) / a)));
    }
    return m;
  }

 private:
  step_profile sum_;
  std::vector<std::size_t> active_;  // per device: steps in which it had a shard
  std::size_t steps_ = 0;
};

namespace detail {
inline std::string profile_table(step_profile const& p, std::string const& title) {
  char line[160];
  std::string out = title + "\n";
  auto const ms = [](profile_duration d) { return d.count() * 1e3; };
  double const total = p.total.count();
  auto const row = [&](char const* name, profile_duration d) {
    double const share = total > 0 ? 100.0 * d.count() / total : 0.0;
    std::snprintf(line, sizeof line, "  %-14s %10.3f %6.1f%%\n", name, ms(d), share);
    out += line;
  };
  std::snprintf(line, sizeof line, "  %-14s %10s %7s\n", "phase", "ms", "share");
  out += line;
  row("scatter", p.scatter);
  row("replicate", p.replicate);
  row("compute", p.compute);
  row("reduce", p.reduce);
  row("gather", p.gather);
  row("step", p.total);
  std::snprintf(line, sizeof line, "  %-14s %10.3f   (waiting for the batch, before the step)\n", "data wait",
                ms(p.data_wait));
  out += line;
  std::snprintf(line, sizeof line, "  %-14s %10s %7s\n", "device", "compute ms", "shard");
  out += line;
  for (std::size_t i = 0; i < p.devices.size(); ++i) {
    std::string name = to_string(p.devices[i]);
    if (p.world_size > 1) name = "rank " + std::to_string(p.rank) + " " + name;
    double const t = i < p.device_compute.size() ? ms(p.device_compute[i]) : 0.0;
    std::size_t const s = i < p.shard_sizes.size() ? p.shard_sizes[i] : 0;
    std::snprintf(line, sizeof line, "  %-14s %10.3f %7zu\n", name.c_str(), t, s);
    out += line;
  }
  if (p.devices.size() > 1) {
    auto const im = p.imbalance();
    std::snprintf(line, sizeof line, "  imbalance %.2f (max / mean compute; slowest %s)\n", im.ratio,
                  to_string(p.devices[std::min(im.slowest, p.devices.size() - 1)]).c_str());
    out += line;
  }
  return out;
}
}  // namespace detail

/// A short human-readable table of one step's profile (phases in ms and as shares of the step,
/// then one line per device with its compute time and shard size, and the imbalance).
inline std::string format_profile(step_profile const& p) {
  return detail::profile_table(p, "dparallel step profile (last step, batch " + std::to_string(p.batch) + ")");
}
/// The same table for the mean step of a summary.
inline std::string format_profile(profile_summary const& s) {
  step_profile const m = s.mean();
  return detail::profile_table(m, "dparallel step profile (mean of " + std::to_string(s.steps()) + " steps, batch " +
                                      std::to_string(m.batch) + ")");
}

/// What a backend can say about a device (Backend::describe(device), optional): it feeds the
/// warning about devices that differ. Zero / empty = unknown.
struct device_properties {
  /// Device memory in bytes.
  std::size_t total_memory_bytes = 0;
  /// Number of multiprocessors (CUDA SMs).
  int multiprocessors = 0;
  /// The device's name.
  std::string name;
};

/// Compares the devices of one DataParallel wrapper (entry i describes its device i): returns one
/// line saying which property differs and between which devices when the largest value of total
/// memory or of multiprocessor count exceeds the smallest by more than `tolerance` (0.25: more
/// than 25%), and an empty string when the devices are alike. Unknown (zero) values are ignored.
inline std::string device_mismatch(std::vector<device_properties> const& props, double tolerance = 0.25) {
  auto const describe = [&](std::size_t i) {
    return "device " + std::to_string(i) + (props[i].name.empty() ? std::string() : " (" + props[i].name + ")");
  };
  auto const check = [&](auto value, char const* what, auto show) -> std::string {
    std::size_t lo = props.size(), hi = props.size();
    for (std::size_t i = 0; i < props.size(); ++i) {
      if (value(props[i]) <= 0) continue;
      if (lo == props.size() || value(props[i]) < value(props[lo])) lo = i;
      if (hi == props.size() || value(props[i]) > value(props[hi])) hi = i;
    }
    if (lo == props.size() || value(props[hi]) <= (1.0 + tolerance) * value(props[lo])) return {};
    char pct[32];
    std::snprintf(pct, sizeof pct, "%.0f%%", 100.0 * tolerance);
    return std::string("the devices differ by more than ") + pct + " in " + what + ": " + show(props[hi]) + " on " +
           describe(hi) + " vs " + show(props[lo]) + " on " + describe(lo) +
           "; DataParallel runs each step at the pace of the slowest device, so consider shard weights "
           "(options::chunk_weights) or dparallel::dp_balanced (policy::auto_balance)";
  };
  std::string found = check([](device_properties const& p) { return static_cast<double>(p.total_memory_bytes); },
                            "total memory", [](device_properties const& p) {
                              char b[32];
                              std::snprintf(b, sizeof b, "%.1f GiB",
                                            static_cast<double>(p.total_memory_bytes) / (1024.0 * 1024.0 * 1024.0));
                              return std::string(b);
                            });
  if (found.empty())
    found = check([](device_properties const& p) { return static_cast<double>(p.multiprocessors); },
                  "multiprocessor count",
                  [](device_properties const& p) { return std::to_string(p.multiprocessors) + " multiprocessors"; });
  return found;
}

DPARALLEL_NAMESPACE_END

#pragma once
// Learning-rate helpers for data-parallel training: the linear scaling rule and a warmup schedule.
//
//   // A recipe tuned with lr 0.1 at batch 256, now run on 8 ranks of 128 samples each:
//   double const lr = dparallel::scale_lr_linear(0.1, 8 * 128, 256);        // 0.4
//   // Ramp up to it over the first 500 steps, then follow a cosine down to 0 over 9500 steps:
//   dparallel::warmup_schedule schedule(lr, 500, dparallel::cosine_decay{.steps = 9500});
//   for (std::uint64_t step = 0; step < 10000; ++step) sgd_update(ddp.module(), schedule(step));
//
// With a large global batch the scaled rate is often too large for the first updates; a warmup
// (Goyal et al., "Accurate, Large Minibatch SGD", 2017) raises it linearly from start_lr to the
// target. `step` always counts the optimizer steps done before the one the rate is for (0 for
// the first update), which is what checkpoint's training_progress::step holds, so a resumed run
// continues the schedule exactly.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <string>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {
inline void require_rate(double lr, char const* what) {
  detail::require(std::isfinite(lr) && lr >= 0,
                  std::string(what) + ": expected a finite, non-negative learning rate, found " + std::to_string(lr));
}
}  // namespace detail

/// The linear scaling rule: base_lr × global_batch / base_batch, the rate for a global batch
/// (summed over all devices and ranks) of a recipe tuned with `base_lr` at `base_batch`.
/// Throws invalid_argument for a zero batch or a negative or non-finite rate.
inline double scale_lr_linear(double base_lr, std::size_t global_batch, std::size_t base_batch) {
  detail::require_rate(base_lr, "scale_lr_linear");
  detail::require(global_batch > 0 && base_batch > 0,
                  "scale_lr_linear: expected positive batch sizes, found global_batch = " +
                      std::to_string(global_batch) + " and base_batch = " + std::to_string(base_batch));
  return base_lr * static_cast<double>(global_batch) / static_cast<double>(base_batch);
}

/// The rate for step `step` of a linear warmup: start_lr at step 0, rising by
/// (target_lr - start_lr) / warmup_steps per step, target_lr from step warmup_steps on
/// (with start_lr = 0 this is Hugging Face's get_linear_schedule_with_warmup before its decay).
inline double warmup_lr(std::uint64_t step, double target_lr, std::uint64_t warmup_steps, double start_lr = 0.0) {
  detail::require_rate(target_lr, "warmup_lr (target_lr)");
  detail::require_rate(start_lr, "warmup_lr (start_lr)");
  if (step >= warmup_steps) return target_lr;
  return start_lr + (target_lr - start_lr) * static_cast<double>(step) / static_cast<double>(warmup_steps);
}

/// After warmup: stay at the target rate.
struct constant_lr {
  /// The target rate, whatever the step.
  double operator()(double target_lr, std::uint64_t /*steps_after_warmup*/) const noexcept { return target_lr; }
};

/// After warmup: multiply the rate by `gamma` every `every` steps (PyTorch's StepLR).
struct step_decay {
  /// Steps between two decays.
  std::uint64_t every = 1;
  /// The factor applied at each decay.
  double gamma = 0.1;
  /// The rate `s` steps after warmup.
  double operator()(double target_lr, std::uint64_t s) const {
    detail::require(every > 0, "step_decay: expected every > 0, found 0");
    return target_lr * std::pow(gamma, static_cast<double>(s / every));
  }
};

/// After warmup: straight down from the target rate to `end_lr` over `steps` steps, then
/// `end_lr` (the decay of Hugging Face's get_linear_schedule_with_warmup).
struct linear_decay {
  /// Steps from the target rate to `end_lr`.
  std::uint64_t steps = 1;
  /// The rate at the end.
  double end_lr = 0.0;
  /// The rate `s` steps after warmup.
  double operator()(double target_lr, std::uint64_t s) const {
    detail::require(steps > 0, "linear_decay: expected steps > 0, found 0");
    double const f = static_cast<double>(std::min(s, steps)) / static_cast<double>(steps);
    return target_lr + (end_lr - target_lr) * f;
  }
};

/// After warmup: half a cosine from the target rate to `min_lr` over `steps` steps, then
/// `min_lr` (PyTorch's CosineAnnealingLR with T_max = steps, without restarts).
struct cosine_decay {
  /// Steps from the target rate to `min_lr`.
  std::uint64_t steps = 1;
  /// The rate at the end.
  double min_lr = 0.0;
  /// The rate `s` steps after warmup.
  double operator()(double target_lr, std::uint64_t s) const {
    detail::require(steps > 0, "cosine_decay: expected steps > 0, found 0");
    double const f = static_cast<double>(std::min(s, steps)) / static_cast<double>(steps);
    return min_lr + (target_lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * f));
  }
};

/// What a warmup_schedule calls after warmup: rate = decay(target_lr, steps since warmup ended).
template <class D>
concept lr_decay = std::copy_constructible<D> && requires(D const& d, double lr, std::uint64_t s) {
  { d(lr, s) } -> std::convertible_to<double>;
};

/// Linear warmup from start_lr to target_lr over warmup_steps steps, then `decay`. A callable:
/// schedule(step) is the rate for the update after `step` updates.
template <lr_decay Decay = constant_lr>
class warmup_schedule {
 public:
  /// Rises linearly from `start_lr` to `target_lr` over `warmup_steps`, then follows `decay`.
  warmup_schedule(double target_lr, std::uint64_t warmup_steps, Decay decay = {}, double start_lr = 0.0)
      : target_lr_(target_lr), warmup_steps_(warmup_steps), start_lr_(start_lr), decay_(std::move(decay)) {
    detail::require_rate(target_lr, "warmup_schedule (target_lr)");
    detail::require_rate(start_lr, "warmup_schedule (start_lr)");
  }

  /// The learning rate of the update that follows `step` updates.
  [[nodiscard]] double operator()(std::uint64_t step) const {
    if (step < warmup_steps_) return warmup_lr(step, target_lr_, warmup_steps_, start_lr_);
    return static_cast<double>(decay_(target_lr_, step - warmup_steps_));
  }

  /// The rate reached at the end of warmup.
  [[nodiscard]] double target_lr() const noexcept { return target_lr_; }
  /// Number of warmup steps.
  [[nodiscard]] std::uint64_t warmup_steps() const noexcept { return warmup_steps_; }
  /// The rate at step 0.
  [[nodiscard]] double start_lr() const noexcept { return start_lr_; }
  /// The decay applied after warmup.
  [[nodiscard]] Decay const& decay() const noexcept { return decay_; }

 private:
  double target_lr_;
  std::uint64_t warmup_steps_;
  double start_lr_;
  Decay decay_;
};

DPARALLEL_NAMESPACE_END

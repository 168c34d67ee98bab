#pragma once
// Dynamic loss scaling for 16-bit training, torch.amp.GradScaler's algorithm and defaults.
//
//   dparallel::optim::grad_scaler scaler;                 // scale 2^16, x2 every 2000 good steps, x0.5 on inf/NaN
//   ddp.step(batch, [&](model& m, auto shard) {
//     float loss = m.forward(shard);
//     m.backward(scaler.scale(1.0f));                     // the gradient of scale x loss
//     return loss;
//   });
//   scaler.unscale(opt, ddp);                             // optional: before clipping
//   dparallel::optim::clip_grad_norm(ddp, 1.0);
//   bool const stepped = scaler.step(opt, ddp, lr);       // skipped when a gradient is inf or NaN
//   scaler.update();                                      // the next step's scale
//
// The algorithm, step by step as PyTorch's. The scale is an f32 number. unscale multiplies every
// gradient by the f32 inverse of the scale (1 / scale computed in f64, rounded to f32; a gradient
// is left as is when that inverse is 1) and records whether any gradient element was inf or NaN
// before the multiplication ("found inf"). step() unscales first when unscale() was not called
// since the last update(), then runs the optimizer's step unless found inf. update(): after a step
// that found inf, scale <- f32(scale x backoff_factor) and the count of good steps restarts at 0;
// otherwise the count grows, and when it reaches growth_interval, scale <- f32(scale x
// growth_factor) if that is finite, and the count restarts.
//
// Where the gradients are. One device, DP (the master's reduced gradients) and DDP (every rank
// holds the same reduced gradients, so every rank finds the same and skips the same steps, with no
// communication): unscale(opt, model_or_wrapper). ZeRO-1 (a ddp_zero1 wrapper with a
// zero_redundancy_optimizer): each rank holds only its shard of the reduced gradient, so found-inf
// is combined over the wrapper's group (one all-reduce of one number) and every rank skips the
// same steps; a skipped step consumes the shards (zero_redundancy_optimizer::skip).
//
// Gradients in host memory, f32, f64 or bf16 (bf16 has f32's exponent range: unscaling by a power of
// two is exact, so bf16 parameters with F32 master weights train); f16 gradients are refused, as
// PyTorch refuses them (unscaled in f16 their small values are lost). The state (scale and the count of good steps) goes into checkpoints:
// add_to(ckpt, scaler), so a resumed run scales, skips and grows exactly as an uninterrupted one.
#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/optim/element.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// grad_scaler's settings: PyTorch's defaults.
struct grad_scaler_options {
  /// The first scale (2^16).
  double init_scale = 65536.0;
  /// The factor the scale grows by after growth_interval steps without inf or NaN (> 1).
  double growth_factor = 2.0;
  /// The factor the scale shrinks by after a step with inf or NaN (in (0, 1)).
  double backoff_factor = 0.5;
  /// Steps without inf or NaN before the scale grows (>= 1).
  std::int64_t growth_interval = 2000;
  /// false: scale() returns the loss as it is, step() always steps, update() does nothing.
  bool enabled = true;
};

/// Dynamic loss scaling (see the top of optim/grad_scaler.hpp).
class grad_scaler {
 public:
  /// Throws invalid_argument for settings PyTorch refuses or that cannot work (a scale that is
  /// not a finite positive f32, growth_factor <= 1, backoff_factor outside (0, 1), growth_interval < 1).
  explicit grad_scaler(grad_scaler_options o = {}) : opts_(o), scale_(static_cast<float>(o.init_scale)) {
    auto const bad = [](std::string const& what) { throw invalid_argument("dparallel: optim::grad_scaler: " + what); };
    if (!(std::isfinite(scale_) && scale_ > 0))
      bad("expected init_scale finite and > 0 as an f32, found " + detail::shortest(o.init_scale));
    if (!(o.growth_factor > 1) || !std::isfinite(o.growth_factor))
      bad("expected growth_factor > 1, found " + detail::shortest(o.growth_factor));
    if (!(o.backoff_factor > 0 && o.backoff_factor < 1))
      bad("expected backoff_factor in (0, 1), found " + detail::shortest(o.backoff_factor));
    if (o.growth_interval < 1) bad("expected growth_interval >= 1, found " + std::to_string(o.growth_interval));
  }

  /// The current scale (1 when disabled).
  [[nodiscard]] float scale() const noexcept { return opts_.enabled ? scale_ : 1.0f; }
  /// `loss` times the scale, in the loss's own type (float: an f32 product, as PyTorch's).
  template <class T>
    requires std::is_floating_point_v<T>
  [[nodiscard]] T scale(T loss) const noexcept {
    return opts_.enabled ? loss * static_cast<T>(scale_) : loss;
  }
  /// Steps without inf or NaN since the scale last changed (PyTorch's growth tracker).
  [[nodiscard]] std::int64_t good_steps() const noexcept { return good_steps_; }
  /// Whether this step's gradients held inf or NaN (after unscale or step; false before).
  [[nodiscard]] bool found_inf() const noexcept { return found_inf_; }
  /// The settings.
  [[nodiscard]] grad_scaler_options const& options() const noexcept { return opts_; }

  /// Unscales the gradients `grads` (host memory, f32, f64 or bf16) of this step in place and records
  /// whether any was inf or NaN; returns that. Once per step: a second call before update() throws.
  bool unscale(std::span<tensor_ref const> grads) {
    begin_unscale("unscale");
    if (!opts_.enabled) return false;
    found_inf_ = unscale_local(grads);
    return found_inf_;
  }
  /// The same for the gradients `opt` will step from: a model's, a DP wrapper's master, a DDP rank's
  /// replica (no communication); under ZeRO-1, this rank's gradient shards, with found-inf
  /// combined over the wrapper's group (a collective: every rank calls it).
  template <class Opt, class X>
  bool unscale(Opt& opt, X& model_or_wrapper) {
    begin_unscale("unscale");
    if (!opts_.enabled) return false;
    if constexpr (detail::shards_gradients<X>) {
      bool const mine = unscale_local(opt.gradient_shards());
      float flag = mine ? 1.0f : 0.0f;  // summed over the ranks: exact, and > 0 when any rank found one
      model_or_wrapper.group().all_reduce(tensor_ref(&flag, 1, dtype::f32, host_memory), reduce_op::sum).wait();
      found_inf_ = flag != 0;
    } else {
      auto const grads = gradient_refs(dparallel::detail::unwrap_model(model_or_wrapper));
      found_inf_ = unscale_local(grads);
    }
    return found_inf_;
  }

  /// Unscales if unscale() was not called this step, then `opt.step(model_or_wrapper, lr)` unless
  /// the gradients held inf or NaN (a skipped ZeRO-1 step consumes the shards). Returns whether
  /// the optimizer stepped.
  template <class Opt, class X>
  bool step(Opt& opt, X& model_or_wrapper, double lr) {
    if (!unscaled_) unscale(opt, model_or_wrapper);
    if (opts_.enabled && found_inf_) {
      if constexpr (detail::shards_gradients<X>) opt.skip();
      return false;
    }
    opt.step(model_or_wrapper, lr);
    return true;
  }

  /// The scale for the next step (see the top of optim/grad_scaler.hpp). Throws error when no
  /// unscale() or step() ran since the last update(): nothing says whether the gradients were finite.
  void update() {
    if (!opts_.enabled) return;
    if (!unscaled_)
      throw error("dparallel: optim::grad_scaler::update: no unscale() or step() since the last update(), so "
                  "nothing says whether this step's gradients were finite; call scaler.step(opt, model, lr) first");
    if (found_inf_) {
      scale_ = static_cast<float>(static_cast<double>(scale_) * opts_.backoff_factor);
      good_steps_ = 0;
    } else if (++good_steps_ == opts_.growth_interval) {
      auto const grown = static_cast<float>(static_cast<double>(scale_) * opts_.growth_factor);
      if (std::isfinite(grown)) scale_ = grown;
      good_steps_ = 0;
    }
    unscaled_ = found_inf_ = false;
  }
  /// Sets the scale (PyTorch's update(new_scale)); the count of good steps is kept.
  void update(float new_scale) {
    if (!(std::isfinite(new_scale) && new_scale > 0))
      throw invalid_argument("dparallel: optim::grad_scaler::update: expected a finite scale > 0, found " +
                             detail::shortest(new_scale));
    scale_ = new_scale;
    unscaled_ = found_inf_ = false;
  }

  /// The state as named tensors ("grad_scaler.scale", f32 [1]; "grad_scaler.good_steps", i64 [1]),
  /// views of this scaler's memory.
  [[nodiscard]] std::vector<named_tensor> state_dict() {
    return {{"grad_scaler.scale", tensor_ref(&scale_, 1, dtype::f32, host_memory), std::vector<std::uint64_t>{1}},
            {"grad_scaler.good_steps", tensor_ref(&good_steps_, 1, dtype::i64, host_memory),
             std::vector<std::uint64_t>{1}}};
  }

 private:
  void begin_unscale(char const* who) {
    if (unscaled_)
      throw error(std::string("dparallel: optim::grad_scaler::") + who +
                  ": the gradients were already unscaled since the last update(); unscale once per step, then "
                  "step() and update()");
    unscaled_ = true;
  }

  // Multiplies by the f32 inverse of the scale (unless it is 1); whether any element was not finite.
  [[nodiscard]] bool unscale_local(std::span<tensor_ref const> grads) const {
    auto const inv = static_cast<float>(1.0 / static_cast<double>(scale_));
    bool found = false;
    for (auto const& g : grads) {
      if (g.device().kind != device_kind::host)
        throw invalid_argument("dparallel: optim::grad_scaler: a gradient is in " + to_string(g.device()) +
                               " memory; the scaler handles host memory");
      if (g.dtype() == dtype::f32) {
        for (float& x : g.as<float>()) {
          found |= !std::isfinite(x);
          if (inv != 1.0f) x = detail::mul(x, inv);
        }
      } else if (g.dtype() == dtype::f64) {
        for (double& x : g.as<double>()) {
          found |= !std::isfinite(x);
          if (inv != 1.0f) x *= static_cast<double>(inv);
        }
      } else if (g.dtype() == dtype::bf16) {
        // bf16 has f32's exponent range: x * inv is the f32 product rounded to bf16 (exact for a
        // power-of-two scale down to 2^-126), so bf16 parameters with F32 master weights train.
        for (bf16& x : g.as<bf16>()) {
          float const v = static_cast<float>(x);
          found |= !std::isfinite(v);
          if (inv != 1.0f) x = bf16(detail::mul(v, inv));
        }
      } else {
        throw invalid_argument("dparallel: optim::grad_scaler: expected F32, F64 or BF16 gradients, found " +
                               std::string(name_of(g.dtype())) +
                               " (F16 gradients lose their small values when unscaled in F16, which is why PyTorch "
                               "refuses them too: keep F32 gradients, or use BF16)");
      }
    }
    return found;
  }

  grad_scaler_options opts_;
  float scale_;
  std::int64_t good_steps_ = 0;
  bool unscaled_ = false;   // unscale() or step() ran since the last update()
  bool found_inf_ = false;  // this step's gradients held inf or NaN
};

/// Registers the scaler's state with `ckpt` (its scale and count of good steps): saved and loaded
/// with the model. The tensors are views of the scaler: `scaler` must outlive `ckpt`.
inline void add_to(checkpoint& ckpt, grad_scaler& scaler) {
  for (auto& t : scaler.state_dict()) ckpt.add(std::move(t.name), t.data, std::move(t.shape));
}

}  // namespace optim

DPARALLEL_NAMESPACE_END

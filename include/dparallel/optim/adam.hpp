#pragma once
// optim::adam and optim::adamw: torch.optim.Adam and torch.optim.AdamW (1.13, amsgrad off,
// maximize off), element by element and in the same order of operations as PyTorch's
// single-tensor implementation:
//
//   p = p * (1 - lr * weight_decay)                             (AdamW: decoupled decay)
//   g = g + weight_decay * p                                    (Adam: L2, when weight_decay != 0)
//   m = m * beta1 + (1 - beta1) * g
//   v = v * beta2 + ((1 - beta2) * g) * g
//   denom = sqrt(v) / sqrt(1 - beta2^t) + eps                   (eps outside the square root)
//   p = p + ((-lr / (1 - beta1^t)) * m) / denom
//
// The scalars (the bias corrections 1 - beta^t, their square root, lr / (1 - beta1^t),
// 1 - lr * weight_decay) are computed in double once per step and rounded to f32, as PyTorch
// passes Python floats to its f32 kernels. Defaults are PyTorch's: lr 1e-3 (default_lr), betas
// (0.9, 0.999), eps 1e-8, weight_decay 0 for Adam and 1e-2 for AdamW.
//
//   dparallel::optim::optimizer opt(model, dparallel::optim::adamw({.weight_decay = 0.1}));
//   opt.step(model, 3e-4);
//
// Slots: "exp_avg" (m) and "exp_avg_sq" (v), PyTorch's names.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/optim/element.hpp>
#include <dparallel/optim/rule.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// Hyperparameters of optim::adam and optim::adamw (PyTorch's names and defaults; the learning
/// rate is given per step).
struct adam_options {
  double beta1 = 0.9;    ///< decay of the first moment, in [0, 1)
  double beta2 = 0.999;  ///< decay of the second moment, in [0, 1)
  double eps = 1e-8;     ///< added to the denominator, outside the square root
  /// Adam: L2 penalty added to the gradient (default 0); AdamW: decoupled decay (default 1e-2).
  std::optional<double> weight_decay;
};

/// Adam (Decoupled = false: weight decay as an L2 term of the gradient) and AdamW (true: the
/// parameter shrinks by lr * weight_decay before the update). See the top of optim/adam.hpp.
template <bool Decoupled>
class adam_rule {
 public:
  /// Two slots: the first and the second moment.
  static constexpr std::size_t slot_count = 2;
  /// The slots' names in state dicts and checkpoints (PyTorch's).
  static constexpr std::array<std::string_view, 2> slot_names{"exp_avg", "exp_avg_sq"};
  /// The rule's name in saved optimizer state.
  static constexpr std::string_view name = Decoupled ? "adamw" : "adam";
  /// PyTorch's default learning rate (optimizer::step without a rate uses it).
  static constexpr double default_lr = 1e-3;

  /// The scalars of one step, in f32 as PyTorch applies them to f32 tensors.
  struct step_constants {
    float decay = 1;            ///< AdamW: 1 - lr * weight_decay
    float l2 = 0;               ///< Adam: weight_decay (0: no term)
    float beta1 = 0;            ///< beta1
    float one_minus_beta1 = 0;  ///< 1 - beta1
    float beta2 = 0;            ///< beta2
    float one_minus_beta2 = 0;  ///< 1 - beta2
    float bc2_sqrt = 1;         ///< sqrt(1 - beta2^step)
    float eps = 0;              ///< eps
    float neg_step_size = 0;    ///< -lr / (1 - beta1^step)
  };

  /// PyTorch's defaults.
  adam_rule() : adam_rule(adam_options{}) {}
  /// The rule with `o`; throws invalid_argument for betas outside [0, 1) and a negative eps or
  /// weight decay (as PyTorch does).
  explicit adam_rule(adam_options o) : o_(o) {
    if (!o_.weight_decay) o_.weight_decay = Decoupled ? 1e-2 : 0.0;
    std::string const who = "optim::" + std::string(name);
    check_beta(o_.beta1, who + ": beta1");
    check_beta(o_.beta2, who + ": beta2");
    detail::require_non_negative(o_.eps, who + ": eps");
    detail::require_non_negative(*o_.weight_decay, who + ": weight_decay");
  }

  /// The hyperparameters (weight_decay filled in with the rule's default when it was not given).
  [[nodiscard]] adam_options const& options() const noexcept { return o_; }

  /// The constants of update number `step` (1 for the first) at learning rate `lr` (finite, >= 0).
  [[nodiscard]] step_constants constants(std::uint64_t step, double lr) const {
    detail::require_non_negative(lr, Decoupled ? "optim::adamw: the learning rate" : "optim::adam: the learning rate");
    if (step == 0)
      throw invalid_argument("dparallel: optim::" + std::string(name) +
                             ": expected a step number >= 1 (the first update is step 1), found 0");
    double const wd = *o_.weight_decay;
    double const t = static_cast<double>(step);
    double const bc1 = 1 - std::pow(o_.beta1, t);
    double const bc2 = 1 - std::pow(o_.beta2, t);
    step_constants c;
    c.decay = Decoupled ? static_cast<float>(1 - lr * wd) : 1.0F;
    c.l2 = Decoupled ? 0.0F : static_cast<float>(wd);
    c.beta1 = static_cast<float>(o_.beta1);
    c.one_minus_beta1 = static_cast<float>(1 - o_.beta1);
    c.beta2 = static_cast<float>(o_.beta2);
    c.one_minus_beta2 = static_cast<float>(1 - o_.beta2);
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    c.eps = static_cast<float>(o_.eps);
    c.neg_step_size = static_cast<float>(-(lr / bc1));
    return c;
  }

  /// One element (see optim/element.hpp): p, its gradient g, m = s[0][i], v = s[1][i].
  static DPARALLEL_HOST_DEVICE void update(step_constants const& c, float& p, float g, float* const* s,
                                           std::size_t i) {
    namespace fp = dparallel::optim::detail;
    if constexpr (Decoupled) p = fp::mul(p, c.decay);
    else if (c.l2 != 0) g = fp::add(g, fp::mul(c.l2, p));
    float& m = s[0][i];
    float& v = s[1][i];
    m = fp::add(fp::mul(m, c.beta1), fp::mul(c.one_minus_beta1, g));
    v = fp::add(fp::mul(v, c.beta2), fp::mul(fp::mul(c.one_minus_beta2, g), g));
    float const denom = fp::add(fp::div(fp::sqrt(v), c.bc2_sqrt), c.eps);
    p = fp::add(p, fp::div(fp::mul(c.neg_step_size, m), denom));
  }

  /// The update over a stretch of elements (the update_rule interface).
  void apply(step_constants const& c, std::span<float> p, std::span<float const> g, std::span<float* const> s) const {
    apply_elements<adam_rule>(c, p, g, s);
  }

 private:
  static void check_beta(double b, std::string const& what) {
    if (!(b >= 0 && b < 1))
      throw invalid_argument("dparallel: " + what + ": expected a value in [0, 1), found " + detail::shortest(b));
  }

  adam_options o_;
};

/// torch.optim.Adam: weight decay as an L2 term added to the gradient (default 0).
using adam = adam_rule<false>;
/// torch.optim.AdamW: decoupled weight decay, p *= 1 - lr * weight_decay (default 1e-2).
using adamw = adam_rule<true>;

static_assert(element_rule<adam>);
static_assert(element_rule<adamw>);

}  // namespace optim

DPARALLEL_NAMESPACE_END

#pragma once
// optim::sgd: stochastic gradient descent with PyTorch's torch.optim.SGD update (1.13), element
// by element and in the same order of operations:
//
//   d = g + weight_decay * p                                   (when weight_decay != 0)
//   b = d                                                       (first step: no dampening)
//   b = momentum * b + (1 - dampening) * d                      (later steps)
//   d = nesterov ? d + momentum * b : b                         (when momentum != 0)
//   p = p + (-lr) * d
//
//   dparallel::optim::optimizer opt(model, dparallel::optim::sgd({.momentum = 0.9, .nesterov = true}));
//   opt.step(model, 0.1);
//
// The one slot is the momentum buffer ("momentum_buffer", PyTorch's name); with momentum 0 the
// rule keeps none (active_slots() is 0), as PyTorch keeps none.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/optim/element.hpp>
#include <dparallel/optim/rule.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// Hyperparameters of optim::sgd (PyTorch's names and defaults; the learning rate is given per step).
struct sgd_options {
  double momentum = 0;      ///< momentum factor (0: plain SGD, no buffer)
  double dampening = 0;     ///< dampening of the momentum (not applied on the first step)
  double weight_decay = 0;  ///< L2 penalty, added to the gradient
  bool nesterov = false;    ///< Nesterov momentum (needs momentum > 0 and dampening 0)
};

/// SGD with momentum, dampening, Nesterov momentum and weight decay: torch.optim.SGD's rule (see
/// the top of optim/sgd.hpp).
class sgd {
 public:
  /// One slot: the momentum buffer.
  static constexpr std::size_t slot_count = 1;
  /// The slot's name in state dicts and checkpoints (PyTorch's).
  static constexpr std::array<std::string_view, 1> slot_names{"momentum_buffer"};
  /// The rule's name in saved optimizer state.
  static constexpr std::string_view name = "sgd";

  /// The scalars of one step, in f32 as PyTorch applies them to f32 tensors.
  struct step_constants {
    float neg_lr = 0;               ///< -lr
    float weight_decay = 0;         ///< 0: no decay term
    float momentum = 0;             ///< 0: no buffer
    float one_minus_dampening = 1;  ///< 1 - dampening
    bool first = true;              ///< the first step: the buffer becomes the gradient
    bool nesterov = false;          ///< Nesterov momentum
  };

  /// Plain SGD (lr only).
  sgd() = default;
  /// SGD with `o`; throws invalid_argument for negative momentum, dampening or weight decay, and
  /// for Nesterov without momentum or with dampening (as PyTorch does).
  explicit sgd(sgd_options o) : o_(o) {
    detail::require_non_negative(o.momentum, "optim::sgd: momentum");
    detail::require_non_negative(o.dampening, "optim::sgd: dampening");
    detail::require_non_negative(o.weight_decay, "optim::sgd: weight_decay");
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      throw invalid_argument("dparallel: optim::sgd: Nesterov momentum requires a momentum > 0 and zero dampening, "
                             "found momentum " + detail::shortest(o.momentum) + " and dampening " +
                             detail::shortest(o.dampening));
  }

  /// The hyperparameters.
  [[nodiscard]] sgd_options const& options() const noexcept { return o_; }
  /// 1 with momentum, 0 without (then no buffer is kept).
  [[nodiscard]] std::size_t active_slots() const noexcept { return o_.momentum != 0 ? 1 : 0; }

  /// The constants of update number `step` (1 for the first) at learning rate `lr` (finite, >= 0).
  [[nodiscard]] step_constants constants(std::uint64_t step, double lr) const {
    detail::require_non_negative(lr, "optim::sgd: the learning rate");
    step_constants c;
    c.neg_lr = static_cast<float>(-lr);
    c.weight_decay = static_cast<float>(o_.weight_decay);
    c.momentum = static_cast<float>(o_.momentum);
    c.one_minus_dampening = static_cast<float>(1 - o_.dampening);
    c.first = step <= 1;
    c.nesterov = o_.nesterov;
    return c;
  }

  /// One element (see optim/element.hpp): p, its gradient g, the momentum buffer s[0][i].
  static DPARALLEL_HOST_DEVICE void update(step_constants const& c, float& p, float g, float* const* s,
                                           std::size_t i) {
    namespace fp = dparallel::optim::detail;
    float d = g;
    if (c.weight_decay != 0) d = fp::add(d, fp::mul(c.weight_decay, p));
    if (c.momentum != 0) {
      float& b = s[0][i];
      b = c.first ? d : fp::add(fp::mul(b, c.momentum), fp::mul(c.one_minus_dampening, d));
      d = c.nesterov ? fp::add(d, fp::mul(c.momentum, b)) : b;
    }
    p = fp::add(p, fp::mul(c.neg_lr, d));
  }

  /// The update over a stretch of elements (the update_rule interface): update()'s operations, in
  /// a loop chosen for the step's case (decay or not, momentum or not, first step, Nesterov), so
  /// that no test is left inside it.
  void apply(step_constants const& c, std::span<float> p, std::span<float const> g, std::span<float* const> s) const {
    float* const b = c.momentum != 0 ? s[0] : nullptr;
    if (b == nullptr) return decayed<false, false, false>(c, p, g, b);
    if (c.first) return c.nesterov ? decayed<true, true, true>(c, p, g, b) : decayed<true, true, false>(c, p, g, b);
    return c.nesterov ? decayed<true, false, true>(c, p, g, b) : decayed<true, false, false>(c, p, g, b);
  }

 private:
  template <bool Momentum, bool First, bool Nesterov>
  static void decayed(step_constants const& c, std::span<float> p, std::span<float const> g, float* b) {
    if (c.weight_decay != 0) run<true, Momentum, First, Nesterov>(c, p.data(), g.data(), b, p.size());
    else run<false, Momentum, First, Nesterov>(c, p.data(), g.data(), b, p.size());
  }
  // update() for one case, over n elements; c is a copy, so stores through p cannot change it.
  template <bool Decay, bool Momentum, bool First, bool Nesterov>
  static void run(step_constants const c, float* p, float const* g, float* b, std::size_t n) {
    namespace fp = dparallel::optim::detail;
    for (std::size_t i = 0; i < n; ++i) {
      float d = g[i];
      if constexpr (Decay) d = fp::add(d, fp::mul(c.weight_decay, p[i]));
      if constexpr (Momentum) {
        if constexpr (First) b[i] = d;
        else b[i] = fp::add(fp::mul(b[i], c.momentum), fp::mul(c.one_minus_dampening, d));
        if constexpr (Nesterov) d = fp::add(d, fp::mul(c.momentum, b[i]));
        else d = b[i];
      }
      p[i] = fp::add(p[i], fp::mul(c.neg_lr, d));
    }
  }

  sgd_options o_{};
};

static_assert(element_rule<sgd>);

}  // namespace optim

DPARALLEL_NAMESPACE_END

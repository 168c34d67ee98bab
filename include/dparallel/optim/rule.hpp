#pragma once
// The seam between an optimizer's arithmetic and where its state lives.
//
// Every optimizer dparallel ships is elementwise: the new value of parameter element i depends
// only on element i of the parameter, of its gradient and of each state slot, and on a few
// scalars fixed for the whole step (the learning rate, bias corrections, whether this is the
// first step). An `update_rule` is that arithmetic and nothing else. One rule then serves
//   - an optimizer over a model's whole tensors (single device, DP, DDP),
//   - a rank's shard of a flat bucket (ZeRO-1: each rank holds 1/N of the state),
//   - a CUDA kernel doing the same operations in the same order,
// and since the arithmetic per element is the same everywhere, the results are the same bits.
//
//   R::slot_count             number of f32 state values per parameter element (0, 1, 2, ...)
//   R::slot_names             their names, as checkpoints spell them ("exp_avg", "exp_avg_sq")
//   r.constants(step, lr)     the per-step scalars for update number `step` (1 for the first)
//   r.apply(c, p, g, s)       updates p[i] and s[k][i] for every i < p.size(), where s[k] points
//                             at the slot-k values that belong to p's elements

#include <dparallel/config.hpp>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// An elementwise optimizer update (see the top of optim/rule.hpp): per-step constants from
/// `constants(step, lr)`, then `apply` over any contiguous stretch of parameters, gradients and
/// the matching stretch of each state slot.
template <class R>
concept update_rule =
    requires(R const& r, std::uint64_t step, double lr, std::span<float> p, std::span<float const> g,
             std::span<float* const> s) {
      { R::slot_count } -> std::convertible_to<std::size_t>;
      { R::slot_names } -> std::convertible_to<std::array<std::string_view, R::slot_count>>;
      typename R::step_constants;
      { r.constants(step, lr) } -> std::same_as<typename R::step_constants>;
      { r.apply(r.constants(step, lr), p, g, s) } -> std::same_as<void>;
    };

}  // namespace optim

DPARALLEL_NAMESPACE_END

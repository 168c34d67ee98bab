#pragma once
// The per-element form of an update rule, shared by the host loop and the CUDA kernels.
//
// A rule that satisfies `element_rule` writes its arithmetic once, as
//   static void update(step_constants const& c, float& p, float g, float* const* s, std::size_t i)
// (one parameter element p, its gradient g, and s[k][i], the element's value of slot k). Its
// `apply` is then `optim::apply_elements(c, p, g, s)` (a loop over i), and the CUDA kernel in
// optim/cuda/kernels.hpp calls the same `update` once per thread. Every operation goes
// through the functions below: on the device they are the round-to-nearest intrinsics, which
// nvcc never fuses into a multiply-add, so host and device compute the same operations in the
// same order and give the same bits. (The host side assumes the compiler does not contract
// a*b+c either: true for x86-64 builds without -mfma / -march=native; otherwise compile with
// -ffp-contract=off.)

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/optim/rule.hpp>

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

namespace detail {
/// The shortest decimal that reads back as `v` (for error messages: 1e-09, not 0.000000).
inline std::string shortest(double v) {
  char buf[32];
  auto const r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

/// a * b, rounded once (never fused with a following addition).
DPARALLEL_HOST_DEVICE float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
/// a + b, rounded once.
DPARALLEL_HOST_DEVICE float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
/// a / b, IEEE division.
DPARALLEL_HOST_DEVICE float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
/// The correctly rounded square root.
DPARALLEL_HOST_DEVICE float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

/// Throws invalid_argument unless `value` is finite and >= 0 (PyTorch's checks of lr, momentum,
/// weight_decay and eps): `what` names the rule and the hyperparameter.
inline void require_non_negative(double value, std::string_view what) {
  if (!(std::isfinite(value) && value >= 0))
    throw invalid_argument("dparallel: " + std::string(what) + ": expected a finite value >= 0, found " +
                           shortest(value));
}
/// A wrapper whose reduction leaves each rank only a shard of the averaged gradients (ZeRO-1:
/// its reduce policy says so with `shards_gradients`).
template <class X>
inline constexpr bool shards_gradients = requires { requires X::reduce_type::shards_gradients; };

}  // namespace detail

/// An update_rule whose arithmetic is written once per element (see the top of optim/element.hpp),
/// so that the CUDA kernels can run it too.
template <class R>
concept element_rule = update_rule<R> && requires(typename R::step_constants const& c, float& p, float g,
                                                  float* const* s, std::size_t i) {
  { R::update(c, p, g, s, i) } -> std::same_as<void>;
};

namespace detail {
/// R::slot_count, at least 1 (the size of an array of slot pointers).
template <class R>
inline constexpr std::size_t slot_array_size = R::slot_count == 0 ? 1 : R::slot_count;
}  // namespace detail

/// The host loop of an element rule: R::update for every element of `p`.
template <class R>
void apply_elements(typename R::step_constants const& c, std::span<float> p, std::span<float const> g,
                    std::span<float* const> s) {
  // Local copies: a store through p cannot then change the constants or the slot pointers, so
  // the compiler may hoist the rule's tests out of the loop (and vectorise what is left).
  typename R::step_constants const k = c;
  float* slots[detail::slot_array_size<R>] = {};
  for (std::size_t j = 0; j < s.size() && j < detail::slot_array_size<R>; ++j) slots[j] = s[j];
  float* const pv = p.data();
  float const* const gv = g.data();
  std::size_t const n = p.size();
  for (std::size_t i = 0; i < n; ++i) R::update(k, pv[i], gv[i], slots, i);
}

/// How many of R's slots `r` uses: r.active_slots() when R declares it (plain SGD keeps no
/// momentum buffer), else R::slot_count. Slots from this index on need no storage: the rule never
/// reads nor writes them, and optimizers pass null pointers for them.
template <update_rule R>
std::size_t active_slots(R const& r) {
  if constexpr (requires {
                  { r.active_slots() } -> std::convertible_to<std::size_t>;
                }) {
    return r.active_slots();
  } else {
    return R::slot_count;
  }
}

}  // namespace optim

DPARALLEL_NAMESPACE_END

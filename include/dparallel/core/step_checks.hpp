#pragma once
// Compile-time checks of the step function given to parallel::step(), each with a message that
// says what is wrong and what to write instead:
// - it must be callable as f(Model&, Shard, step_context&) or f(Model&, Shard);
// - it must take the model by reference: a by-value model trains a copy, and the gradient it
//   writes is lost;
// - the shard arrives as an rvalue (a fresh slice of the batch): a non-const lvalue reference
//   parameter cannot bind it.

#include <dparallel/config.hpp>
#include <dparallel/core/step_context.hpp>

#include <concepts>
#include <type_traits>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

template <class F, class M, class S>
concept step_with_context = std::invocable<F&, M&, S, step_context&>;
template <class F, class M, class S>
concept step_without_context = std::invocable<F&, M&, S>;

template <class F, class M, class S>
struct step_result {
  using type = std::invoke_result_t<F&, M&, S>;
};
template <class F, class M, class S>
  requires step_with_context<F, M, S>
struct step_result<F, M, S> {
  using type = std::invoke_result_t<F&, M&, S, step_context&>;
};

/// The first parameter of a call operator or function pointer type (void when unknown).
template <class T>
struct first_parameter {
  using type = void;
};
template <class R, class A, class... As>
struct first_parameter<R (*)(A, As...)> {
  using type = A;
};
template <class R, class A, class... As>
struct first_parameter<R (*)(A, As...) noexcept> {
  using type = A;
};
template <class R, class C, class A, class... As>
struct first_parameter<R (C::*)(A, As...)> {
  using type = A;
};
template <class R, class C, class A, class... As>
struct first_parameter<R (C::*)(A, As...) const> {
  using type = A;
};
template <class R, class C, class A, class... As>
struct first_parameter<R (C::*)(A, As...) noexcept> {
  using type = A;
};
template <class R, class C, class A, class... As>
struct first_parameter<R (C::*)(A, As...) const noexcept> {
  using type = A;
};

/// The type of the step function's model parameter where it can be read: a function pointer, a
/// lambda or function object with one call operator, or a generic lambda instantiated for the
/// model and the shard (its `auto m` becomes M, its `auto& m` M&). void when it cannot be read.
template <class F, class M, class S>
struct model_parameter {
  using type = void;
};
template <class F, class M, class S>
  requires std::is_pointer_v<F>
struct model_parameter<F, M, S> {
  using type = typename first_parameter<F>::type;
};
template <class F, class M, class S>
  requires(!std::is_pointer_v<F> && requires { &F::operator(); })
struct model_parameter<F, M, S> {
  using type = typename first_parameter<decltype(&F::operator())>::type;
};
// A generic lambda is inspected only when it is called with two arguments and has exactly two
// template parameters (`[](auto m, auto shard)`): they can only be the model's and the shard's.
// With one template parameter (`[](Model& m, auto shard)`) or a context parameter, naming the
// call operator's specialisation would bind the wrong parameter and instantiate the body with a
// wrong type (a hard error), so those are left to the call itself.
template <class F, class M, class S>
  requires(!std::is_pointer_v<F> && !requires { &F::operator(); } && std::invocable<F&, M&, S> &&
           requires { &F::template operator()<M, S>; })
struct model_parameter<F, M, S> {
  using type = typename first_parameter<decltype(&F::template operator()<M, S>)>::type;
};

/// True when the step function visibly takes the model by value.
template <class F, class M, class S>
inline constexpr bool takes_model_by_value = std::is_same_v<typename model_parameter<F, M, S>::type, M>;

/// Compile-time check of a step function; used by parallel::step(). False when a static_assert
/// fired, so that the caller can stop before follow-on errors.
template <class F, class M, class S>
constexpr bool check_step_function() {
  constexpr bool callable = step_with_context<F, M, S> || step_without_context<F, M, S>;
  constexpr bool lvalue_shard = std::invocable<F&, M&, S&, step_context&> || std::invocable<F&, M&, S&>;
  static_assert(callable || !lvalue_shard,
                "dparallel: the step function takes the shard by non-const reference, but the shard arrives as an "
                "rvalue (a fresh slice of the batch): take it by value (`Shard shard`, cheap: a view) or by const& "
                "(`Shard const& shard`)");
  static_assert(callable || lvalue_shard,
                "dparallel: the step function must be callable as f(Model&, Shard, dparallel::step_context&) or "
                "f(Model&, Shard), Shard being the batch's slice type");
  static_assert(!takes_model_by_value<F, M, S>,
                "dparallel: the step function takes the model by value: it would train a copy and its gradient would "
                "be lost; take the model by reference: `[](Model& m, Shard shard) { ... }`");
  return callable && !takes_model_by_value<F, M, S>;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

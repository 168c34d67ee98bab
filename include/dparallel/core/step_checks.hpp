#pragma once
// Compile-time checks of the step function given to parallel::step(), each with a message that
// says what is wrong and what to write instead:
// - it must be callable as f(Model&, Shard, step_context&) or f(Model&, Shard);
// - it must take the model by non-const reference: a by-value model trains a copy, and the
//   gradient it writes is lost (a const& one cannot write it);
// - the shard arrives as an rvalue (a fresh slice of the batch): a non-const lvalue reference
//   parameter cannot bind it.

#include <dparallel/config.hpp>
#include <dparallel/core/step_context.hpp>

#include <concepts>
#include <type_traits>
#include <utility>

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

template <class R, class A, class... As>
struct first_parameter<R(A, As...)> {
  using type = A;
};
template <class R, class A, class... As>
struct first_parameter<R(A, As...) noexcept> {
  using type = A;
};

/// The type of the step function's model parameter where it can be read without naming a
/// template: a function, a function pointer, a lambda or function object with one call operator.
/// void when it cannot be read (a generic lambda: see copy_probe below).
template <class F>
struct model_parameter {
  using type = void;
};
template <class F>
  requires(std::is_function_v<F> || std::is_pointer_v<F>)
struct model_parameter<F> {
  using type = typename first_parameter<F>::type;
};
template <class F>
  requires(std::is_class_v<F> && requires { &F::operator(); })
struct model_parameter<F> {
  using type = typename first_parameter<decltype(&F::operator())>::type;
};

// A generic step function (`[](auto m, auto shard)`, `[](Model m, auto shard)`, with or without a
// context) is probed by overload resolution instead, which instantiates nothing new: a class
// derived from it adds a call operator taking `Model const&` (and the same shard and context),
// and is called with exactly the arguments of the real call (Model&, Shard, step_context&), so
// that the step function's candidate is the specialisation the real call instantiates anyway.
// The step function's candidate is better for the model argument only when its parameter is a
// non-const lvalue reference (`Model&`, `auto&`, `auto&&`); a parameter by value or by const&
// ties there, and the probe's own operator (not a template, and non-const, so never worse on
// the object) wins: copy_probe_result comes back. Otherwise the call is ambiguous or returns the
// step function's result.
struct copy_probe_result {};
struct call_operator_marker {
  void operator()();
};
template <class F>
struct call_operator_mix : F, call_operator_marker {};
/// F is a class that can be derived from and names a call operator (template or not): the
/// marker's operator() is then ambiguous in call_operator_mix.
template <class F>
concept probable_step_function =
    std::is_class_v<F> && !std::is_final_v<F> && !requires { &call_operator_mix<F>::operator(); };
template <class F, class M, class S>
struct copy_probe : F {
  using F::operator();
  copy_probe_result operator()(M const&, S);
  copy_probe_result operator()(M const&, S, step_context&);
};

/// True when the step function visibly takes the model by value or by const reference (it would
/// train a copy, or could not write the gradients that the wrapper reduces).
template <class F, class M, class S>
constexpr bool takes_model_by_value() {
  using P = typename model_parameter<F>::type;
  if constexpr (!step_with_context<F, M, S> && !step_without_context<F, M, S>) {
    return false;  // not callable at all: check_step_function says so
  } else if constexpr (!std::is_void_v<P>) {
    return std::is_same_v<std::remove_cvref_t<P>, M> && !std::is_same_v<P, M&>;
  } else if constexpr (!probable_step_function<F>) {
    return false;
  } else if constexpr (step_with_context<F, M, S>) {
    return requires(copy_probe<F, M, S>& f, M& m, step_context& c) {
      { f(m, std::declval<S>(), c) } -> std::same_as<copy_probe_result>;
    };
  } else {
    return requires(copy_probe<F, M, S>& f, M& m) {
      { f(m, std::declval<S>()) } -> std::same_as<copy_probe_result>;
    };
  }
}

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
  constexpr bool by_value = takes_model_by_value<F, M, S>();
  static_assert(!by_value,
                "dparallel: the step function takes the model by value (or by const&): it would train a copy and "
                "its gradient would be lost; take the model by reference: `[](Model& m, Shard shard) { ... }` or "
                "`[](auto& m, auto shard) { ... }`");
  return callable && !by_value;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

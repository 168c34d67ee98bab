#pragma once
// Batches: how dparallel measures and splits the user's batch along its first dimension.
//
// batch_traits<B> gives
//   static std::size_t size(B const&)                 number of samples
//   static auto slice(B const&, size_t first, size_t last)  samples [first, last), cheaply
// Ready specialisations: tensor_view<T> (rows), std::span<T>, std::vector<T> (a slice is a
// std::span<T const>), std::tuple / std::pair of batches, and aggregates (plain structs) of up to
// eight batch members. Specialise batch_traits<B> for anything else.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Primary template: deliberately empty. A batch type without a specialisation (or a supported
/// shape) fails dparallel's check_batch<B>() with a readable message.
template <class B, class = void>
struct batch_traits {};

/// A tensor_view is a batch of rows() samples; slices are views of whole rows.
template <class T>
struct batch_traits<tensor_view<T>> {
  /// Number of samples: the view's rows().
  static std::size_t size(tensor_view<T> const& b) noexcept { return b.rows(); }
  /// Rows [first, last) as a view.
  static tensor_view<T> slice(tensor_view<T> const& b, std::size_t first, std::size_t last) {
    return b.slice_rows(first, last);
  }
};

/// A std::span is a batch of size() samples.
template <class T, std::size_t E>
struct batch_traits<std::span<T, E>> {
  /// Number of samples: the span's size().
  static std::size_t size(std::span<T, E> const& b) noexcept { return b.size(); }
  /// Elements [first, last) as a span.
  static std::span<T> slice(std::span<T, E> const& b, std::size_t first, std::size_t last) {
    return std::span<T>(b).subspan(first, last - first);
  }
};

/// A std::vector is a batch of size() samples; a slice is a std::span of const elements.
template <class T, class A>
struct batch_traits<std::vector<T, A>> {
  /// Number of samples: the vector's size().
  static std::size_t size(std::vector<T, A> const& b) noexcept { return b.size(); }
  /// Elements [first, last) as a std::span<T const>.
  static std::span<T const> slice(std::vector<T, A> const& b, std::size_t first, std::size_t last) {
    return std::span<T const>(b).subspan(first, last - first);
  }
};

/// A type batch_traits knows how to size and slice.
template <class B>
concept batch = requires(B const& b, std::size_t i) {
  { batch_traits<std::remove_cvref_t<B>>::size(b) } -> std::convertible_to<std::size_t>;
  batch_traits<std::remove_cvref_t<B>>::slice(b, i, i);
};

/// Number of samples in `b`.
template <batch B>
std::size_t batch_size(B const& b) {
  return batch_traits<std::remove_cvref_t<B>>::size(b);
}
/// Samples [first, last) of `b`.
template <batch B>
auto slice_batch(B const& b, std::size_t first, std::size_t last) {
  return batch_traits<std::remove_cvref_t<B>>::slice(b, first, last);
}

namespace detail {
/// The common size of the members of a compound batch; throws when they disagree.
template <class Tuple>
std::size_t common_batch_size(Tuple const& members) {
  std::size_t n = 0;
  bool first = true;
  std::size_t index = 0;
  std::apply(
      [&](auto const&... m) {
        (
            [&] {
              std::size_t const s = batch_size(m);
              if (first) {
                n = s;
                first = false;
              } else {
                require(s == n, "batch: expected every member of a compound batch to hold the same number "
                                "of samples; member 0 holds " + std::to_string(n) + ", member " +
                                    std::to_string(index) + " holds " + std::to_string(s));
              }
              ++index;
            }(),
            ...);
      },
      members);
  return n;
}
template <class Tuple>
auto slice_members(Tuple const& members, std::size_t first, std::size_t last) {
  return std::apply([&](auto const&... m) { return std::make_tuple(slice_batch(m, first, last)...); }, members);
}

// Aggregate support: count the members of a plain struct by brace-initialising it.
struct any_member {
  template <class T>
  operator T() const;  // NOLINT(google-explicit-constructor): only used in unevaluated contexts
};
template <class T, std::size_t... I>
constexpr bool brace_initializable(std::index_sequence<I...>) {
  return requires { T{(void(I), any_member{})...}; };
}
template <class T, std::size_t N = 8>
constexpr std::size_t aggregate_arity() {
  if constexpr (N == 0) return 0;
  else if constexpr (brace_initializable<T>(std::make_index_sequence<N>{})) return N;
  else return aggregate_arity<T, N - 1>();
}
template <class T>
concept tuple_like = requires { std::tuple_size<T>::value; };
template <class T>
concept plain_aggregate = std::is_aggregate_v<T> && !std::is_array_v<T> && !tuple_like<T> &&
                          (aggregate_arity<T>() > 0);

/// The members of an aggregate as a tuple of const references.
template <class T>
auto members_of(T const& b) {
  constexpr std::size_t n = aggregate_arity<T>();
  // clang-format off
  if constexpr (n == 1) { auto const& [a] = b; return std::tie(a); }
  else if constexpr (n == 2) { auto const& [a, c] = b; return std::tie(a, c); }
  else if constexpr (n == 3) { auto const& [a, c, d] = b; return std::tie(a, c, d); }
  else if constexpr (n == 4) { auto const& [a, c, d, e] = b; return std::tie(a, c, d, e); }
  else if constexpr (n == 5) { auto const& [a, c, d, e, f] = b; return std::tie(a, c, d, e, f); }
  else if constexpr (n == 6) { auto const& [a, c, d, e, f, g] = b; return std::tie(a, c, d, e, f, g); }
  else if constexpr (n == 7) { auto const& [a, c, d, e, f, g, h] = b; return std::tie(a, c, d, e, f, g, h); }
  else { auto const& [a, c, d, e, f, g, h, i] = b; return std::tie(a, c, d, e, f, g, h, i); }
  // clang-format on
}
template <class Tuple>
struct decay_tuple;
template <class... M>
struct decay_tuple<std::tuple<M...>> {
  using type = std::tuple<std::remove_cvref_t<M>...>;
};
template <class Tuple>
struct all_batches;
template <class... M>
struct all_batches<std::tuple<M...>> : std::bool_constant<(batch<std::remove_cvref_t<M>> && ...)> {};
}  // namespace detail

/// A std::tuple of batches holding the same number of samples; slices are tuples of slices.
template <class... Ts>
  requires(batch<Ts> && ...)
struct batch_traits<std::tuple<Ts...>> {
  /// Number of samples; throws invalid_argument when the members disagree.
  static std::size_t size(std::tuple<Ts...> const& b) { return detail::common_batch_size(b); }
  /// Samples [first, last) of every member, as a std::tuple.
  static auto slice(std::tuple<Ts...> const& b, std::size_t first, std::size_t last) {
    return detail::slice_members(b, first, last);
  }
};

/// A std::pair of batches holding the same number of samples; slices are pairs of slices.
template <class A, class C>
  requires(batch<A> && batch<C>)
struct batch_traits<std::pair<A, C>> {
  /// Number of samples; throws invalid_argument when the members disagree.
  static std::size_t size(std::pair<A, C> const& b) { return detail::common_batch_size(std::tie(b.first, b.second)); }
  /// Samples [first, last) of both members, as a std::pair.
  static auto slice(std::pair<A, C> const& b, std::size_t first, std::size_t last) {
    return std::pair(slice_batch(b.first, first, last), slice_batch(b.second, first, last));
  }
};

/// Aggregates of batches: the slice is the same struct when every member slices to its own type
/// (e.g. a struct of tensor_views), otherwise a std::tuple of the member slices.
namespace detail {
// Stated on the specialisation, not on its members: nvcc's front end rejects member constraints
// that name the class's own template parameter through members_of.
template <class B>
concept batch_aggregate =
    plain_aggregate<B> && all_batches<decltype(members_of(std::declval<B const&>()))>::value;
}  // namespace detail

template <class B>
struct batch_traits<B, std::enable_if_t<detail::batch_aggregate<B>>> {
  static std::size_t size(B const& b) { return detail::common_batch_size(detail::members_of(b)); }
  static auto slice(B const& b, std::size_t first, std::size_t last) {
    auto parts = detail::slice_members(detail::members_of(b), first, last);
    using member_types = typename detail::decay_tuple<decltype(detail::members_of(b))>::type;
    if constexpr (std::is_same_v<decltype(parts), member_types>) {
      return std::apply([](auto&&... p) { return B{std::move(p)...}; }, std::move(parts));
    } else {
      return parts;
    }
  }
};

/// Compile-time check with a readable message; used by the wrappers' step().
template <class B>
constexpr bool check_batch() {
  static_assert(batch<B>,
                "dparallel: the batch type has no batch_traits: use a tensor_view, std::span, std::vector, a "
                "tuple/pair or a plain struct of those, or specialise dparallel::batch_traits<B> with static "
                "size(B const&) and slice(B const&, std::size_t first, std::size_t last)");
  return batch<B>;
}

DPARALLEL_NAMESPACE_END

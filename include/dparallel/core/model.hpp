#pragma once
// The user's model: customisation points, not base classes.
//
// A model type M is usable when dparallel can reach, for each replica,
//   parameters(m)  a range of tensor views (any element convertible to tensor_ref),
//   gradients(m)   a range of the same length whose views have the same sizes and dtypes,
//   buffers(m)     optional: non-trained state copied like parameters but never reduced.
// Each point is looked up as a member first (m.parameters()), then as a static member of a
// specialisation of dparallel::model_traits<M> for types the user cannot edit. DataParallel also
// needs a replica on each device: m.make_replica(device), else model_traits<M>::make_replica,
// else M's copy constructor. Optionally, model_traits<M>::begin_shard(M&, step_context&) and
// end_shard(M&) bracket every run of the step function on a replica (adapters use them to route
// a framework's gradient hooks to step_context::grad_ready, see docs/libtorch.md); end_shard may
// throw after a step function that returned, which fails the step. DataParallel calls
// model_traits<M>::follow_master(M& replica, M& master), where it exists, before each step reads
// a replica's tensors (an adapter copies state that is not a tensor, such as which parameters are
// frozen).

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/memory_overlap.hpp>
#include <dparallel/core/step_context.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <concepts>
#include <cstddef>
#include <ranges>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Specialise for a model type you cannot edit:
///   template <> struct dparallel::model_traits<theirs> {
///     static auto parameters(theirs& m) { ... }
///     static auto gradients(theirs& m) { ... }
///     static auto buffers(theirs& m) { ... }                       // optional
///     static theirs make_replica(theirs const& m, device d) { ... } // optional
///   };
template <class M>
struct model_traits {};

/// A range whose elements convert to tensor_ref.
template <class R>
concept tensor_range = std::ranges::forward_range<R> && std::ranges::sized_range<R> &&
                       std::convertible_to<std::ranges::range_reference_t<R>, tensor_ref>;

namespace detail {
template <class M>
concept member_parameters = requires(M& m) {
  { m.parameters() } -> tensor_range;
};
template <class M>
concept traits_parameters = requires(M& m) {
  { model_traits<M>::parameters(m) } -> tensor_range;
};
template <class M>
concept member_gradients = requires(M& m) {
  { m.gradients() } -> tensor_range;
};
template <class M>
concept traits_gradients = requires(M& m) {
  { model_traits<M>::gradients(m) } -> tensor_range;
};
template <class M>
concept member_buffers = requires(M& m) {
  { m.buffers() } -> tensor_range;
};
template <class M>
concept traits_buffers = requires(M& m) {
  { model_traits<M>::buffers(m) } -> tensor_range;
};
template <class M>
concept member_make_replica = requires(M const& m, device d) {
  { m.make_replica(d) } -> std::same_as<M>;
};
template <class M>
concept traits_make_replica = requires(M const& m, device d) {
  { model_traits<M>::make_replica(m, d) } -> std::same_as<M>;
};

/// A range of shapes, each a range of integers: what parameter_shapes() / buffer_shapes() return
/// (state dicts record them; DDP checks every rank declares the same ones).
template <class R>
concept shape_range = std::ranges::input_range<R> && std::ranges::input_range<std::ranges::range_reference_t<R>> &&
    std::integral<std::remove_cvref_t<std::ranges::range_reference_t<std::ranges::range_reference_t<R>>>>;
template <class M>
concept member_parameter_shapes = requires(M& m) {
  { m.parameter_shapes() } -> shape_range;
};
template <class M>
concept traits_parameter_shapes = requires(M& m) {
  { model_traits<M>::parameter_shapes(m) } -> shape_range;
};

/// A range of things that convert to std::string_view (const char*, std::string, ...): what
/// parameter_names() / buffer_names() return (state dicts record them; errors name parameters by them).
template <class R>
concept name_range =
    std::ranges::input_range<R> && std::convertible_to<std::ranges::range_reference_t<R>, std::string_view>;
template <class M>
concept member_parameter_names = requires(M& m) {
  { m.parameter_names() } -> name_range;
};
template <class M>
concept traits_parameter_names = requires(M& m) {
  { model_traits<M>::parameter_names(m) } -> name_range;
};

struct parameters_fn {
  template <class M>
    requires member_parameters<M> || traits_parameters<M>
  decltype(auto) operator()(M& m) const {
    if constexpr (member_parameters<M>) return m.parameters();
    else return model_traits<M>::parameters(m);
  }
};
struct gradients_fn {
  template <class M>
    requires member_gradients<M> || traits_gradients<M>
  decltype(auto) operator()(M& m) const {
    if constexpr (member_gradients<M>) return m.gradients();
    else return model_traits<M>::gradients(m);
  }
};
struct buffers_fn {
  /// A model without buffers has an empty range of them.
  template <class M>
  decltype(auto) operator()(M& m) const {
    if constexpr (member_buffers<M>) return m.buffers();
    else if constexpr (traits_buffers<M>) return model_traits<M>::buffers(m);
    else return std::vector<tensor_ref>{};
  }
};
}  // namespace detail

/// parameters(m): the model's trainable tensors, in a stable order.
inline constexpr detail::parameters_fn parameters{};
/// gradients(m): one gradient per parameter, same order, sizes and dtypes.
inline constexpr detail::gradients_fn gradients{};
/// buffers(m): non-trained state (running statistics, ...); empty when the model has none.
inline constexpr detail::buffers_fn buffers{};

/// What dparallel needs of every model.
template <class M>
concept model = requires(M& m) {
  { dparallel::parameters(m) } -> tensor_range;
  { dparallel::gradients(m) } -> tensor_range;
};

/// A model DataParallel can copy onto another device.
template <class M>
concept replicable_model =
    model<M> && (detail::member_make_replica<M> || detail::traits_make_replica<M> || std::copy_constructible<M>);

/// Makes a replica of `m` for device `d`.
template <replicable_model M>
M make_replica(M const& m, device d) {
  if constexpr (detail::member_make_replica<M>) return m.make_replica(d);
  else if constexpr (detail::traits_make_replica<M>) return model_traits<M>::make_replica(m, d);
  else return M(m);
}

namespace detail {
// False for every type: named in a failing static_assert, it makes the compiler print the type
// that parameters() / gradients() returns (e.g. "'parameters_return_type_is_a_range_of_views<
// std::array<std::vector<float>, 1>>' evaluates to false").
template <class Returned>
inline constexpr bool parameters_return_type_is_a_range_of_views = false;
template <class Returned>
inline constexpr bool gradients_return_type_is_a_range_of_views = false;
template <class M>
concept has_member_parameters = requires(M& m) { m.parameters(); };
template <class M>
concept has_traits_parameters = requires(M& m) { model_traits<M>::parameters(m); };
template <class M>
concept has_member_gradients = requires(M& m) { m.gradients(); };
template <class M>
concept has_traits_gradients = requires(M& m) { model_traits<M>::gradients(m); };

/// Checks one customisation point (parameters or gradients) of M; false when it reported.
template <class M, bool Parameters>
constexpr bool check_tensors_point() {
  constexpr bool good = Parameters ? (member_parameters<M> || traits_parameters<M>)
                                   : (member_gradients<M> || traits_gradients<M>);
  if constexpr (good) {
    return true;
  } else if constexpr (Parameters && (has_member_parameters<M> || has_traits_parameters<M>)) {
    using returned = decltype([](M& m) -> decltype(auto) {
      if constexpr (has_member_parameters<M>) return m.parameters();
      else return model_traits<M>::parameters(m);
    }(std::declval<M&>()));
    static_assert(parameters_return_type_is_a_range_of_views<returned>,
                  "dparallel: the model's parameters() returns a type that is not a range of tensor views (the "
                  "compiler names it in parameters_return_type_is_a_range_of_views<...>): wrap each member in "
                  "dparallel::view, e.g. `return std::array{dparallel::view(w), dparallel::view(b)};`");
    return false;
  } else if constexpr (!Parameters && (has_member_gradients<M> || has_traits_gradients<M>)) {
    using returned = decltype([](M& m) -> decltype(auto) {
      if constexpr (has_member_gradients<M>) return m.gradients();
      else return model_traits<M>::gradients(m);
    }(std::declval<M&>()));
    static_assert(gradients_return_type_is_a_range_of_views<returned>,
                  "dparallel: the model's gradients() returns a type that is not a range of tensor views (the "
                  "compiler names it in gradients_return_type_is_a_range_of_views<...>): wrap each member in "
                  "dparallel::view, e.g. `return std::array{dparallel::view(gw), dparallel::view(gb)};`");
    return false;
  } else {
    static_assert(!Parameters,
                  "dparallel: the model type has no parameters: give it a member `parameters()` returning a range "
                  "of tensor views, or specialise dparallel::model_traits<M> with `static auto parameters(M&)`");
    static_assert(Parameters,
                  "dparallel: the model type has no gradients: give it a member `gradients()` returning a range "
                  "of tensor views, or specialise dparallel::model_traits<M> with `static auto gradients(M&)`");
    return false;
  }
}

template <std::size_t Parameters, std::size_t Gradients>
inline constexpr bool parameter_and_gradient_counts_match = Parameters == Gradients;

/// The length of a fixed-size range type (std::array and the like), or 0 when it has none.
template <class R>
constexpr std::size_t fixed_length() {
  if constexpr (requires { std::tuple_size<std::remove_cvref_t<R>>::value; })
    return std::tuple_size<std::remove_cvref_t<R>>::value;
  else
    return 0;
}
}  // namespace detail

/// Compile-time check with a readable message for each missing or wrong piece; used by the
/// wrappers.
template <class M>
constexpr bool check_model() {
  constexpr bool params = detail::check_tensors_point<M, true>();
  constexpr bool grads = detail::check_tensors_point<M, false>();
  if constexpr (params && grads) {
    using P = decltype(dparallel::parameters(std::declval<M&>()));
    using G = decltype(dparallel::gradients(std::declval<M&>()));
    constexpr std::size_t np = detail::fixed_length<P>(), ng = detail::fixed_length<G>();
    static_assert(np == 0 || ng == 0 || detail::parameter_and_gradient_counts_match<np, ng>,
                  "dparallel: parameters() and gradients() return std::arrays of different lengths (the compiler "
                  "names both in parameter_and_gradient_counts_match<parameters, gradients>): give one gradient "
                  "per parameter, in the same order");
    return model<M> && (np == 0 || ng == 0 || np == ng);
  } else {
    return false;
  }
}

/// The parameters of `m` as tensor_refs.
template <model M>
std::vector<tensor_ref> parameter_refs(M& m) {
  std::vector<tensor_ref> out;
  for (auto&& t : dparallel::parameters(m)) out.emplace_back(t);
  return out;
}
/// The gradients of `m` as tensor_refs.
template <model M>
std::vector<tensor_ref> gradient_refs(M& m) {
  std::vector<tensor_ref> out;
  for (auto&& t : dparallel::gradients(m)) out.emplace_back(t);
  return out;
}
/// The buffers of `m` as tensor_refs.
template <model M>
std::vector<tensor_ref> buffer_refs(M& m) {
  std::vector<tensor_ref> out;
  for (auto&& t : dparallel::buffers(m)) out.emplace_back(t);
  return out;
}

namespace detail {
template <class M>
concept traits_begin_shard = requires(M& m, step_context& c) { model_traits<M>::begin_shard(m, c); };
template <class M>
concept traits_end_shard = requires(M& m) { model_traits<M>::end_shard(m); };
template <class M>
concept traits_follow_master = requires(M& r, M& m) { model_traits<M>::follow_master(r, m); };

/// Brackets one run of the step function on `m`: model_traits<M>::begin_shard(m, ctx) when the
/// scope opens and end_shard(m) when it closes, for the models whose traits have them (nothing
/// for the others). close() ends it once the step function returned: end_shard may then throw (an
/// adapter's check of what the step function left), and that is the step's error; a scope left
/// by an exception calls end_shard and ignores what it throws.
template <class M>
class shard_scope {
 public:
  shard_scope(M& m, step_context& ctx) : m_(m) {
    if constexpr (traits_begin_shard<M>) model_traits<M>::begin_shard(m, ctx);
    else (void)ctx;
  }
  shard_scope(shard_scope const&) = delete;
  shard_scope& operator=(shard_scope const&) = delete;
  /// The step function returned: end_shard now, letting its exception out.
  void close() {
    open_ = false;
    if constexpr (traits_end_shard<M>) model_traits<M>::end_shard(m_);
  }
  ~shard_scope() {
    if constexpr (traits_end_shard<M>) {
      if (!open_) return;
      try {
        model_traits<M>::end_shard(m_);
      } catch (...) {  // NOLINT(bugprone-empty-catch): the step function's own exception is the step's error
      }
    }
  }

 private:
  M& m_;
  bool open_ = true;
};
}  // namespace detail

namespace detail {
/// Throws invalid_argument when a gradient shares memory with a parameter or with another
/// gradient (`where` names the model; `label(i)` names parameter i and its gradient).
template <class Label>
void verify_gradient_memory(std::vector<tensor_ref> const& p, std::vector<tensor_ref> const& g, std::string const& where,
                            Label const& label) {
  std::vector<tensor_place> places;
  places.reserve(p.size() + g.size());
  for (std::size_t i = 0; i < p.size(); ++i) places.push_back({p[i], 0, i});
  for (std::size_t i = 0; i < g.size(); ++i) places.push_back({g[i], 1, i});
  auto const hit = find_memory_overlap(std::move(places), 2, [](int a, int b) { return a == 1 || b == 1; });
  if (!hit) return;
  // The gradient named first: the one over a parameter, or the later of two gradients.
  bool const second_first = hit->second.group == 1 && (hit->first.group == 0 || hit->second.index > hit->first.index);
  auto const& grad = second_first ? hit->second : hit->first;
  auto const& other = second_first ? hit->first : hit->second;
  throw invalid_argument("dparallel: " + where + ": gradient " + label(grad.index) + " shares memory with " +
                         (other.group == 0 ? "parameter " : "gradient ") + label(other.index) +
                         "; every gradient needs memory of its own, apart from the parameters and the other "
                         "gradients (the reduction would sum into the wrong place): make gradients() return views "
                         "of distinct storage");
}

/// How errors name parameter `i` of `m`: "`fc2.bias`" when the model names its parameters
/// (parameter_names(), as a member or in model_traits<M>), else "3". Built on the error path only.
template <class M>
std::string parameter_label(M& m, std::size_t i) {
  auto const pick = [&](auto&& names) -> std::string {
    std::size_t k = 0;
    for (auto&& n : names)
      if (k++ == i) return "`" + std::string(std::string_view(n)) + "`";
    return std::to_string(i);
  };
  if constexpr (member_parameter_names<M>) return pick(m.parameter_names());
  else if constexpr (traits_parameter_names<M>) return pick(model_traits<M>::parameter_names(m));
  else return std::to_string(i);
}

/// How errors list parameters `indices` of `m`: their labels, comma-separated, at most `limit`
/// of them and "..." after. Built on the error path only.
template <class M>
std::string parameter_list(M& m, std::vector<std::size_t> const& indices, std::size_t limit = 16) {
  std::string list;
  for (std::size_t k = 0; k < indices.size() && k < limit; ++k) list += (k ? ", " : "") + parameter_label(m, indices[k]);
  if (indices.size() > limit) list += ", ...";
  return list;
}
}  // namespace detail

/// Throws invalid_argument unless every gradient matches its parameter in size and dtype and has
/// memory of its own (no gradient over a parameter or over another gradient).
template <model M>
void verify_model(M& m, std::string const& where) {
  auto const p = parameter_refs(m);
  auto const g = gradient_refs(m);
  detail::require(p.size() == g.size(), where + ": expected one gradient per parameter, found " +
                                            std::to_string(p.size()) + " parameters and " +
                                            std::to_string(g.size()) + " gradients");
  for (std::size_t i = 0; i < p.size(); ++i) {
    detail::require(p[i].size() == g[i].size() && p[i].dtype() == g[i].dtype(), [&] {
      return where + ": gradient " + detail::parameter_label(m, i) + " does not match its parameter: expected " +
             std::to_string(p[i].size()) + " elements of " + std::string(name_of(p[i].dtype())) + ", found " +
             std::to_string(g[i].size()) + " elements of " + std::string(name_of(g[i].dtype()));
    });
  }
  detail::verify_gradient_memory(p, g, where, [&](std::size_t i) { return detail::parameter_label(m, i); });
}

DPARALLEL_NAMESPACE_END

#pragma once
// Gather policies: what step() returns from the per-replica outputs of the step function.

#include <dparallel/config.hpp>
#include <dparallel/core/buffer.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/policy/replicate.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// gather_traits<Out>::concat(outs) joins the outputs of the replicas that ran, in device order,
/// along the batch dimension. Ready for arithmetic values (one entry per replica, like torch's
/// gather of 0-dim tensors), std::vector<T> and buffer<T>. Specialise it for your own output type.
template <class Out, class = void>
struct gather_traits {};

/// Numbers: one entry per replica that ran, in device order.
template <class T>
struct gather_traits<T, std::enable_if_t<std::is_arithmetic_v<T>>> {
  /// The outputs as they are.
  static std::vector<T> concat(std::vector<T>&& outs) { return std::move(outs); }
};

/// Vectors: concatenated in device order.
template <class T, class A>
struct gather_traits<std::vector<T, A>> {
  /// The elements of every output, in device order.
  static std::vector<T, A> concat(std::vector<std::vector<T, A>>&& outs) {
    if (outs.size() == 1) return std::move(outs[0]);
    std::size_t n = 0;
    for (auto const& o : outs) n += o.size();
    std::vector<T, A> all;
    all.reserve(n);
    for (auto& o : outs) std::move(o.begin(), o.end(), std::back_inserter(all));
    return all;
  }
};

/// Buffers: concatenated along the rows; every output must have rows of the same size.
template <class T>
struct gather_traits<buffer<T>> {
  /// One buffer holding every output's rows, in device order.
  static buffer<T> concat(std::vector<buffer<T>>&& outs) {
    if (outs.size() == 1) return std::move(outs[0]);
    std::size_t n = 0, rows = 0, row = outs.empty() ? 0 : outs[0].size() / std::max<std::size_t>(1, outs[0].rows());
    for (auto const& o : outs) {
      n += o.size();
      rows += o.rows();
      detail::require(o.rows() == 0 || o.size() / o.rows() == row, [&] {
        return "gather: expected every replica's output to have rows of " + std::to_string(row) + " elements, found " +
               std::to_string(o.size() / o.rows());
      });
    }
    buffer<T> all(n, rows);
    T* d = all.data();
    for (auto const& o : outs) d = std::copy(o.begin(), o.end(), d);
    return all;
  }
};

template <class Out>
concept gatherable = requires(std::vector<Out>&& v) { gather_traits<Out>::concat(std::move(v)); };

/// A gather policy turns the outputs of the replicas that ran (device order) into step()'s result.
template <class P>
concept gather_policy = std::semiregular<P> && requires(std::vector<float>&& outs, detail::archetype_set& s) {
  P::gather(std::move(outs), s);
};

namespace policy {

/// DataParallel: outputs concatenated on options::output_device (host memory on the host backend).
struct concat_outputs {
  /// The outputs joined by gather_traits<Out>::concat.
  template <class Out, class Set>
  static auto gather(std::vector<Out>&& outs, Set&) {
    static_assert(gatherable<Out>,
                  "dparallel: DataParallel cannot concatenate the step function's output type: return an "
                  "arithmetic value, std::vector<T> or dparallel::buffer<T>, or specialise "
                  "dparallel::gather_traits<Out> with static concat(std::vector<Out>&&)");
    return gather_traits<Out>::concat(std::move(outs));
  }
};
static_assert(gather_policy<concat_outputs>);

/// DDP: no gather; the local output is returned as it is.
struct local_output {
  /// The single local output.
  template <class Out, class Set>
  static Out gather(std::vector<Out>&& outs, Set&) {
    return std::move(outs.front());
  }
};
static_assert(gather_policy<local_output>);

}  // namespace policy
DPARALLEL_NAMESPACE_END

#pragma once
// Gather policies: what step() returns from the per-replica outputs of the step function.

#include <dparallel/config.hpp>
#include <dparallel/core/buffer.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/policy/concepts.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// gather_traits<Out>::concat(outs) joins the outputs of the replicas that ran, in device order,
/// along the batch dimension. Ready for arithmetic values (one entry per replica, like torch's
/// gather of 0-dim tensors), std::vector<T> and buffer<T>. Specialise it for your own output type
/// (with `concat(std::vector<Out>&&, device)` to be told options::output_device); without one,
/// DataParallel returns the outputs as a std::vector<Out>.
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

namespace policy {

/// DataParallel: the outputs of the replicas that ran, joined in device order and placed on
/// options::output_device (default: the first device):
/// - gather_traits<Out> with `static R concat(std::vector<Out>&&, device)`: called with the output
///   device, so an output type that lives in device memory is gathered there;
/// - gather_traits<Out> with `static R concat(std::vector<Out>&&)` (arithmetic values, std::vector,
///   buffer<T>): host values, joined as they are (host memory is every host device's memory);
/// - any other Out (say, a struct of metrics): the std::vector<Out> of the outputs, one per
///   replica that ran, in device order.
struct concat_outputs {
  /// The outputs joined by gather_traits<Out>::concat.
  template <class Out, class Set>
  static auto gather(std::vector<Out>&& outs, Set& s) {
    if constexpr (requires { gather_traits<Out>::concat(std::move(outs), s.devices[s.output_slot]); })
      return gather_traits<Out>::concat(std::move(outs), s.devices[s.output_slot]);
    else if constexpr (gatherable<Out>)
      return gather_traits<Out>::concat(std::move(outs));
    else
      return std::vector<Out>(std::move(outs));
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

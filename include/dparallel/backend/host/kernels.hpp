#pragma once
// Elementwise kernels of the host backend over dtype-erased views. They run on the calling thread
// (a stream's worker when enqueued). Summation order is fixed, so results are deterministic.
// F16 and BF16 (dparallel::f16 / bf16, the same bits as __half / __nv_bfloat16) compute in float
// and are rounded once per result, as the CUDA kernels do (backend/cuda/kernels.hpp: float
// weights, the same pairwise tree, __fmul_rn / __fadd_rn, one __float2half_rn or
// __float2bfloat16_rn at the end), so a 16-bit model gives the same bits on either backend.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>

DPARALLEL_NAMESPACE_BEGIN
namespace host {
namespace detail {

// Kernels run per tensor on every step: the message is built only when the check fails.
inline void check_same(tensor_ref dst, tensor_ref src, char const* what) {
  dparallel::detail::require(dst.dtype() == src.dtype() && dst.size() == src.size(), [&] {
    return std::string(what) + ": expected views of the same dtype and size, found " + std::to_string(dst.size()) +
           " x " + std::string(name_of(dst.dtype())) + " and " + std::to_string(src.size()) + " x " +
           std::string(name_of(src.dtype()));
  });
}

/// Calls f(T{}) with T the C++ type of a floating dtype (f16 and bf16 compute in
/// accumulator_t<T> = float); throws for other dtypes.
template <class F>
decltype(auto) dispatch_float(dtype t, F&& f, char const* what) {
  switch (t) {
    case dtype::f32: return f(float{});
    case dtype::f64: return f(double{});
    case dtype::f16: return f(f16{});
    case dtype::bf16: return f(bf16{});
    default:
      throw invalid_argument(std::string("dparallel: ") + what + ": the host backend reduces F32, F64, F16 and BF16, found " +
                             std::string(name_of(t)));
  }
}

}  // namespace detail

/// dst = src (bytes); any dtype.
inline void copy(tensor_ref dst, tensor_ref src) {
  detail::check_same(dst, src, "host::copy");
  if (dst.data() != src.data() && dst.size() != 0) std::memcpy(dst.data(), src.data(), dst.size_bytes());
}

/// dst *= alpha.
inline void scale(tensor_ref dst, double alpha) {
  detail::dispatch_float(
      dst.dtype(),
      [&](auto zero) {
        using T = decltype(zero);
        using A = dparallel::detail::accumulator_t<T>;
        T* d = static_cast<T*>(dst.data());
        A const a = static_cast<A>(alpha);
        for (std::size_t i = 0, n = dst.size(); i < n; ++i)
          d[i] = dparallel::detail::narrow<T>(dparallel::detail::widen(d[i]) * a);
      },
      "host::scale");
}

/// dst += alpha * src.
inline void add_scaled(tensor_ref dst, tensor_ref src, double alpha) {
  detail::check_same(dst, src, "host::add_scaled");
  detail::dispatch_float(
      dst.dtype(),
      [&](auto zero) {
        using T = decltype(zero);
        using A = dparallel::detail::accumulator_t<T>;
        using dparallel::detail::widen;
        T* d = static_cast<T*>(dst.data());
        T const* s = static_cast<T const*>(src.data());
        A const a = static_cast<A>(alpha);
        for (std::size_t i = 0, n = dst.size(); i < n; ++i)
          d[i] = dparallel::detail::narrow<T>(widen(d[i]) + a * widen(s[i]));
      },
      "host::add_scaled");
}

namespace detail {

/// Elements [base, base + m) of weighted_sum (below), with m = M when M is not 0: every loop then
/// has a constant trip count, which GCC vectorises even at -O2 (its "very cheap" cost model
/// refuses loops that need an epilogue). The arithmetic of each element is the same either way.
template <class T, std::size_t M>
inline void weighted_sum_tile(T* d, std::span<tensor_ref const> srcs, std::span<double const> weights,
                              std::size_t base, std::size_t m_dynamic) {
  constexpr std::size_t tile = M == 0 ? 16 : M;  // the dynamic form only takes the last < 16 elements
  constexpr std::size_t levels = 32;             // enough for 2^31 sources
  using A = dparallel::detail::accumulator_t<T>;  // float for f16 and bf16
  std::size_t const m = M == 0 ? m_dynamic : M;
  A stack[levels][tile];
  std::size_t terms[levels];
  std::size_t depth = 0;
  for (std::size_t k = 0; k < srcs.size(); ++k) {
    T const* s = static_cast<T const*>(srcs[k].data()) + base;
    A const w = static_cast<A>(weights[k]);
    A* top = stack[depth];
    for (std::size_t i = 0; i < m; ++i) top[i] = w * dparallel::detail::widen(s[i]);
    terms[depth++] = 1;
    while (depth >= 2 && terms[depth - 1] == terms[depth - 2]) {
      A* left = stack[depth - 2];
      A const* right = stack[depth - 1];
      for (std::size_t i = 0; i < m; ++i) left[i] += right[i];
      terms[depth - 2] *= 2;
      --depth;
    }
  }
  while (depth >= 2) {  // uneven counts: fold the remaining partial sums right to left
    A* left = stack[depth - 2];
    A const* right = stack[depth - 1];
    for (std::size_t i = 0; i < m; ++i) left[i] += right[i];
    --depth;
  }
  if constexpr (std::is_same_v<A, T>) {
    std::memcpy(d + base, stack[0], m * sizeof(T));
  } else {  // the one rounding of each result
    for (std::size_t i = 0; i < m; ++i) d[base + i] = dparallel::detail::narrow<T>(stack[0][i]);
  }
}

}  // namespace detail

/// dst[i] = sum_k weights[k] * srcs[k][i], summed pairwise in source order: the terms are added
/// as a balanced binary tree ((t0 + t1) + (t2 + t3)) + ..., built left to right (a partial sum is
/// merged with its left neighbour as soon as both cover the same number of terms). The order is
/// fixed, so results are deterministic; pairwise summation also keeps the rounding error
/// O(log n). A model that sums its per-block gradients with the same tree gets bitwise the
/// gradient of one device when shards are whole blocks of power-of-two size. F16 and BF16 are
/// widened exactly, weighted and summed in float (the weights rounded to float) and rounded once:
/// the F32 result of the widened sources, rounded to nearest even (CUDA's order and bits).
/// `dst` may be one of the sources (element-wise in place); it must not partially overlap one.
inline void weighted_sum(tensor_ref dst, std::span<tensor_ref const> srcs, std::span<double const> weights) {
  if (srcs.empty() || srcs.size() != weights.size()) {
    throw invalid_argument(
        "dparallel: host::weighted_sum: expected one weight per source and at least one source, found " +
        std::to_string(srcs.size()) + " sources and " + std::to_string(weights.size()) + " weights");
  }
  for (auto const& s : srcs) detail::check_same(dst, s, "host::weighted_sum");
  detail::dispatch_float(
      dst.dtype(),
      [&](auto zero) {
        using T = decltype(zero);
        T* d = static_cast<T*>(dst.data());
        std::size_t const n = dst.size();
        constexpr std::size_t tile = 256, block = 16;
        std::size_t base = 0;
        // Trip counts first, as in the communicator's reduce_tiles (no overflow for GCC to assume).
        for (std::size_t t = n / tile; t > 0; --t, base += tile)
          detail::weighted_sum_tile<T, tile>(d, srcs, weights, base, tile);
        for (std::size_t b = (n - base) / block; b > 0; --b, base += block)
          detail::weighted_sum_tile<T, block>(d, srcs, weights, base, block);
        if (base < n) detail::weighted_sum_tile<T, 0>(d, srcs, weights, base, n - base);
      },
      "host::weighted_sum");
}

}  // namespace host
DPARALLEL_NAMESPACE_END

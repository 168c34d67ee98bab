#pragma once
// Elementwise kernels of the host communicator. They read the ranks' buffers in place (no staging
// copies) and always combine them in rank order 0..n-1, so every result is deterministic and the
// same bits on every rank. F16 and BF16 accumulate in float and are rounded once, at the end:
// each element is exactly the F32 reduction of the widened inputs, rounded to nearest even.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/stripes.hpp>

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// True for the dtypes the host communicator reduces.
constexpr bool host_reducible(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::f16 || t == dtype::bf16;
}

/// Calls f(T{}) with T the C++ type of a dtype the host communicator reduces (F32, F64, and the
/// storage types f16 and bf16, which compute in accumulator_t<T> = float).
template <class F>
decltype(auto) dispatch_reducible(dtype t, F&& f) {
  switch (t) {
    case dtype::f32: return std::forward<F>(f)(float{});
    case dtype::f64: return std::forward<F>(f)(double{});
    case dtype::f16: return std::forward<F>(f)(f16{});
    case dtype::bf16: return std::forward<F>(f)(bf16{});
    default:
      throw invalid_argument("dparallel: the host communicator reduces F32, F64, F16 and BF16, found " +
                             std::string(name_of(t)));
  }
}

/// Elements [first, last) of an array of `count` elements that rank `rank` of `n` handles.
constexpr std::pair<std::size_t, std::size_t> rank_slice(std::size_t count, int n, int rank) noexcept {
  auto const r = static_cast<std::size_t>(rank);
  auto const nn = static_cast<std::size_t>(n);
  return {count * r / nn, count * (r + 1) / nn};
}

/// For i in [base, base + M): v = ((srcs[0][i] + srcs[1][i]) + ...), times `scale` when `avg`,
/// then dsts[k][i] = v for every k, computed in accumulator_t<T> (float for f16 and bf16: the
/// sources are widened exactly and the result rounded once). The running sums live in a local
/// tile, so every destination may be the same array as a source (in place); none may partially
/// overlap one.
/// Each loop has a compile-time trip count and reads or writes one array besides the tile, which
/// GCC vectorises even at -O2 (its "very cheap" cost model refuses loops that need an epilogue or
/// a runtime check that two arrays do not overlap). The first two sources are added, and the
/// last pass scaled, in the same loop: one pass over the tile fewer, the same operations.
template <class T, std::size_t M>
inline void reduce_block(std::span<T const* const> srcs, std::span<T* const> dsts, std::size_t base, bool avg,
                         accumulator_t<T> scale) {
  accumulator_t<T> acc[M];
  std::size_t const n = srcs.size();
  bool const scale_first = avg && n <= 2;  // scaled in the first pass: there is no later one
  T const* s0 = srcs[0] + base;
  if (n == 1) {
    for (std::size_t i = 0; i < M; ++i) acc[i] = widen(s0[i]);
  } else {
    T const* s1 = srcs[1] + base;
    if (scale_first) {
      for (std::size_t i = 0; i < M; ++i) acc[i] = (widen(s0[i]) + widen(s1[i])) * scale;
    } else {
      for (std::size_t i = 0; i < M; ++i) acc[i] = widen(s0[i]) + widen(s1[i]);
    }
  }
  for (std::size_t k = 2; k < n; ++k) {
    T const* s = srcs[k] + base;
    if (avg && k + 1 == n) {
      for (std::size_t i = 0; i < M; ++i) acc[i] = (acc[i] + widen(s[i])) * scale;
    } else {
      for (std::size_t i = 0; i < M; ++i) acc[i] += widen(s[i]);
    }
  }
  if (avg && n == 1) {
    for (std::size_t i = 0; i < M; ++i) acc[i] *= scale;
  }
  for (T* d : dsts) {
    T* out = d + base;
    for (std::size_t i = 0; i < M; ++i) out[i] = narrow<T>(acc[i]);
  }
}

/// reduce_block for a short run of m (< 16) elements: the same arithmetic, element by element.
template <class T>
inline void reduce_short(std::span<T const* const> srcs, std::span<T* const> dsts, std::size_t base, std::size_t m,
                         bool avg, accumulator_t<T> scale) {
  for (std::size_t i = base; i < base + m; ++i) {
    accumulator_t<T> v = widen(srcs[0][i]);
    for (std::size_t k = 1; k < srcs.size(); ++k) v += widen(srcs[k][i]);
    if (avg) v *= scale;
    for (T* d : dsts) d[i] = narrow<T>(v);
  }
}

/// Elements [0, count) of the reduction described at reduce_block: tiles of 1 KiB (the sums stay
/// in L1 while the sources stream through), then blocks of 16 elements, then the last few. The
/// trip counts are computed first (a loop bounded by count - base would let GCC assume the
/// offsets can overflow, and warn about it where count is a constant).
template <class T>
void reduce_tiles(std::span<T const* const> srcs, std::span<T* const> dsts, std::size_t count, bool avg,
                  accumulator_t<T> scale) {
  constexpr std::size_t tile = 1024 / sizeof(accumulator_t<T>);
  constexpr std::size_t block = 16;
  std::size_t base = 0;
  for (std::size_t t = count / tile; t > 0; --t, base += tile) reduce_block<T, tile>(srcs, dsts, base, avg, scale);
  for (std::size_t b = (count - base) / block; b > 0; --b, base += block)
    reduce_block<T, block>(srcs, dsts, base, avg, scale);
  reduce_short<T>(srcs, dsts, base, count - base, avg, scale);
}

/// The factor of reduce_op::avg over n ranks, as every engine must compute it: T(1) / T(n)
/// (T = float for f16 and bf16: the float sum is multiplied by 1.0f / n before the one rounding).
template <class T>
constexpr T avg_scale(int n) noexcept {
  return T(1) / static_cast<T>(n);
}

/// Type-erased reduce_tiles: `srcs`/`dsts` are byte pointers to arrays of dtype `t`.
inline void reduce_bytes(dtype t, std::span<void const* const> srcs, std::span<void* const> dsts, std::size_t count,
                         reduce_op op, int world_size) {
  if (count == 0) return;
  dispatch_reducible(t, [&](auto zero) {
    using T = decltype(zero);
    constexpr std::size_t small = 16;  // avoid a heap allocation for the usual world sizes
    T const* src_small[small];
    T* dst_small[small];
    std::vector<T const*> src_big;
    std::vector<T*> dst_big;
    T const** s = src_small;
    T** d = dst_small;
    if (srcs.size() > small) {
      src_big.resize(srcs.size());
      s = src_big.data();
    }
    if (dsts.size() > small) {
      dst_big.resize(dsts.size());
      d = dst_big.data();
    }
    for (std::size_t k = 0; k < srcs.size(); ++k) s[k] = static_cast<T const*>(srcs[k]);
    for (std::size_t k = 0; k < dsts.size(); ++k) d[k] = static_cast<T*>(dsts[k]);
    reduce_tiles<T>(std::span<T const* const>(s, srcs.size()), std::span<T* const>(d, dsts.size()), count,
                    op == reduce_op::avg, avg_scale<accumulator_t<T>>(world_size));
  });
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

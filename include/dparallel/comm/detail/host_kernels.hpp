#pragma once
// Elementwise kernels of the host communicator. They read the ranks' buffers in place (no staging
// copies) and always combine them in rank order 0..n-1, so every result is deterministic and the
// same bits on every rank.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// True for the dtypes the host communicator reduces.
constexpr bool host_reducible(dtype t) noexcept { return t == dtype::f32 || t == dtype::f64; }

/// Calls f(T{}) with T the C++ type of a dtype the host communicator reduces (F32, F64).
template <class F>
decltype(auto) dispatch_reducible(dtype t, F&& f) {
  switch (t) {
    case dtype::f32: return std::forward<F>(f)(float{});
    case dtype::f64: return std::forward<F>(f)(double{});
    default:
      throw invalid_argument("dparallel: the host communicator reduces F32 and F64, found " +
                             std::string(name_of(t)));
  }
}

/// Elements [first, last) of an array of `count` elements that rank `rank` of `n` handles.
constexpr std::pair<std::size_t, std::size_t> rank_slice(std::size_t count, int n, int rank) noexcept {
  auto const r = static_cast<std::size_t>(rank);
  auto const nn = static_cast<std::size_t>(n);
  return {count * r / nn, count * (r + 1) / nn};
}

/// For i in [base, base + m): v = ((srcs[0][i] + srcs[1][i]) + ...), times `scale` when `avg`,
/// then dsts[k][i] = v for every k. The running sums live in a local tile, so every destination
/// may be the same array as a source (in place); none may partially overlap one.
/// With M a compile-time count each loop has a constant trip count over separate arrays, which
/// GCC vectorises even at -O2 (its "very cheap" cost model refuses loops that need an epilogue).
template <class T, std::size_t M>
inline void reduce_block(std::span<T const* const> srcs, std::span<T* const> dsts, std::size_t base, bool avg,
                         T scale) {
  T acc[M];
  std::memcpy(acc, srcs[0] + base, M * sizeof(T));
  for (std::size_t k = 1; k < srcs.size(); ++k) {
    T const* s = srcs[k] + base;
    for (std::size_t i = 0; i < M; ++i) acc[i] += s[i];
  }
  if (avg) {
    for (std::size_t i = 0; i < M; ++i) acc[i] *= scale;
  }
  for (T* d : dsts) std::memcpy(d + base, acc, M * sizeof(T));
}

/// reduce_block for a short run of m (< 64) elements: the same arithmetic, element by element.
template <class T>
inline void reduce_short(std::span<T const* const> srcs, std::span<T* const> dsts, std::size_t base, std::size_t m,
                         bool avg, T scale) {
  for (std::size_t i = base; i < base + m; ++i) {
    T v = srcs[0][i];
    for (std::size_t k = 1; k < srcs.size(); ++k) v += srcs[k][i];
    if (avg) v *= scale;
    for (T* d : dsts) d[i] = v;
  }
}

/// Elements [0, count) of the reduction described at reduce_block: L1-sized tiles (the running
/// sums stay in cache while the sources stream), then 64-element blocks, then the last few.
template <class T>
void reduce_tiles(std::span<T const* const> srcs, std::span<T* const> dsts, std::size_t count, bool avg, T scale) {
  constexpr std::size_t tile = 16384 / sizeof(T);
  constexpr std::size_t block = 64;
  std::size_t base = 0;
  for (; count - base >= tile; base += tile) reduce_block<T, tile>(srcs, dsts, base, avg, scale);
  for (; count - base >= block; base += block) reduce_block<T, block>(srcs, dsts, base, avg, scale);
  reduce_short<T>(srcs, dsts, base, count - base, avg, scale);
}

/// The factor of reduce_op::avg over n ranks, as every engine must compute it: T(1) / T(n).
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
                    op == reduce_op::avg, avg_scale<T>(world_size));
  });
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

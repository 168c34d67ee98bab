#pragma once
// The table of a batched weighted-sum launch (the CUDA backend's DataParallel reduce, see
// backend/cuda/kernels.hpp): several sums dst_e = sum_k w[k] * src_e[k] (one per gradient slice)
// with the same N weights, described in one struct passed by value as a kernel's parameters, so
// one launch per device covers all of a step's gradients instead of one launch per parameter.
// The kernel walks a flat range of "units" with a grid-stride loop: entry e owns units
// [start[e], start[e + 1]); its first packs[e] units are 16-byte packs (when every pointer of
// the entry is 16-byte aligned), the rest single elements. locate() maps a unit to its entry and
// is shared by the kernel and the host test. Each element's sum is the same expression as an
// unbatched launch computes, so results are bitwise unchanged. Plain C++ (no CUDA header): the
// table's logic is tested on the host (tests/test_sum_batch.cpp).

#include <dparallel/config.hpp>

#include <cstddef>
#include <cstdint>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// The entry owning unit `u` of a table with `count` entries and unit offsets `start` (count + 1
/// of them, nondecreasing; u < start[count]): the last e with start[e] <= u (binary search, so
/// entries without units are skipped).
DPARALLEL_HOST_DEVICE unsigned locate_unit(std::size_t const* start, unsigned count, std::size_t u) {
  unsigned lo = 0, hi = count;  // start[lo] <= u < start[hi]
  while (hi - lo > 1) {
    unsigned const mid = lo + (hi - lo) / 2;
    if (start[mid] <= u) lo = mid;
    else hi = mid;
  }
  return lo;
}

/// The parameters of one batched launch: up to `capacity` sums of N sources of T (weights of
/// accumulation type A, shared by every entry). Sized to stay within the 4 KiB kernel parameter
/// block that every CUDA architecture accepts.
template <class T, class A, unsigned N>
struct sum_batch {
  /// Entries one launch carries: as many as fit, with the weights, in 4000 bytes.
  static constexpr unsigned capacity =
      static_cast<unsigned>((4000 - sizeof(A) * N - 2 * sizeof(std::size_t) - sizeof(unsigned)) /
                            (sizeof(T*) * (N + 1) + 2 * sizeof(std::size_t)));
  /// Elements per 16-byte pack.
  static constexpr std::size_t pack = 16 / sizeof(T);
  static_assert(capacity >= 8, "sum_batch: too many sources for one parameter block");

  T* dst[capacity];                  ///< entry e's destination
  T const* src[capacity][N];         ///< entry e's sources
  std::size_t packs[capacity];       ///< entry e's leading 16-byte packs (0 when misaligned)
  std::size_t start[capacity + 1];   ///< entry e's first unit; start[count] = all units
  A w[N];                            ///< the weights, one per source
  unsigned count;                    ///< entries in use

  /// An empty table with weights `weights` (N of them).
  void reset(A const* weights) {
    count = 0;
    start[0] = 0;
    for (unsigned k = 0; k < N; ++k) w[k] = weights[k];
  }
  /// Appends dst = sum_k w[k] * srcs[k] over n elements; false (and nothing changed) when full.
  bool add(T* d, T const* const* srcs, std::size_t n) {
    if (count == capacity) return false;
    bool aligned = reinterpret_cast<std::uintptr_t>(d) % 16 == 0;
    for (unsigned k = 0; k < N; ++k) {
      src[count][k] = srcs[k];
      aligned = aligned && reinterpret_cast<std::uintptr_t>(srcs[k]) % 16 == 0;
    }
    dst[count] = d;
    packs[count] = aligned ? n / pack : 0;
    start[count + 1] = start[count] + packs[count] + (n - packs[count] * pack);
    ++count;
    return true;
  }
  /// All units of the table (the kernel's range).
  [[nodiscard]] std::size_t units() const { return start[count]; }
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// The rank-order reductions of the shared-memory communicator, also used by the MPI engine's
// rank-order path: F32/F64 with the host communicator's kernel (reduce_bytes), integers summed
// wrapping like unsigned arithmetic. Every element is combined over the sources in rank order.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// True for the dtypes the shared-memory communicator sums: F32, F64 (sum, avg), I32, I64, U8 (sum).
constexpr bool shm_reducible(dtype t) noexcept {
  return host_reducible(t) || t == dtype::i32 || t == dtype::i64 || t == dtype::u8;
}

/// Integer sums over `srcs` in rank order, wrapping like unsigned arithmetic, into every `dsts`.
inline void sum_integers(dtype t, std::span<void const* const> srcs, std::span<void* const> dsts, std::size_t count) {
  auto const run = [&](auto zero) {
    using T = decltype(zero);
    using U = std::make_unsigned_t<T>;
    for (std::size_t i = 0; i < count; ++i) {
      U acc = 0;
      for (void const* s : srcs) acc = static_cast<U>(acc + static_cast<U>(static_cast<T const*>(s)[i]));
      for (void* d : dsts) static_cast<T*>(d)[i] = static_cast<T>(acc);
    }
  };
  switch (t) {
    case dtype::i32: return run(std::int32_t{});
    case dtype::i64: return run(std::int64_t{});
    case dtype::u8: return run(std::uint8_t{});
    default: throw invalid_argument("dparallel: no integer reduction for " + std::string(name_of(t)));
  }
}

/// The rank-order reduction of `count` elements: F32/F64/F16/BF16 with the host kernel, integers wrapping.
inline void reduce_any(dtype t, std::span<void const* const> srcs, std::span<void* const> dsts, std::size_t count,
                       reduce_op op, int n) {
  if (count == 0) return;
  if (host_reducible(t)) reduce_bytes(t, srcs, dsts, count, op, n);
  else sum_integers(t, srcs, dsts, count);
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

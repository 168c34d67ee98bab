#pragma once
// The CUDA backend's arithmetic, written with Thrust (which dispatches to CUB's vectorised
// transform): copy, zero, scale, add_scaled and the shard-weighted sum that DataParallel's reduce
// uses. Any length, any alignment; float, double, __half and __nv_bfloat16 (the half types
// accumulate in float). Every call launches on the given stream and returns at once.
//
// weighted_sum adds the weighted sources in the pairwise order of host::weighted_sum (a binary
// counter over the sources, the leftovers folded right to left), with rounded multiplications
// (__fmul_rn / __dmul_rn) so the compiler cannot fuse them into FMAs: the result does not depend
// on which device computes it, and repeats bit for bit. For up to 8 sources the kernel is
// specialised on the count (the summation tree is unrolled at compile time, so the partial sums
// live in registers, not in a dynamically indexed local array), reads 16-byte packs when every
// pointer allows it, and is batched: weighted_sums runs many sums with the same weights (every
// gradient slice a device reduces) in one launch over a table passed as the kernel's parameters
// (backend/detail/sum_batch.hpp). More sources (up to 32) take the generic loop, one launch per sum. Every view must be memory of
// the launching GPU: cuda::backend stages other GPUs' views first (backend/cuda/topology.hpp).
//
// Compile with nvcc (this header defines device code).

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/dtype.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/detail/sum_batch.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Accumulation type: float for the half types, T otherwise.
template <class T>
struct acc {
  using type = T;
};
template <>
struct acc<__half> {
  using type = float;
};
template <>
struct acc<__nv_bfloat16> {
  using type = float;
};

template <class A, class T>
__host__ __device__ inline A load(T v) {
  return static_cast<A>(v);
}
template <>
__host__ __device__ inline float load<float, __half>(__half v) {
  return __half2float(v);
}
template <>
__host__ __device__ inline float load<float, __nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <class T, class A>
__host__ __device__ inline T store(A v) {
  return static_cast<T>(v);
}
template <>
__host__ __device__ inline __half store<__half, float>(float v) {
  return __float2half_rn(v);
}
template <>
__host__ __device__ inline __nv_bfloat16 store<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <class T>
struct scale_op {
  typename acc<T>::type alpha;
  __device__ T operator()(T x) const {
    using A = typename acc<T>::type;
    return store<T>(mul_rn(load<A>(x), alpha));
  }
};

template <class T>
struct add_scaled_op {
  typename acc<T>::type alpha;
  __device__ T operator()(T d, T s) const {
    using A = typename acc<T>::type;
    return store<T>(add_rn(load<A>(d), mul_rn(alpha, load<A>(s))));
  }
};

template <class To, class From>
struct convert_op {
  __device__ To operator()(From x) const { return store<To>(load<float>(x)); }
};

/// The most sources weighted_sum takes in one pass (the kernel's parameter block holds them).
inline constexpr std::size_t max_sources = 32;

template <class T>
struct weighted_sum_op {
  using A = typename acc<T>::type;
  T* dst;
  T const* src[max_sources];
  A w[max_sources];
  unsigned count;
  __device__ void operator()(std::size_t i) const {
    A stack[6];  // a binary counter over at most 32 sources needs 6 levels
    unsigned terms[6];
    unsigned depth = 0;
    for (unsigned k = 0; k < count; ++k) {
      stack[depth] = mul_rn(w[k], load<A>(src[k][i]));
      terms[depth++] = 1;
      while (depth >= 2 && terms[depth - 1] == terms[depth - 2]) {
        stack[depth - 2] = add_rn(stack[depth - 2], stack[depth - 1]);
        terms[depth - 2] *= 2;
        --depth;
      }
    }
    while (depth >= 2) {
      stack[depth - 2] = add_rn(stack[depth - 2], stack[depth - 1]);
      --depth;
    }
    dst[i] = store<T>(stack[0]);
  }
};

/// The summation tree of host::weighted_sum over t[First .. First + N), unrolled: the largest
/// power-of-two block first, summed as a balanced tree, plus the fold of the rest (the binary
/// counter's merges, then its right-to-left fold of the leftovers).
template <unsigned N>
inline constexpr unsigned floor_pow2 = 2 * floor_pow2<N / 2>;  // a variable: usable in device code
template <>
inline constexpr unsigned floor_pow2<1> = 1;
template <class A, unsigned First, unsigned Count>
__device__ inline A balanced(A const* t) {
  if constexpr (Count == 1) return t[First];
  else return add_rn(balanced<A, First, Count / 2>(t), balanced<A, First + Count / 2, Count / 2>(t));
}
template <class A, unsigned First, unsigned N>
__device__ inline A fold(A const* t) {
  constexpr unsigned P = floor_pow2<N>;
  if constexpr (P == N) return balanced<A, First, N>(t);
  else return add_rn(balanced<A, First, P>(t), fold<A, First + P, N - P>(t));
}

/// The batched kernel: every entry of table `b` (backend/detail/sum_batch.hpp), each element's
/// sum unrolled for N sources. One grid-stride loop over the table's units: a unit is a 16-byte
/// pack of an entry whose pointers are all 16-byte aligned, or a single element. Each element
/// is computed by one thread, read before it is written, so a destination may be one of its own
/// entry's sources (entries must not overlap otherwise).
template <class T, unsigned N>
__global__ void weighted_sums_kernel(dparallel::detail::sum_batch<T, typename acc<T>::type, N> b) {
  using A = typename acc<T>::type;
  constexpr unsigned V = 16 / sizeof(T);
  struct alignas(16) pack {
    T v[V];
  };
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t const first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t const units = b.start[b.count];
  for (std::size_t u = first; u < units; u += stride) {
    unsigned const e = dparallel::detail::locate_unit(b.start, b.count, u);
    std::size_t const local = u - b.start[e];
    if (local < b.packs[e]) {
      pack in[N];
#pragma unroll
      for (unsigned k = 0; k < N; ++k) in[k] = reinterpret_cast<pack const*>(b.src[e][k])[local];
      pack out;
#pragma unroll
      for (unsigned v = 0; v < V; ++v) {
        A t[N];
#pragma unroll
        for (unsigned k = 0; k < N; ++k) t[k] = mul_rn(b.w[k], load<A>(in[k].v[v]));
        out.v[v] = store<T>(fold<A, 0, N>(t));
      }
      reinterpret_cast<pack*>(b.dst[e])[local] = out;
    } else {
      std::size_t const i = b.packs[e] * V + (local - b.packs[e]);
      A t[N];
#pragma unroll
      for (unsigned k = 0; k < N; ++k) t[k] = mul_rn(b.w[k], load<A>(b.src[e][k][i]));
      b.dst[e][i] = store<T>(fold<A, 0, N>(t));
    }
  }
}

/// Launches the batched kernel over table `b` on stream `s` (nothing when it has no units).
template <class T, unsigned N>
void launch_sums(cudaStream_t s, dparallel::detail::sum_batch<T, typename acc<T>::type, N> const& b) {
  std::size_t const units = b.units();
  if (units == 0) return;
  constexpr unsigned threads = 256;
  auto const blocks = static_cast<unsigned>(std::min<std::size_t>((units + threads - 1) / threads, 4096));
  weighted_sums_kernel<T, N><<<blocks, threads, 0, s>>>(b);
}

/// dst[j] = sum_k w[k] * src[j * N + k] for every j, in as few launches as the table's capacity
/// allows (one for a typical model's gradients).
template <class T, unsigned N>
void batched_sums(cudaStream_t s, std::span<tensor_ref const> dst, std::span<tensor_ref const> srcs,
                  std::span<double const> weights) {
  using A = typename acc<T>::type;
  A w[N];
  for (unsigned k = 0; k < N; ++k) w[k] = static_cast<A>(weights[k]);
  dparallel::detail::sum_batch<T, A, N> b{};
  b.reset(w);
  for (std::size_t j = 0; j < dst.size(); ++j) {
    if (dst[j].size() == 0) continue;
    T const* src[N];
    for (unsigned k = 0; k < N; ++k) src[k] = static_cast<T const*>(srcs[j * N + k].data());
    T* const d = static_cast<T*>(dst[j].data());
    if (b.add(d, src, dst[j].size())) continue;
    launch_sums<T, N>(s, b);
    b.reset(w);
    (void)b.add(d, src, dst[j].size());
  }
  launch_sums<T, N>(s, b);
}

/// Dispatches on the source count m: 1..8 to the batched kernel, more (up to 32) to the generic
/// loop, one launch per sum.
template <class T>
void weighted_sums_any(cudaStream_t s, std::span<tensor_ref const> dst, std::span<tensor_ref const> srcs,
                       std::span<double const> w) {
  switch (w.size()) {
    case 1: batched_sums<T, 1>(s, dst, srcs, w); return;
    case 2: batched_sums<T, 2>(s, dst, srcs, w); return;
    case 3: batched_sums<T, 3>(s, dst, srcs, w); return;
    case 4: batched_sums<T, 4>(s, dst, srcs, w); return;
    case 5: batched_sums<T, 5>(s, dst, srcs, w); return;
    case 6: batched_sums<T, 6>(s, dst, srcs, w); return;
    case 7: batched_sums<T, 7>(s, dst, srcs, w); return;
    case 8: batched_sums<T, 8>(s, dst, srcs, w); return;
    default: break;
  }
  std::size_t const m = w.size();
  for (std::size_t j = 0; j < dst.size(); ++j) {
    if (dst[j].size() == 0) continue;
    weighted_sum_op<T> op{};
    op.dst = static_cast<T*>(dst[j].data());
    op.count = static_cast<unsigned>(m);
    for (std::size_t k = 0; k < m; ++k) {
      op.src[k] = static_cast<T const*>(srcs[j * m + k].data());
      op.w[k] = static_cast<typename acc<T>::type>(w[k]);
    }
    thrust::for_each_n(thrust::cuda::par_nosync.on(s), thrust::counting_iterator<std::size_t>(0), dst[j].size(), op);
  }
}

/// Calls f(T{}) for the floating dtypes the CUDA backend computes with.
template <class F>
void dispatch_float(dtype t, F&& f, char const* what) {
  switch (t) {
    case dtype::f32: f(float{}); return;
    case dtype::f64: f(double{}); return;
    case dtype::f16: f(__half{}); return;
    case dtype::bf16: f(__nv_bfloat16{}); return;
    default: break;
  }
  throw invalid_argument(std::string("dparallel: ") + what + ": expected a floating dtype (F32, F64, F16, BF16), found " +
                         std::string(name_of(t)));
}

inline void check_same(tensor_ref dst, tensor_ref src, char const* what) {
  dparallel::detail::require(dst.dtype() == src.dtype() && dst.size() == src.size(), [&] {  // built on failure only
    return std::string(what) + ": expected views of the same dtype and size, found " + std::to_string(dst.size()) +
           " x " + std::string(name_of(dst.dtype())) + " and " + std::to_string(src.size()) + " x " +
           std::string(name_of(src.dtype()));
  });
}

}  // namespace detail

/// dst = src, on stream `s` (`at` is the stream's device, named in errors). Device-to-device on one
/// GPU, host to device and back, and between GPUs (cudaMemcpyPeerAsync: direct with peer access,
/// staged by the driver without).
inline void copy(cudaStream_t s, device at, tensor_ref dst, tensor_ref src) {
  detail::check_same(dst, src, "cuda::copy");
  if (dst.size() == 0 || dst.data() == src.data()) return;
  bool const both_gpu = dst.device().kind == device_kind::cuda && src.device().kind == device_kind::cuda;
  if (both_gpu && dst.device().index != src.device().index) {
    (void)link(dst.device().index, src.device().index);  // direct (P2P) when the pair allows it
    check(cudaMemcpyPeerAsync(dst.data(), dst.device().index, src.data(), src.device().index, dst.size_bytes(), s),
          "cudaMemcpyPeerAsync", at);
  } else {
    check(cudaMemcpyAsync(dst.data(), src.data(), dst.size_bytes(), cudaMemcpyDefault, s), "cudaMemcpyAsync", at);
  }
}

/// dst = 0.
inline void zero(cudaStream_t s, device at, tensor_ref dst) {
  if (dst.size() != 0) check(cudaMemsetAsync(dst.data(), 0, dst.size_bytes(), s), "cudaMemsetAsync", at);
}

/// dst *= alpha.
inline void scale(cudaStream_t s, device at, tensor_ref dst, double alpha) {
  if (dst.size() == 0) return;
  detail::dispatch_float(
      dst.dtype(),
      [&](auto zero_value) {
        using T = decltype(zero_value);
        using A = typename detail::acc<T>::type;
        T* d = static_cast<T*>(dst.data());
        thrust::transform(thrust::cuda::par_nosync.on(s), d, d + dst.size(), d, detail::scale_op<T>{static_cast<A>(alpha)});
      },
      "cuda::scale");
  check(cudaGetLastError(), "cuda::scale", at);
}

/// dst += alpha * src.
inline void add_scaled(cudaStream_t s, device at, tensor_ref dst, tensor_ref src, double alpha) {
  detail::check_same(dst, src, "cuda::add_scaled");
  if (dst.size() == 0) return;
  detail::dispatch_float(
      dst.dtype(),
      [&](auto zero_value) {
        using T = decltype(zero_value);
        using A = typename detail::acc<T>::type;
        T* d = static_cast<T*>(dst.data());
        T const* x = static_cast<T const*>(src.data());
        thrust::transform(thrust::cuda::par_nosync.on(s), d, d + dst.size(), x, d,
                          detail::add_scaled_op<T>{static_cast<A>(alpha)});
      },
      "cuda::add_scaled");
  check(cudaGetLastError(), "cuda::add_scaled", at);
}

/// dst = src converted between F32 and F32, F16 or BF16 (rounded to nearest even), on stream `s`;
/// both views in the memory of `at`'s GPU. nccl::dp's F32 buckets for 16-bit gradients use it.
inline void convert(cudaStream_t s, device at, tensor_ref dst, tensor_ref src) {
  dparallel::detail::require(dst.size() == src.size() && (dst.dtype() == dtype::f32 || src.dtype() == dtype::f32) &&
                                 dst.dtype() != dtype::f64 && src.dtype() != dtype::f64,
                             [&] {
                               return "cuda::convert: expected views of one size, one of them F32 and the other F32, "
                                      "F16 or BF16, found " +
                                      std::to_string(dst.size()) + " x " + std::string(name_of(dst.dtype())) + " and " +
                                      std::to_string(src.size()) + " x " + std::string(name_of(src.dtype()));
                             });
  if (dst.dtype() == src.dtype()) {
    copy(s, at, dst, src);
    return;
  }
  if (dst.size() == 0) return;
  bool const widen = dst.dtype() == dtype::f32;
  detail::dispatch_float(
      widen ? src.dtype() : dst.dtype(),
      [&](auto zero_value) {
        using T = decltype(zero_value);
        auto const policy = thrust::cuda::par_nosync.on(s);
        if (widen) {
          T const* x = static_cast<T const*>(src.data());
          thrust::transform(policy, x, x + src.size(), static_cast<float*>(dst.data()), detail::convert_op<float, T>{});
        } else {
          float const* x = static_cast<float const*>(src.data());
          thrust::transform(policy, x, x + src.size(), static_cast<T*>(dst.data()), detail::convert_op<T, float>{});
        }
      },
      "cuda::convert");
  check(cudaGetLastError(), "cuda::convert", at);
}

/// For each j: dst[j] = sum_k weights[k] * srcs[j * m + k] (m = weights.size()), summed pairwise
/// as host::weighted_sum does (dst[j] may be one of its own sources; the sums must not overlap
/// otherwise). With up to 8 sources all the sums are one batched launch (a few for very many
/// sums), which is how cuda::backend reduces every gradient slice of a device at once. Every view
/// must be memory of `at`'s GPU (a lane of it or the GPU itself): a kernel may not touch another
/// GPU's pool memory without cudaMemPoolSetAccess (see topology.hpp), so cuda::backend stages
/// remote views into local buffers before calling this.
inline void weighted_sums(cudaStream_t s, device at, std::span<tensor_ref const> dst, std::span<tensor_ref const> srcs,
                          std::span<double const> weights) {
  std::size_t const m = weights.size();
  dparallel::detail::require(m != 0 && srcs.size() == dst.size() * m,
                             "cuda::weighted_sum: expected one weight per source, at least one source, and as many "
                             "sources for each destination, found " + std::to_string(weights.size()) + " weights and " +
                                 std::to_string(srcs.size()) + " sources for " + std::to_string(dst.size()) +
                                 " destination(s)");
  dparallel::detail::require(m <= detail::max_sources, "cuda::weighted_sum: expected at most " +
                                                           std::to_string(detail::max_sources) + " sources, found " +
                                                           std::to_string(m));
  if (dst.empty()) return;
  auto const local = [&](tensor_ref t) { return t.device().kind == device_kind::cuda && t.device().index == at.index; };
  for (std::size_t j = 0; j < dst.size(); ++j) {
    dparallel::detail::require(dst[j].dtype() == dst[0].dtype(), [&] {
      return "cuda::weighted_sum: expected every destination of dtype " + std::string(name_of(dst[0].dtype())) +
             ", found " + std::string(name_of(dst[j].dtype())) + " for destination " + std::to_string(j);
    });
    bool all_local = local(dst[j]);
    for (std::size_t k = 0; k < m; ++k) {
      detail::check_same(dst[j], srcs[j * m + k], "cuda::weighted_sum");
      all_local = all_local && local(srcs[j * m + k]);
    }
    dparallel::detail::require(all_local || dst[j].size() == 0, [&] {
      return "cuda::weighted_sum on " + to_string(at) + ": expected every view in the memory of GPU " +
             std::to_string(at.index) + ", found one elsewhere; copy it to this GPU first (cuda::backend's "
             "weighted_sum stages other GPUs' views itself)";
    });
  }
  detail::dispatch_float(
      dst[0].dtype(), [&](auto zero_value) { detail::weighted_sums_any<decltype(zero_value)>(s, dst, srcs, weights); },
      "cuda::weighted_sum");
  check(cudaGetLastError(), "cuda::weighted_sum", at);
}

/// dst = sum_k weights[k] * srcs[k], summed pairwise as host::weighted_sum does (dst may be one
/// of the sources): weighted_sums with one destination (same rules).
inline void weighted_sum(cudaStream_t s, device at, tensor_ref dst, std::span<tensor_ref const> srcs,
                         std::span<double const> weights) {
  weighted_sums(s, at, std::span<tensor_ref const>(&dst, 1), srcs, weights);
}

}  // namespace cuda
DPARALLEL_NAMESPACE_END

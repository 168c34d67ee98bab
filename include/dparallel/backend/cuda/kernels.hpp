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
// live in registers, not in a dynamically indexed local array) and reads 16-byte packs when every
// pointer allows it; more sources (up to 32) take the generic loop. Every view must be memory of
// the launching GPU: cuda::backend stages other GPUs' views first (backend/cuda/topology.hpp).
//
// Compile with nvcc (this header defines device code).

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/dtype.hpp>
#include <dparallel/backend/cuda/error.hpp>
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

/// The arguments of the specialised kernel: N sources, passed by value in the parameter block.
template <class T, unsigned N>
struct weighted_sum_args {
  T* dst;
  T const* src[N];
  typename acc<T>::type w[N];
};

/// dst = sum_k w[k] * src[k] over n elements; the first `packs` 16-byte packs are read as packs
/// (every pointer is 16-byte aligned then), the rest one element at a time. Grid-stride loops.
template <class T, unsigned N>
__global__ void weighted_sum_kernel(weighted_sum_args<T, N> a, std::size_t n, std::size_t packs) {
  using A = typename acc<T>::type;
  constexpr unsigned V = 16 / sizeof(T);
  struct alignas(16) pack {
    T v[V];
  };
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t const first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::size_t p = first; p < packs; p += stride) {
    pack in[N];
#pragma unroll
    for (unsigned k = 0; k < N; ++k) in[k] = reinterpret_cast<pack const*>(a.src[k])[p];
    pack out;
#pragma unroll
    for (unsigned e = 0; e < V; ++e) {
      A t[N];
#pragma unroll
      for (unsigned k = 0; k < N; ++k) t[k] = mul_rn(a.w[k], load<A>(in[k].v[e]));
      out.v[e] = store<T>(fold<A, 0, N>(t));
    }
    reinterpret_cast<pack*>(a.dst)[p] = out;
  }
  for (std::size_t i = packs * V + first; i < n; i += stride) {
    A t[N];
#pragma unroll
    for (unsigned k = 0; k < N; ++k) t[k] = mul_rn(a.w[k], load<A>(a.src[k][i]));
    a.dst[i] = store<T>(fold<A, 0, N>(t));
  }
}

/// Launches the specialised kernel for N sources on stream `s`.
template <class T, unsigned N>
void launch_weighted_sum(cudaStream_t s, T* dst, T const* const* src, typename acc<T>::type const* w,
                         std::size_t n) {
  weighted_sum_args<T, N> a{};
  a.dst = dst;
  bool aligned = reinterpret_cast<std::uintptr_t>(dst) % 16 == 0;
  for (unsigned k = 0; k < N; ++k) {
    a.src[k] = src[k];
    a.w[k] = w[k];
    aligned = aligned && reinterpret_cast<std::uintptr_t>(src[k]) % 16 == 0;
  }
  constexpr std::size_t V = 16 / sizeof(T);
  std::size_t const packs = aligned ? n / V : 0;
  std::size_t const units = packs + (n - packs * V);
  constexpr unsigned threads = 256;
  auto const blocks = static_cast<unsigned>(std::min<std::size_t>((units + threads - 1) / threads, 4096));
  weighted_sum_kernel<T, N><<<blocks, threads, 0, s>>>(a, n, packs);
}

/// Dispatches on the source count: 1..8 to the specialised kernel, more to the generic loop.
template <class T>
void weighted_sum_any(cudaStream_t s, T* dst, T const* const* src, typename acc<T>::type const* w, std::size_t count,
                      std::size_t n) {
  switch (count) {
    case 1: launch_weighted_sum<T, 1>(s, dst, src, w, n); return;
    case 2: launch_weighted_sum<T, 2>(s, dst, src, w, n); return;
    case 3: launch_weighted_sum<T, 3>(s, dst, src, w, n); return;
    case 4: launch_weighted_sum<T, 4>(s, dst, src, w, n); return;
    case 5: launch_weighted_sum<T, 5>(s, dst, src, w, n); return;
    case 6: launch_weighted_sum<T, 6>(s, dst, src, w, n); return;
    case 7: launch_weighted_sum<T, 7>(s, dst, src, w, n); return;
    case 8: launch_weighted_sum<T, 8>(s, dst, src, w, n); return;
    default: break;
  }
  weighted_sum_op<T> op{};
  op.dst = dst;
  op.count = static_cast<unsigned>(count);
  for (std::size_t k = 0; k < count; ++k) {
    op.src[k] = src[k];
    op.w[k] = w[k];
  }
  thrust::for_each_n(thrust::cuda::par_nosync.on(s), thrust::counting_iterator<std::size_t>(0), n, op);
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
  dparallel::detail::require(dst.dtype() == src.dtype() && dst.size() == src.size(),
                             std::string(what) + ": expected views of the same dtype and size, found " +
                                 std::to_string(dst.size()) + " x " + std::string(name_of(dst.dtype())) + " and " +
                                 std::to_string(src.size()) + " x " + std::string(name_of(src.dtype())));
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

/// dst = sum_k weights[k] * srcs[k], summed pairwise as host::weighted_sum does (dst may be one
/// of the sources). Every view must be memory of `at`'s GPU (a lane of it or the GPU itself): a
/// kernel may not touch another GPU's pool memory without cudaMemPoolSetAccess (see
/// topology.hpp), so cuda::backend stages remote views into local buffers before calling this.
inline void weighted_sum(cudaStream_t s, device at, tensor_ref dst, std::span<tensor_ref const> srcs,
                         std::span<double const> weights) {
  dparallel::detail::require(!srcs.empty() && srcs.size() == weights.size(),
                             "cuda::weighted_sum: expected one weight per source and at least one source, found " +
                                 std::to_string(srcs.size()) + " sources and " + std::to_string(weights.size()) +
                                 " weights");
  dparallel::detail::require(srcs.size() <= detail::max_sources,
                             "cuda::weighted_sum: expected at most " + std::to_string(detail::max_sources) +
                                 " sources, found " + std::to_string(srcs.size()));
  for (auto const& x : srcs) detail::check_same(dst, x, "cuda::weighted_sum");
  if (dst.size() == 0) return;
  auto const local = [&](tensor_ref t) { return t.device().kind == device_kind::cuda && t.device().index == at.index; };
  bool all_local = local(dst);
  for (auto const& x : srcs) all_local = all_local && local(x);
  dparallel::detail::require(all_local, "cuda::weighted_sum on " + to_string(at) +
                                            ": expected every view in the memory of GPU " + std::to_string(at.index) +
                                            ", found one elsewhere; copy it to this GPU first (cuda::backend's "
                                            "weighted_sum stages other GPUs' views itself)");
  detail::dispatch_float(
      dst.dtype(),
      [&](auto zero_value) {
        using T = decltype(zero_value);
        using A = typename detail::acc<T>::type;
        T const* src[detail::max_sources];
        A w[detail::max_sources];
        for (std::size_t k = 0; k < srcs.size(); ++k) {
          src[k] = static_cast<T const*>(srcs[k].data());
          w[k] = static_cast<A>(weights[k]);
        }
        detail::weighted_sum_any<T>(s, static_cast<T*>(dst.data()), src, w, srcs.size(), dst.size());
      },
      "cuda::weighted_sum");
  check(cudaGetLastError(), "cuda::weighted_sum", at);
}

}  // namespace cuda
DPARALLEL_NAMESPACE_END

#pragma once
// fp16_compress and bf16_compress for gradient buckets in GPU memory (compiled by nvcc): the
// counterparts of policy/compress_hooks.hpp's host hooks, with the same arithmetic, for DDP on the
// CUDA backend over NCCL.
//
//   ddp.reducer().register_comm_hook(dparallel::cuda::compress_state{.error_feedback = true},
//                                    dparallel::cuda::bf16_compress);
//
// For each F32 bucket: x = the bucket (+ each parameter's residual of the previous step with error
// feedback); c = x rounded to 16 bits, nearest even (__float2half_rn, __float2bfloat16_rn: the
// host's rounding); the residual becomes x - c; c is all-reduced with reduce_op::avg (NCCL's native
// 16-bit average: NCCL's order and accumulation, so within rounding of the host engines' float
// rank-order sum, bitwise equal to it for one rank); the bucket becomes the 16-bit average widened
// to float. The additions and subtractions use __fadd_rn / __fsub_rn (never contracted), so a
// kernel's values are the host loop's bit for bit.
//
// Stream ordering. The hook runs on the thread that launches the bucket, inside the wrapper's
// stream work: the compression kernels go to cuda::current_stream() (the legacy default stream
// outside stream work), and the NCCL engine orders the all-reduce after the work captured on that
// stream (it waits on an event recorded there: cudaStreamWaitEvent). The continuation runs after
// the collective's work completed (its event waited on the host), so the widening kernel, issued
// on the current stream then, reads the finished average; the reducer's later copies go to the
// same stream, after it. The hook's device buffers (a 16-bit copy per bucket, a residual per
// parameter) are allocated on that stream and freed on the legacy default stream, which outlives
// the wrapper's streams (memory.hpp, device_buffer::free_on).
#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/memory.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/comm_hook.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

/// The state of cuda::fp16_compress and cuda::bf16_compress: the option, and the device memory
/// the hook keeps between steps.
struct compress_state {
  /// Error feedback: add each parameter's rounding residual of the previous synchronised step to
  /// its gradient before compressing it (as the host hooks' compress_state::error_feedback).
  bool error_feedback = false;
  /// The 16-bit copy of each bucket, by bucket index.
  std::vector<device_buffer<std::uint16_t>> wire{};
  /// Each parameter's residual, by parameter index (empty until its first compression).
  std::vector<device_buffer<float>> residual{};
};

namespace detail {

template <class H>
__device__ inline std::uint16_t round16(float v) {
  if constexpr (std::is_same_v<H, __half>) return __half_as_ushort(__float2half_rn(v));
  else return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
template <class H>
__device__ inline float widen16(std::uint16_t bits) {
  if constexpr (std::is_same_v<H, __half>) return __half2float(__ushort_as_half(bits));
  else return __bfloat162float(__ushort_as_bfloat16(bits));
}

/// c[i] = round16(x[i] + r[i]) and r[i] = (x[i] + r[i]) - widen(c[i]); without r, c[i] = round16(x[i]).
template <class H>
__global__ void compress16_kernel(float const* x, float* r, std::uint16_t* c, std::size_t n) {
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float const v = r != nullptr ? __fadd_rn(x[i], r[i]) : x[i];
    std::uint16_t const h = round16<H>(v);
    c[i] = h;
    if (r != nullptr) r[i] = __fsub_rn(v, widen16<H>(h));
  }
}

/// y[i] = widen(c[i]).
template <class H>
__global__ void widen16_kernel(std::uint16_t const* c, float* y, std::size_t n) {
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = widen16<H>(c[i]);
}

inline unsigned blocks_for(std::size_t n) {
  return static_cast<unsigned>(std::clamp<std::size_t>((n + 255) / 256, 1, 4096));
}

/// cuda::fp16_compress (H = __half) and cuda::bf16_compress (H = __nv_bfloat16).
template <class H>
struct compress_hook {
  bucket_future operator()(compress_state& st, process_group const& g, grad_bucket const& b) const {
    constexpr bool half = std::is_same_v<H, __half>;
    char const* const name = half ? "cuda::fp16_compress" : "cuda::bf16_compress";
    dparallel::detail::require(b.data.dtype() == dtype::f32, [&] {
      return std::string(name) + ": expected an F32 gradient bucket, found " + std::string(name_of(b.data.dtype())) +
             " (bucket " + std::to_string(b.index) + "); register no hook for such models";
    });
    std::size_t const n = b.data.size();
    dparallel::detail::require(n == 0 || b.data.device().kind == device_kind::cuda, [&] {
      return std::string(name) + ": expected the bucket in GPU memory, found it on " + to_string(b.data.device()) +
             "; for host buckets register dparallel::" + (half ? "fp16_compress" : "bf16_compress") +
             " (policy/compress_hooks.hpp)";
    });
    if (n == 0) return bucket_future(b.data);  // every rank has the same plan: none reduces it
    device const dev = b.data.device();
    cudaStream_t const s = current_stream();
    device_guard guard(dev.index);
    if (st.wire.size() <= b.index) st.wire.resize(b.index + 1);
    auto& wire = st.wire[b.index];
    if (wire.size() != n || wire.where() != dev) {
      wire = device_buffer<std::uint16_t>(n, dev, s, uninitialized);
      wire.free_on(nullptr);
    }
    auto* const x = static_cast<float*>(b.data.data());
    std::uint16_t* const c = wire.data();
    if (!st.error_feedback) {
      compress16_kernel<H><<<blocks_for(n), 256, 0, s>>>(x, nullptr, c, n);
    } else {
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        std::size_t const p = b.params[k], off = b.offsets[k], len = b.sizes[p];
        if (len == 0) continue;
        if (st.residual.size() <= p) st.residual.resize(p + 1);
        auto& r = st.residual[p];
        if (r.size() != len) {
          r = device_buffer<float>(len, dev, s);  // zeroed on s
          r.free_on(nullptr);
        }
        compress16_kernel<H><<<blocks_for(len), 256, 0, s>>>(x + off, r.data(), c + off, len);
      }
    }
    check(cudaGetLastError(), name, dev);
    work w = g.all_reduce(tensor_ref(c, n, half ? dtype::f16 : dtype::bf16, dev), reduce_op::avg);
    tensor_ref const out = b.data;
    return bucket_future(std::move(w), [out, c, n, dev, name] {
      device_guard guard2(dev.index);
      widen16_kernel<H><<<blocks_for(n), 256, 0, current_stream()>>>(c, static_cast<float*>(out.data()), n);
      check(cudaGetLastError(), name, dev);
      return out;
    });
  }
};

}  // namespace detail

/// fp16 compression of GPU buckets (see the top of policy/cuda/compress_hooks.hpp).
inline constexpr detail::compress_hook<__half> fp16_compress{};
/// bf16 compression of GPU buckets (see the top of policy/cuda/compress_hooks.hpp).
inline constexpr detail::compress_hook<__nv_bfloat16> bf16_compress{};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

#pragma once
// The optimizers' update rules on the GPU: optim::optimizer<Rule, cuda::backend> updates its
// parameters with one kernel launch per parameter tensor, each thread calling the rule's own
// per-element function (Rule::update, optim/element.hpp). The operations and their order are the
// host's; optim/element.hpp's arithmetic helpers use the round-to-nearest intrinsics in device
// code (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn), which nvcc never contracts into FMAs, so a
// GPU update gives the same bits as the host's.
//
//   #include <dparallel/optim/cuda/kernels.hpp>
//   dparallel::data_parallel<my_model, dparallel::cuda::backend> dp(model, dparallel::cuda::devices(2));
//   dparallel::optim::optimizer opt(dp, dparallel::optim::adam());   // state in GPU memory
//   dp.step(batch, step_fn);
//   opt.step(dp, 1e-3);
//
// Compile with nvcc (this header defines device code); the rule must be an optim::element_rule.
//
// F16/BF16 parameters with an F32 master copy (optim::optimizer_options::master_weights): one
// kernel per tensor widens the gradient (exact), runs Rule::update on the master element and
// stores the master rounded to nearest even (__float2half_rn / __float2bfloat16_rn: the rounding
// of core/half.hpp's host conversions), so the GPU's 16-bit parameters are the host's bits too.

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/optim/element.hpp>
#include <dparallel/optim/optimizer.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// The slot pointers of one tensor, passed by value as a kernel parameter.
template <std::size_t N>
struct slot_pointers {
  float* at[N];
};

/// p[i], g[i] and the slots' element i for every i < n: R::update, a grid-stride loop.
template <class R, std::size_t N>
__global__ void optim_update(typename R::step_constants c, float* p, float const* g, slot_pointers<N> s,
                             std::size_t n) {
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    R::update(c, p[i], g[i], s.at, i);
}

/// The float of 16-bit bits `b` (bf16 when `Brain`, else f16): exact.
template <bool Brain>
__device__ inline float widen16(std::uint16_t b) {
  if constexpr (Brain) return __bfloat162float(__ushort_as_bfloat16(b));
  else return __half2float(__ushort_as_half(b));
}
/// The 16-bit bits nearest to `f` (ties to even).
template <bool Brain>
__device__ inline std::uint16_t narrow16(float f) {
  if constexpr (Brain) return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  else return __half_as_ushort(__float2half_rn(f));
}

/// The master-copy update of a 16-bit tensor: master[i] by R::update from g[i] widened, then
/// p[i] = master[i] rounded to nearest even; a grid-stride loop.
template <class R, std::size_t N, bool Brain>
__global__ void optim_update_master(typename R::step_constants c, std::uint16_t* p, std::uint16_t const* g,
                                    float* master, slot_pointers<N> s, std::size_t n) {
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    R::update(c, master[i], widen16<Brain>(g[i]), s.at, i);
    p[i] = narrow16<Brain>(master[i]);
  }
}

/// master[i] = p[i] widened, for every i < n.
template <bool Brain>
__global__ void optim_widen(float* master, std::uint16_t const* p, std::size_t n) {
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    master[i] = widen16<Brain>(p[i]);
}

/// Blocks of 256 threads for n elements (a grid-stride loop covers the rest).
inline unsigned optim_blocks(std::size_t n) {
  return static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 65535));
}

/// The stream an optimizer's kernels go to on the calling thread: the stream of the work it runs
/// in, when that work is on `at`'s GPU; otherwise the legacy default stream of that GPU.
inline cudaStream_t optim_stream(device at) {
  auto const& cur = current();
  return cur.set && cur.dev.index == at.index ? cur.stream : nullptr;
}

}  // namespace detail
}  // namespace cuda

namespace optim {

/// The CUDA backend: one kernel per parameter tensor (see optim/cuda/kernels.hpp).
template <>
struct backend_kernels<cuda::backend> {
  /// The slot pointers `s` as a kernel parameter; refuses a rule with no per-element form.
  template <update_rule R>
  static auto slots_of(std::span<float* const> s) {
    static_assert(element_rule<R>,
                  "dparallel: optimizer<Rule, cuda::backend> needs a rule with a per-element "
                  "`static DPARALLEL_HOST_DEVICE void update(c, p, g, s, i)` (optim::element_rule)");
    cuda::detail::slot_pointers<optim::detail::slot_array_size<R>> slots{};
    for (std::size_t k = 0; k < s.size() && k < optim::detail::slot_array_size<R>; ++k) slots.at[k] = s[k];
    return slots;
  }
  /// Launches the update of the f32 tensor `p` (GPU memory) from `g` and the slots `s`.
  template <update_rule R>
  static void apply(R const&, typename R::step_constants const& c, tensor_ref p, tensor_ref g,
                    std::span<float* const> s) {
    if (p.size() == 0) return;
    constexpr std::size_t n_slots = optim::detail::slot_array_size<R>;
    auto const slots = slots_of<R>(s);
    cuda::device_guard const guard(p.device().index);
    cuda::detail::optim_update<R, n_slots><<<cuda::detail::optim_blocks(p.size()), 256, 0,
                                             cuda::detail::optim_stream(p.device())>>>(
        c, static_cast<float*>(p.data()), static_cast<float const*>(g.data()), slots, p.size());
    cuda::check(cudaGetLastError(), "optimizer update kernel", p.device());
  }
  /// Launches the master-copy update of the 16-bit tensor `p` (see the top of
  /// optim/cuda/kernels.hpp); `master` is F32 GPU memory of p.size() elements.
  template <update_rule R>
  static void apply_master(R const&, typename R::step_constants const& c, tensor_ref p, tensor_ref g,
                           float* master, std::span<float* const> s) {
    if (p.size() == 0) return;
    constexpr std::size_t n_slots = optim::detail::slot_array_size<R>;
    auto const slots = slots_of<R>(s);
    cuda::device_guard const guard(p.device().index);
    auto* const pv = static_cast<std::uint16_t*>(p.data());
    auto const* const gv = static_cast<std::uint16_t const*>(g.data());
    auto const blocks = cuda::detail::optim_blocks(p.size());
    cudaStream_t const st = cuda::detail::optim_stream(p.device());
    if (p.dtype() == dtype::bf16)
      cuda::detail::optim_update_master<R, n_slots, true><<<blocks, 256, 0, st>>>(c, pv, gv, master, slots, p.size());
    else
      cuda::detail::optim_update_master<R, n_slots, false><<<blocks, 256, 0, st>>>(c, pv, gv, master, slots, p.size());
    cuda::check(cudaGetLastError(), "optimizer master-copy update kernel", p.device());
  }
  /// Launches master = `p` (16-bit, GPU memory) widened to F32.
  static void widen(float* master, tensor_ref p) {
    if (p.size() == 0) return;
    cuda::device_guard const guard(p.device().index);
    auto const* const pv = static_cast<std::uint16_t const*>(p.data());
    auto const blocks = cuda::detail::optim_blocks(p.size());
    cudaStream_t const st = cuda::detail::optim_stream(p.device());
    if (p.dtype() == dtype::bf16) cuda::detail::optim_widen<true><<<blocks, 256, 0, st>>>(master, pv, p.size());
    else cuda::detail::optim_widen<false><<<blocks, 256, 0, st>>>(master, pv, p.size());
    cuda::check(cudaGetLastError(), "optimizer master-copy widening kernel", p.device());
  }
  /// dst = src (GPU memory of one device), on the stream the updates go to: ordered after the
  /// updates launched before it and before those launched after it (CUDA: work on one stream runs
  /// in issue order).
  static void copy(tensor_ref dst, tensor_ref src) {
    cuda::device_guard const guard(dst.device().index);
    cuda::copy(cuda::detail::optim_stream(dst.device()), dst.device(), dst, src);
  }
  /// Waits for the updates launched on `d`'s stream. Ordering (CUDA streams): the gradients were
  /// written by work that the wrapper's step() waited for before returning, so kernels launched
  /// after it read them complete; the wrapper's streams are non-blocking (they do not wait for the
  /// legacy default stream), so the next step() would not wait for these kernels: synchronize here.
  static void finish(device d) {
    if (d.kind != device_kind::cuda) return;
    cuda::device_guard const guard(d.index);
    cuda::check(cudaStreamSynchronize(cuda::detail::optim_stream(d)), "cudaStreamSynchronize", d);
  }
};

}  // namespace optim
DPARALLEL_NAMESPACE_END

#pragma once
// The optimizers' update rules on the GPU: optim::optimizer<Rule, cuda::backend> updates its
// parameters with one kernel launch per parameter tensor, each thread calling the rule's own
// per-element function (Rule::update, optim/element.hpp). The operations and their order are the
// host's; optim/element.hpp's arithmetic helpers use the round-to-nearest intrinsics in device
// code (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn), which nvcc never contracts into FMAs, so a
// GPU update gives the same bits as the host's.
//
//   #include <dparallel/backend/cuda/optim_kernels.hpp>
//   dparallel::data_parallel<my_model, dparallel::cuda::backend> dp(model, dparallel::cuda::devices(2));
//   dparallel::optim::optimizer opt(dp, dparallel::optim::adam());   // state in GPU memory
//   dp.step(batch, step_fn);
//   opt.step(dp, 1e-3);
//
// Compile with nvcc (this header defines device code); the rule must be an optim::element_rule.

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/optim/element.hpp>
#include <dparallel/optim/optimizer.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
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

/// The stream an optimizer's kernels go to on the calling thread: the stream of the work it runs
/// in, when that work is on `at`'s GPU; otherwise the legacy default stream of that GPU.
inline cudaStream_t optim_stream(device at) {
  auto const& cur = current();
  return cur.set && cur.dev.index == at.index ? cur.stream : nullptr;
}

}  // namespace detail
}  // namespace cuda

namespace optim {

/// The CUDA backend: one kernel per parameter tensor (see backend/cuda/optim_kernels.hpp).
template <>
struct backend_kernels<cuda::backend> {
  /// Launches the update of the f32 tensor `p` (GPU memory) from `g` and the slots `s`.
  template <update_rule R>
  static void apply(R const&, typename R::step_constants const& c, tensor_ref p, tensor_ref g,
                    std::span<float* const> s) {
    static_assert(element_rule<R>,
                  "dparallel: optimizer<Rule, cuda::backend> needs a rule with a per-element "
                  "`static DPARALLEL_HOST_DEVICE void update(c, p, g, s, i)` (optim::element_rule)");
    if (p.size() == 0) return;
    constexpr std::size_t n_slots = R::slot_count == 0 ? 1 : R::slot_count;
    cuda::detail::slot_pointers<n_slots> slots{};
    for (std::size_t k = 0; k < s.size() && k < n_slots; ++k) slots.at[k] = s[k];
    cuda::device_guard const guard(p.device().index);
    unsigned const threads = 256;
    auto const blocks = static_cast<unsigned>(std::min<std::size_t>((p.size() + threads - 1) / threads, 65535));
    cuda::detail::optim_update<R, n_slots><<<blocks, threads, 0, cuda::detail::optim_stream(p.device())>>>(
        c, static_cast<float*>(p.data()), static_cast<float const*>(g.data()), slots, p.size());
    cuda::check(cudaGetLastError(), "optimizer update kernel", p.device());
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

#pragma once
// Built-in communication hooks (policy/comm_hook.hpp): fp16_compress and bf16_compress, PyTorch's
// fp16_compress_hook / bf16_compress_hook with dparallel's 16-bit reduction.
//
// For each F32 bucket, on every rank: x = the bucket (+ the residual of the previous step with
// error feedback); c = x rounded to 16 bits (nearest even); the residual becomes x - c (error
// feedback only); c is all-reduced with reduce_op::avg, which every dparallel engine computes in
// float (the 16-bit values widened exactly, summed in rank order 0..n-1, times 1.0f / n, rounded
// once to 16 bits; NCCL: its native 16-bit all-reduce, see docs/comm-hooks.md); the bucket
// becomes the 16-bit average widened to float. So the bytes on the wire are halved, and the
// result is the same bits on every rank and engine that sums in rank order. The residual is kept
// per parameter (it survives the reducer's re-planning of its buckets after the first step).
// The buckets must be F32 and in host memory (the host backend; host-staged engines).
//
//   ddp.reducer().register_comm_hook(dparallel::compress_state{.error_feedback = true}, dparallel::bf16_compress);

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/comm_hook.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// The state of fp16_compress and bf16_compress: the option, and what the hook keeps between
/// steps (one compressed buffer per bucket, one residual per parameter).
struct compress_state {
  /// Error feedback: add each parameter's rounding residual of the previous synchronised step
  /// (what its 16-bit copy lost) to the gradient before compressing it, so the error does not
  /// accumulate over training.
  bool error_feedback = false;
  /// The 16-bit copy of each bucket, by bucket index (the hook's working memory).
  std::vector<std::vector<std::uint16_t>> wire{};
  /// Each parameter's residual, by parameter index (empty until its first compression).
  std::vector<std::vector<float>> residual{};
};

namespace detail {

/// fp16_compress (H = f16) and bf16_compress (H = bf16); see the top of policy/compress_hooks.hpp.
template <class H>
struct compress_hook {
  /// Compresses `b`, starts its 16-bit average over `g`; the continuation writes it back as F32.
  bucket_future operator()(compress_state& st, process_group const& g, grad_bucket const& b) const {
    static_assert(sizeof(H) == sizeof(std::uint16_t));
    char const* const name = std::is_same_v<H, f16> ? "fp16_compress" : "bf16_compress";
    require(b.data.dtype() == dtype::f32, [&] {
      return std::string(name) + ": expected an F32 gradient bucket, found " + std::string(name_of(b.data.dtype())) +
             " (bucket " + std::to_string(b.index) + "); register no hook for such models";
    });
    require(b.data.size() == 0 || b.data.device().kind == device_kind::host, [&] {
      return std::string(name) + ": expected the bucket in host memory, found it on " + to_string(b.data.device()) +
             "; these hooks convert on the host: for GPU buckets register dparallel::cuda::" + name +
             " (<dparallel/policy/cuda/compress_hooks.hpp>)";
    });
    std::size_t const n = b.data.size();
    if (st.wire.size() <= b.index) st.wire.resize(b.index + 1);
    auto& wire = st.wire[b.index];
    wire.resize(n);
    auto* const x = static_cast<float*>(b.data.data());
    std::uint16_t* const c = wire.data();
    if (!st.error_feedback) {
      for (std::size_t i = 0; i < n; ++i) c[i] = H(x[i]).bits;
    } else {
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        std::size_t const p = b.params[k], off = b.offsets[k], len = b.sizes[p];
        if (st.residual.size() <= p) st.residual.resize(p + 1);
        auto& r = st.residual[p];
        if (r.size() != len) r.assign(len, 0.0f);
        for (std::size_t i = 0; i < len; ++i) {
          float const v = x[off + i] + r[i];
          H const h(v);
          c[off + i] = h.bits;
          r[i] = v - static_cast<float>(h);
        }
      }
    }
    work w = g.all_reduce(tensor_ref(c, n, dtype_v<H>, host_memory), reduce_op::avg);
    tensor_ref const out = b.data;
    return bucket_future(std::move(w), [out, c, n] {
      auto* const y = static_cast<float*>(out.data());
      for (std::size_t i = 0; i < n; ++i) y[i] = static_cast<float>(H::from_bits(c[i]));
      return out;
    });
  }
};

}  // namespace detail

/// The fp16 compression hook: F32 buckets averaged as IEEE half precision (see compress_state).
inline constexpr detail::compress_hook<f16> fp16_compress{};
/// The bf16 compression hook: F32 buckets averaged as bfloat16 (see compress_state).
inline constexpr detail::compress_hook<bf16> bf16_compress{};

DPARALLEL_NAMESPACE_END

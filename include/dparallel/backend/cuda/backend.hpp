#pragma once
// The CUDA backend: logical devices are (GPU ordinal, lane) pairs, each with its own stream. The
// same policy code that drives host::backend drives this one; only the memory and the kernels
// differ. Part of the CUDA add-on: link dparallel::cuda and compile with nvcc.
//
//   dparallel::data_parallel<my_model, dparallel::cuda::backend> dp(model, dparallel::cuda::devices(2));
//
// Inside a step function, launch the model's kernels on dparallel::cuda::current_stream().
//
// Moving data between logical devices (backend/cuda/topology.hpp): lanes of one GPU read each
// other's memory in place; between distinct GPUs every byte travels by cudaMemcpyPeerAsync into a
// persistent buffer of the reading GPU's stream, and kernels touch local memory only. DataParallel
// on this backend is therefore correct on any set of GPUs: its shards are copied to their devices
// (place_shard), its replicas receive the master's parameters by peer copies (copy_all, on the
// replica's stream), and its reduction stages the other GPUs' gradient slices before summing
// (weighted_sum), as PyTorch's DataParallel does with scatter, broadcast_coalesced and
// reduce_add_coalesced.

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/dtype.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/kernels.hpp>
#include <dparallel/backend/cuda/memory.hpp>
#include <dparallel/backend/cuda/stream.hpp>
#include <dparallel/backend/cuda/topology.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dp_plan.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/profile.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

/// Name, memory size and multiprocessor count of `d`'s GPU (what DataParallel's construction
/// compares to warn about devices that differ by more than 25%).
inline device_properties describe_device(device d) {
  check_device(d);
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, d.index), "cudaGetDeviceProperties", d);
  device_properties out;
  out.total_memory_bytes = p.totalGlobalMem;
  out.multiprocessors = p.multiProcessorCount;
  out.name = p.name;
  return out;
}

namespace detail {

/// The views' GPU ordinals (-1: host memory) and byte sizes, then their staging plan for work on
/// GPU `here`. The lists are the launch thread's own, refilled in place (no allocation once grown).
inline staging_plan const& plan_for(int here, std::span<tensor_ref const> views) {
  thread_local std::vector<int> ordinals;
  thread_local std::vector<std::size_t> sizes;
  thread_local staging_plan plan;
  ordinals.clear();
  sizes.clear();
  for (auto const& v : views) {
    ordinals.push_back(v.device().kind == device_kind::cuda ? v.device().index : -1);
    sizes.push_back(v.size_bytes());
  }
  plan_staging(here, ordinals, sizes, plan);
  return plan;
}

/// `v` (another GPU's memory, or host memory) copied into `at` (memory of stream `s`'s GPU) on `s`,
/// the stream of the GPU that reads it (cuda::copy: peer copies with the pair's grants): the copy
/// is ordered after the stream's earlier work (the waits the policies put on it) and before its
/// later kernels. Returns the local view.
inline tensor_ref stage_from_peer(stream& s, tensor_ref v, std::byte* at) {
  tensor_ref const local(at, v.size(), v.dtype(), s.logical_device());
  cuda::copy(s.native(), s.logical_device(), local, v);
  return local;
}

/// Several weighted sums, run in work on `s`: for each j, dst[j] = sum_k w[k] * srcs[j*m + k]
/// (m = w.size()). Views on other GPUs are copied into the stream's persistent staging first; a
/// destination on another GPU is computed in staging and copied back, all on `s`.
inline void staged_weighted_sums(stream& s, std::span<tensor_ref const> dst, std::span<tensor_ref const> srcs,
                                 std::span<double const> w) {
  int const here = s.device_index();
  thread_local std::vector<tensor_ref> views, local;
  views.assign(dst.begin(), dst.end());
  views.insert(views.end(), srcs.begin(), srcs.end());
  staging_plan const& plan = plan_for(here, views);
  std::byte* const base = plan.bytes != 0 ? s.staging(1, plan.bytes) : nullptr;
  local.assign(views.begin(), views.end());
  for (std::size_t i = dst.size(); i < views.size(); ++i)
    if (plan.offset[i] != staging_plan::npos) local[i] = stage_from_peer(s, views[i], base + plan.offset[i]);
  for (std::size_t j = 0; j < dst.size(); ++j)
    if (plan.offset[j] != staging_plan::npos)
      local[j] = tensor_ref(base + plan.offset[j], dst[j].size(), dst[j].dtype(), s.logical_device());
  // Every sum in one batched launch (cuda::weighted_sums), not one launch per gradient; then the
  // staged destinations go back, on the same stream (after the kernel).
  std::span<tensor_ref const> const all(local);
  cuda::weighted_sums(s.native(), s.logical_device(), all.first(dst.size()), all.subspan(dst.size()), w);
  for (std::size_t j = 0; j < dst.size(); ++j)
    if (plan.offset[j] != staging_plan::npos) cuda::copy(s.native(), s.logical_device(), dst[j], local[j]);
}

}  // namespace detail

/// The backend tag handed to parallel<>.
struct backend {
  /// The CUDA stream of a logical device.
  using stream_type = cuda::stream;
  /// What the stream operations return: a CUDA event to wait on.
  using event_type = cuda::event;
  /// The kind of device this backend runs on.
  static constexpr device_kind kind = device_kind::cuda;
  /// DataParallel's layout (core/dp_plan.hpp): each replica pulls the master's tensors whole on
  /// its own stream (one peer copy per tensor, whose endpoints are the master's GPU and the
  /// stream's), and each device sums one contiguous slice of every gradient (one staged peer copy
  /// per source GPU and slice, one batched kernel, one copy back). Stripes would multiply the
  /// copies (about 8 per tensor and replica) and, on 3 GPUs or more, issue copies between two
  /// GPUs on a third GPU's stream.
  static constexpr dp_sharing dp_share = dp_sharing::per_device;

  /// One logical device per visible GPU; an error when there is none.
  static std::vector<device> all_devices() {
    int const n = device_count();
    if (n == 0) throw invalid_argument("dparallel: cuda backend: no GPU to run on (" + no_device_reason() + ")");
    return devices(n);
  }
  /// DDP's device for a rank whose group is bound to no GPU (a host, shared-memory or MPI group
  /// over CUDA memory) when options::local_device is not given: ranks take the visible GPUs
  /// round-robin (rank % device_count(), right for the ranks of one machine). An NCCL group is
  /// bound to its GPU, which parallel<> takes instead (process_group::bound_device).
  static device default_device(int rank) {
    int const n = device_count();
    if (n == 0) throw invalid_argument("dparallel: cuda backend: no GPU to run on (" + no_device_reason() + ")");
    return device{device_kind::cuda, rank % n, 0};
  }
  /// Throws invalid_argument unless `d` is a CUDA device visible to this process.
  static void check_device(device d) { cuda::check_device(d); }
  /// The device's memory and multiprocessor count (DataParallel warns when its devices differ).
  static device_properties describe(device d) { return describe_device(d); }
  /// The view must be CUDA memory on `d`'s GPU (checked with cudaPointerGetAttributes).
  static void check_view(tensor_ref t, device d, char const* what) {
    dparallel::detail::require(t.device().kind == device_kind::cuda && t.device().index == d.index,
                               std::string(what) + ": expected memory on " + to_string(d) + "'s GPU, found a view on " +
                                   to_string(t.device()));
    check_pointer(t, what);
  }

  /// parallel<> calls it on the calling thread as each step begins, before any of the step's work
  /// is enqueued on `s`: the step's GPU work then follows what the caller issued before step() on
  /// the legacy default stream (an optimizer's update of the master's parameters, a batch made on
  /// the GPU by libtorch or plain CUDA code). Work on the caller's other streams is the caller's to
  /// order (synchronise them before step()).
  static void begin_step(stream_type& s) { s.wait_for_legacy_stream(); }

  /// Operations launched on the calling thread's current stream: the reducers call them from
  /// work running on a cuda::stream (as host::backend runs them on the stream's worker).
  struct immediate {
    /// dst = src, on the calling device's current stream.
    static void copy(tensor_ref dst, tensor_ref src) { cuda::copy(current_stream(), current_device(), dst, src); }
    /// dst *= alpha, on the calling device's current stream.
    static void scale(tensor_ref dst, double alpha) { cuda::scale(current_stream(), current_device(), dst, alpha); }
    /// dst += alpha * src, on the calling device's current stream.
    static void add_scaled(tensor_ref dst, tensor_ref src, double alpha) {
      cuda::add_scaled(current_stream(), current_device(), dst, src, alpha);
    }
    /// dst = 0, on the calling device's current stream.
    static void zero(tensor_ref dst) { cuda::zero(current_stream(), current_device(), dst); }
  };

  /// The contract check's read (core/contract_check.hpp, options::check_contracts): `dst` (host
  /// memory) = `src`, on the calling thread's current stream (a step function's), waited for.
  static void read_to_host(tensor_ref dst, tensor_ref src) {
    cuda::copy(current_stream(), current_device(), dst, src);
    cuda::check(cudaStreamSynchronize(current_stream()), "cudaStreamSynchronize", current_device());
  }

  /// `bytes` zeroed bytes of `d`'s GPU memory (bucket storage), zeroed on the calling thread's
  /// stream when it runs work of `d`'s GPU, else zeroed and waited for (cuda::allocate).
  static std::shared_ptr<std::byte> allocate(device d, std::size_t bytes) {
    auto const& cur = cuda::detail::current();
    return cuda::allocate(d, bytes, cur.set && cur.dev.index == d.index ? cur.stream : nullptr);
  }

  /// Enqueues dst = src on `s`; the event completes when the copy has.
  static event copy(stream_type& s, tensor_ref dst, tensor_ref src) {
    return s.enqueue([&s, dst, src] { cuda::copy(s.native(), s.logical_device(), dst, src); });
  }
  /// Copies each src[i] to dst[i], launched as one piece of work on `s` (the destination's stream:
  /// between GPUs, cudaMemcpyPeerAsync into the replica's own memory).
  static event copy_all(stream_type& s, std::vector<tensor_ref> dst, std::vector<tensor_ref> src) {
    return s.enqueue([&s, dst = std::move(dst), src = std::move(src)] {
      for (std::size_t i = 0; i < dst.size(); ++i) cuda::copy(s.native(), s.logical_device(), dst[i], src[i]);
    });
  }
  /// copy_all over borrowed lists (kept alive and unchanged by the caller until the event completes).
  static event copy_all(stream_type& s, std::span<tensor_ref const> dst, std::span<tensor_ref const> src) {
    dparallel::detail::require(dst.size() == src.size(),
                               "cuda::backend::copy_all: expected as many destinations as sources, found " +
                                   std::to_string(dst.size()) + " and " + std::to_string(src.size()));
    return s.enqueue([&s, dst, src] {
      for (std::size_t i = 0; i < dst.size(); ++i) cuda::copy(s.native(), s.logical_device(), dst[i], src[i]);
    });
  }
  /// Enqueues dst = sum_k w[k] * srcs[k] on `s` (host::weighted_sum's pairwise order).
  static event weighted_sum(stream_type& s, tensor_ref dst, std::vector<tensor_ref> srcs, std::vector<double> w) {
    return s.enqueue([&s, dst, srcs = std::move(srcs), w = std::move(w)] {
      detail::staged_weighted_sums(s, std::span<tensor_ref const>(&dst, 1), srcs, w);
    });
  }
  /// Several weighted sums over borrowed lists, as one piece of work on `s`: for each j,
  /// dst[j] = sum_k w[k] * srcs[j * w.size() + k]. Views on other GPUs are staged (see above).
  static event weighted_sum(stream_type& s, std::span<tensor_ref const> dst, std::span<tensor_ref const> srcs,
                            std::span<double const> w) {
    dparallel::detail::require(srcs.size() == dst.size() * w.size(),
                               "cuda::backend::weighted_sum: expected " + std::to_string(w.size()) +
                                   " sources (one per weight) for each of the " + std::to_string(dst.size()) +
                                   " destinations, found " + std::to_string(srcs.size()) + " sources");
    return s.enqueue([&s, dst, srcs, w] { detail::staged_weighted_sums(s, dst, srcs, w); });
  }

  /// DataParallel's scatter hook, called in the shard's work on `s`: rewrites each view of the
  /// shard that is not memory of `s`'s GPU to a copy in the stream's persistent shard buffer (a
  /// lane of the same GPU reads in place). Host views go through the stream's pinned staging
  /// (memcpy, then cudaMemcpyAsync host to device on `s`); other GPUs' views by
  /// cudaMemcpyPeerAsync on `s`, the target's stream. The buffers are reused by the next step,
  /// which starts after this one drained its streams.
  static void place_shard(stream_type& s, std::span<tensor_ref> views) {
    staging_plan const& plan = detail::plan_for(s.device_index(), views);
    if (plan.bytes == 0) return;
    std::byte* const dev = s.staging(0, plan.bytes);
    std::byte* pinned = nullptr;
    for (std::size_t i = 0; i < views.size(); ++i) {
      std::size_t const off = plan.offset[i];
      if (off == staging_plan::npos) continue;
      tensor_ref const v = views[i];
      if (v.device().kind == device_kind::cuda) {
        views[i] = detail::stage_from_peer(s, v, dev + off);
        continue;
      }
      if (pinned == nullptr) pinned = s.pinned_staging(plan.bytes);
      std::memcpy(pinned + off, v.data(), v.size_bytes());
      check(cudaMemcpyAsync(dev + off, pinned + off, v.size_bytes(), cudaMemcpyHostToDevice, s.native()),
            "cudaMemcpyAsync", s.logical_device());
      views[i] = tensor_ref(dev + off, v.size(), v.dtype(), s.logical_device());
    }
  }
};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

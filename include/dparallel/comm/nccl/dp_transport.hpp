#pragma once
// The NCCL transport of nccl::dp (policy/nccl.hpp, which decides when and what to move): where
// each device's flat buckets live, and the two grouped calls over the clique (comm/nccl/clique.hpp)
// that move them: ncclBroadcast from device 0 to every device, and ncclReduce onto device 0 with
// one pre-multiplying sum operator per device and bucket. Part of the NCCL add-on (dparallel::nccl).

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/memory.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/comm/nccl/clique.hpp>
#include <dparallel/comm/nccl/detail/dp_plan.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace nccl {
namespace dp_detail {

/// Where a wrapper's flat buckets (comm/nccl/detail/dp_plan.hpp) live, per device and bucket: the
/// device's tensors themselves when they lie back to back in the bucket's dtype
/// (bucket_in_place), else memory kept for the bucket between steps (grown when needed).
struct flat_storage {
  std::vector<std::vector<tensor_ref>> flat;  ///< [device][bucket]: what NCCL reads and writes
  std::vector<std::vector<bool>> in_place;    ///< [device][bucket]: flat is the tensors' own memory

  /// Sizes the tables for `devices` devices and `buckets` buckets (the memory is kept).
  void resize(std::size_t devices, std::size_t buckets) {
    flat.resize(devices);
    in_place.resize(devices);
    memory_.resize(devices);
    for (std::size_t i = 0; i < devices; ++i) {
      flat[i].assign(buckets, tensor_ref{});
      in_place[i].assign(buckets, false);
      memory_[i].resize(buckets);
    }
  }
  /// Sets flat[i][b] for bucket `bk` over device i's `tensors` (on `dev`), allocating its memory
  /// when needed, zeroed in the order of `consumer` (nullptr: zeroed and waited for).
  void place(std::size_t i, std::size_t b, dparallel::detail::flat_bucket const& bk, std::span<tensor_ref const> tensors,
             device dev, cudaStream_t consumer) {
    in_place[i][b] = dparallel::detail::bucket_in_place(bk, tensors);
    if (in_place[i][b]) {
      flat[i][b] = tensor_ref(tensors[bk.members[0]].data(), bk.elements, bk.grads, dev);
      return;
    }
    std::size_t const bytes = bk.elements * size_of(bk.reduce_in);
    auto& mem = memory_[i][b];
    if (mem.bytes < bytes) mem = {cuda::allocate(dev, bytes, consumer), bytes};
    flat[i][b] = tensor_ref(mem.data.get(), bk.elements, bk.reduce_in, dev);
  }

 private:
  struct kept {
    std::shared_ptr<std::byte> data;
    std::size_t bytes = 0;
  };
  std::vector<std::vector<kept>> memory_;
};

/// One group of ncclBroadcast from device 0: bucket b of `flat[0]` into bucket b of every
/// device's `flat[i]`, each call on device i's stream `streams[i]`. A failed call or group aborts
/// the clique (device_comms::run_group) and fails the step.
inline void broadcast_flat(device_comms& c, std::vector<cudaStream_t> const& streams,
                           std::vector<std::vector<tensor_ref>> const& flat) {
  c.run_group("broadcast (replicate)", streams, [] { return 0; }, [&](int) {
    for (std::size_t i = 0; i < streams.size(); ++i)
      for (std::size_t b = 0; b < flat[0].size(); ++b) {
        tensor_ref const src = flat[0][b], dst = flat[i][b];
        check(ncclBroadcast(src.data(), dst.data(), dst.size(), to_nccl(dst.dtype()), 0, c[i], streams[i]),
              "ncclBroadcast", static_cast<int>(i));
      }
  });
}

/// One group of ncclReduce onto device 0, in place in every device's buckets `flat[i]` (of dtype
/// `types[b]`), device i's bucket b multiplied by `weights[i][b]` inside NCCL's sum. The
/// operators are found or made inside run_group (never on an aborted communicator); a failure
/// there, or of any NCCL call, aborts the clique and fails the step.
inline void reduce_flat(device_comms& c, std::vector<cudaStream_t> const& streams,
                        std::vector<std::vector<tensor_ref>> const& flat, std::span<dtype const> types,
                        std::vector<std::vector<double>> const& weights) {
  std::size_t const nb = types.size();
  auto const ops = [&] {
    std::vector<ncclRedOp_t> out;
    for (std::size_t i = 0; i < streams.size(); ++i)
      for (std::size_t b = 0; b < nb; ++b) out.push_back(c.premul(i, types[b], weights[i][b]));
    return out;
  };
  c.run_group("reduce", streams, ops, [&](std::vector<ncclRedOp_t> const& op) {
    for (std::size_t i = 0; i < streams.size(); ++i)
      for (std::size_t b = 0; b < nb; ++b) {
        tensor_ref const f = flat[i][b];
        check(ncclReduce(f.data(), f.data(), f.size(), to_nccl(f.dtype()), op[i * nb + b], 0, c[i], streams[i]),
              "ncclReduce", static_cast<int>(i));
      }
  });
}

}  // namespace dp_detail
}  // namespace nccl
DPARALLEL_NAMESPACE_END

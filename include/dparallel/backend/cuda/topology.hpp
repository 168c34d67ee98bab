#pragma once
// How the CUDA backend moves data between two logical devices, decided from the topology alone
// (pure functions: no CUDA call, tested on the host), and where the staged copies go.
//
// DataParallel's replicate, scatter and reduce read memory of one logical device from work running
// on another. Two lanes of one GPU share its memory: a kernel on either reads both directly. Two
// distinct GPUs do not: memory from a cudaMallocAsync pool is accessible only from the devices the
// pool was granted to with cudaMemPoolSetAccess (CUDA Programming Guide, "Stream Ordered Memory
// Allocator", device accessibility for multi-GPU support: pool allocations do not follow
// cudaDeviceEnablePeerAccess), and a model's memory may come from any pool. So between distinct
// GPUs nothing is read in place: the bytes travel by cudaMemcpyPeerAsync into a buffer on the
// reading GPU (the copy engine goes over NVLink/PCIe P2P when the pair can access each other, and
// is staged through the host by the driver otherwise), and the arithmetic then runs on local
// memory only.

#include <dparallel/config.hpp>

#include <cstddef>
#include <span>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

/// How bytes get from one GPU to another (see topology.hpp).
enum class transport {
  same_gpu,  ///< both logical devices are lanes of one GPU: kernels read and write in place
  peer,      ///< distinct GPUs that can access each other: cudaMemcpyPeerAsync goes direct (P2P)
  copy,      ///< distinct GPUs without peer access: cudaMemcpyPeerAsync, staged by the driver
};

/// The transport between GPU ordinals `from` and `to`; `can_access_peer` is what
/// cudaDeviceCanAccessPeer says for the pair (ignored on one GPU).
constexpr transport choose_transport(int from, int to, bool can_access_peer) noexcept {
  if (from == to) return transport::same_gpu;
  return can_access_peer ? transport::peer : transport::copy;
}

/// True when work on GPU `here` must copy a view living on GPU `there` into local memory before a
/// kernel may read or write it (every transport but same_gpu).
constexpr bool needs_staging(int here, int there) noexcept {
  return choose_transport(here, there, false) != transport::same_gpu;
}

/// The byte offsets, in one staging buffer, of the views that must be staged; `bytes` is the total
/// the buffer must hold.
struct staging_plan {
  std::vector<std::size_t> offset;  ///< per view: its place in the staging buffer, or npos when read in place
  std::size_t bytes = 0;            ///< the staging buffer's size
  /// The offset of a view that is read in place.
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
};

/// Alignment of each staged view: enough for the widest vector load the kernels make.
inline constexpr std::size_t staging_alignment = 256;

/// Plans the staging of views of `sizes[i]` bytes living on GPU `ordinals[i]` (-1: host memory)
/// for work on GPU `here`: views on another GPU or in host memory get an aligned slot, views on
/// `here` are read in place. Appends to `out` (cleared first), so a plan kept by a caller is
/// refilled without allocating once it reached its size.
inline void plan_staging(int here, std::span<int const> ordinals, std::span<std::size_t const> sizes,
                         staging_plan& out) {
  out.offset.clear();
  out.bytes = 0;
  for (std::size_t i = 0; i < ordinals.size(); ++i) {
    bool const local = ordinals[i] >= 0 && !needs_staging(here, ordinals[i]);
    if (local || sizes[i] == 0) {
      out.offset.push_back(staging_plan::npos);
      continue;
    }
    out.offset.push_back(out.bytes);
    out.bytes += (sizes[i] + staging_alignment - 1) / staging_alignment * staging_alignment;
  }
}

}  // namespace cuda
DPARALLEL_NAMESPACE_END

#pragma once
// CUDA devices: GPU ordinals, logical devices (lanes) on one GPU, pointer checks, peer access.

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/topology.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

/// Number of visible GPUs; 0 when there is none or no usable driver (the reason is in
/// no_device_reason()).
inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// Why device_count() is 0 (the runtime's message), or an empty string when there are GPUs.
inline std::string no_device_reason() {
  int n = 0;
  cudaError_t const e = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  if (e != cudaSuccess) return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
  return n == 0 ? "no CUDA device is visible" : "";
}

/// Throws invalid_argument unless `d` is a CUDA device whose ordinal is below device_count().
inline void check_device(device d) {
  dparallel::detail::require(d.kind == device_kind::cuda && d.index >= 0 && d.lane >= 0,
                             "cuda backend: expected a CUDA device (cuda:<ordinal>[.<lane>]), found " + to_string(d));
  int const n = device_count();
  if (d.index >= n) {
    std::string why = n == 0 ? " (" + no_device_reason() + ")" : "";
    throw invalid_argument("dparallel: cuda backend: device " + to_string(d) + " names GPU ordinal " +
                           std::to_string(d.index) + ", but " + std::to_string(n) + " GPU(s) are visible" + why);
  }
}

/// The first `n` GPUs, one logical device each: cuda:0 .. cuda:n-1.
inline std::vector<device> devices(int n) {
  dparallel::detail::require(n > 0, "cuda::devices: expected at least one device, found " + std::to_string(n));
  std::vector<device> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(device{device_kind::cuda, i, 0});
    check_device(out.back());
  }
  return out;
}

/// `n` logical devices on the one GPU `ordinal` (cuda:o, cuda:o.1, ...), each with its own stream:
/// multi-device code paths on a single GPU. Transfers between them are device-to-device copies.
inline std::vector<device> logical_devices(int n, int ordinal = 0) {
  dparallel::detail::require(n > 0, "cuda::logical_devices: expected at least one device, found " + std::to_string(n));
  std::vector<device> out;
  for (int i = 0; i < n; ++i) out.push_back(device{device_kind::cuda, ordinal, i});
  check_device(out.front());
  return out;
}

/// Where the memory behind `p` lives: the GPU ordinal for device (or managed) memory, -1 for host
/// memory (pageable or pinned).
inline int pointer_ordinal(void const* p) {
  cudaPointerAttributes a{};
  cudaError_t const e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) ? a.device : -1;
}

/// Throws invalid_argument unless the view `t` claims a CUDA device and its memory really lives on
/// that GPU (cudaPointerGetAttributes); `what` names the view in the message.
inline void check_pointer(tensor_ref t, char const* what) {
  dparallel::detail::require(t.device().kind == device_kind::cuda,
                             std::string(what) + ": expected CUDA device memory, found a view on " + to_string(t.device()));
  if (t.size() == 0) return;
  int const where = pointer_ordinal(t.data());
  if (where != t.device().index) {
    throw invalid_argument("dparallel: " + std::string(what) + ": the view claims " + to_string(t.device()) +
                           ", but its memory " +
                           (where < 0 ? std::string("is host memory")
                                      : "lives on GPU " + std::to_string(where)) +
                           " (cudaPointerGetAttributes); expected memory on GPU " +
                           std::to_string(t.device().index));
  }
}

/// dparallel's own memory pool on GPU `ordinal` (cudaMemPoolCreate, made at the first call, kept
/// for the process), from which cuda::device_buffer and the streams' staging allocate; nullptr
/// where the GPU has no stream-ordered allocator (then they use cudaMallocAsync's default pool).
/// Its release threshold is "never": what it frees stays mapped for dparallel's next allocation
/// instead of going back to the driver at every synchronisation (CUDA Programming Guide, "Stream
/// Ordered Memory Allocator", physical page caching behavior). The GPU's default pool, which
/// other libraries share (PyTorch's caching allocator among them), keeps its own settings.
inline cudaMemPool_t own_pool(int ordinal) {
  static std::mutex m;
  static std::map<int, cudaMemPool_t> pools;
  std::lock_guard lock(m);
  if (auto it = pools.find(ordinal); it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = ordinal;
  cudaMemPool_t pool = nullptr;
  if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
    std::uint64_t keep = UINT64_MAX;
    (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  } else {
    pool = nullptr;  // no pool support: cudaMallocAsync reports it where it is used
  }
  (void)cudaGetLastError();
  pools.emplace(ordinal, pool);
  return pool;
}

/// Returns the memory that dparallel's pool on GPU `ordinal` (own_pool) holds beyond what its
/// live buffers use to the driver (cudaMemPoolTrimTo), for a program that needs it elsewhere.
/// Buffers freed by work still queued on a stream are returned once that work is done and this
/// is called again. The default pool is not touched.
inline void trim_pool_memory(int ordinal) {
  if (cudaMemPool_t p = own_pool(ordinal)) check(cudaMemPoolTrimTo(p, 0), "cudaMemPoolTrimTo");
}

/// The transport between GPUs `from` and `to` (topology.hpp), asked of the driver once per pair.
/// For a peer pair, direct access is granted both ways, once per process, for cudaMalloc memory
/// (cudaDeviceEnablePeerAccess) and for each GPU's default memory pool and dparallel's own
/// (own_pool) (cudaMemPoolSetAccess:
/// pool allocations do not follow cudaDeviceEnablePeerAccess; CUDA Programming Guide, "Stream
/// Ordered Memory Allocator", device accessibility for multi-GPU support). The backend still never
/// launches a kernel on other GPUs' memory (a model may allocate from another pool): the grants
/// let cudaMemcpyPeerAsync go GPU to GPU directly.
inline transport link(int from, int to) {
  if (from == to) return transport::same_gpu;
  static std::mutex m;
  static std::map<std::pair<int, int>, transport> known;
  std::lock_guard lock(m);
  auto const key = std::pair{std::min(from, to), std::max(from, to)};
  if (auto it = known.find(key); it != known.end()) return it->second;
  int ab = 0, ba = 0;
  bool const can = cudaDeviceCanAccessPeer(&ab, from, to) == cudaSuccess &&
                   cudaDeviceCanAccessPeer(&ba, to, from) == cudaSuccess && ab != 0 && ba != 0;
  transport t = choose_transport(from, to, can);
  if (t == transport::peer) {
    for (auto [a, b] : {std::pair{from, to}, std::pair{to, from}}) {
      device_guard g(a);
      cudaError_t const e = cudaDeviceEnablePeerAccess(b, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) t = transport::copy;
      cudaMemAccessDesc d{};
      d.location.type = cudaMemLocationTypeDevice;
      d.location.id = a;
      d.flags = cudaMemAccessFlagsProtReadWrite;
      cudaMemPool_t pool = nullptr;
      if (cudaDeviceGetDefaultMemPool(&pool, b) == cudaSuccess) (void)cudaMemPoolSetAccess(pool, &d, 1);
      if (cudaMemPool_t own = own_pool(b)) (void)cudaMemPoolSetAccess(own, &d, 1);
    }
  }
  (void)cudaGetLastError();
  known.emplace(key, t);
  return t;
}

/// True when GPUs `from` and `to` are one GPU or can access each other (see link()).
inline bool peer_access(int from, int to) { return link(from, to) != transport::copy; }

namespace detail {
struct current_state {
  cudaStream_t stream = nullptr;
  device dev{device_kind::cuda, 0, 0};
  bool set = false;
};
inline current_state& current() {
  thread_local current_state s;
  return s;
}
/// Makes `s` the calling thread's current stream and logical device until destroyed, then gives
/// the thread its previous ones back.
class current_scope {
 public:
  explicit current_scope(current_state const& s) : saved_(current()) { current() = s; }
  current_scope(current_scope const&) = delete;
  current_scope& operator=(current_scope const&) = delete;
  ~current_scope() { current() = saved_; }

 private:
  current_state saved_;
};
}  // namespace detail

/// The CUDA stream of the logical device whose work is running on the calling thread: inside a
/// step function (or any work enqueued on a cuda::stream) launch kernels on it. Outside such
/// work it is the legacy default stream (nullptr).
inline cudaStream_t current_stream() noexcept { return detail::current().stream; }

/// The logical device whose work runs on the calling thread; throws outside such work.
inline device current_device() {
  dparallel::detail::require(detail::current().set,
                             "cuda::current_device: called outside work running on a cuda::stream");
  return detail::current().dev;
}

}  // namespace cuda
DPARALLEL_NAMESPACE_END

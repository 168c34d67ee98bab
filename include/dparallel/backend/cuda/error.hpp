#pragma once
// CUDA runtime errors as dparallel errors. Part of the CUDA add-on (target dparallel::cuda):
// include it only from code compiled against the CUDA toolkit.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>

#include <cuda.h>  // CUcontext and cuCtxGetCurrent's type only: the function is found at run time
#include <cuda_runtime_api.h>

#include <string>

DPARALLEL_NAMESPACE_BEGIN
namespace cuda {

/// Throws device_error naming `d`, the operation and the runtime's message when `status` is not
/// cudaSuccess. The runtime's last-error state is cleared so later calls start clean.
inline void check(cudaError_t status, char const* what, device d) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();
  throw device_error(d.index, to_string(d) + ": " + what + " failed: " + cudaGetErrorName(status) + " (" +
                                  cudaGetErrorString(status) + ")");
}

/// The same, for calls that concern no particular device (device -1 in the error).
inline void check(cudaError_t status, char const* what) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();
  throw device_error(-1, std::string("CUDA: ") + what + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
}

namespace detail {
/// True when a CUDA context is current on the calling thread (the thread chose a device, or made
/// a runtime call that needed one). The runtime API cannot tell: cudaGetDevice answers 0 on a
/// thread that never chose a device. The driver's cuCtxGetCurrent can, and is reached through
/// cudaGetDriverEntryPointByVersion so that nothing links libcuda. When it cannot be found the
/// answer is true (the guard then restores, as the runtime alone would).
inline bool has_current_context() noexcept {
  using get_current = CUresult (*)(CUcontext*);
  static get_current const fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      p = nullptr;
    (void)cudaGetLastError();
    return reinterpret_cast<get_current>(p);
  }();
  if (fn == nullptr) return true;
  CUcontext c = nullptr;
  return fn(&c) == CUDA_SUCCESS && c != nullptr;
}
}  // namespace detail

/// Makes `ordinal` the calling thread's current device and, on exit, restores the device that was
/// current before, if any. A thread with no current context keeps `ordinal`: since CUDA 12,
/// cudaSetDevice initialises the device's primary context at once (CUDA Runtime API,
/// cudaSetDevice), so "restoring" the device 0 that cudaGetDevice reports on such a thread would
/// create a context on GPU 0 in every process (every DDP rank) that never used GPU 0.
class device_guard {
 public:
  /// Makes GPU `ordinal` current until the guard is destroyed.
  explicit device_guard(int ordinal) {
    restore_ = detail::has_current_context();
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (!restore_ || previous_ != ordinal)
      check(cudaSetDevice(ordinal), "cudaSetDevice", device{device_kind::cuda, ordinal});
    restore_ = restore_ && previous_ != ordinal;
  }
  device_guard(device_guard const&) = delete;
  device_guard& operator=(device_guard const&) = delete;
  ~device_guard() {
    if (restore_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

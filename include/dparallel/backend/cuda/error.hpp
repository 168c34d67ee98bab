#pragma once
// CUDA runtime errors as dparallel errors. Part of the CUDA add-on (target dparallel::cuda):
// include it only from code compiled against the CUDA toolkit.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>

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

/// Makes `ordinal` the calling thread's current device and restores the previous one on exit.
class device_guard {
 public:
  /// Makes GPU `ordinal` current until the guard is destroyed.
  explicit device_guard(int ordinal) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != ordinal) check(cudaSetDevice(ordinal), "cudaSetDevice", device{device_kind::cuda, ordinal});
  }
  device_guard(device_guard const&) = delete;
  device_guard& operator=(device_guard const&) = delete;
  ~device_guard() { (void)cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

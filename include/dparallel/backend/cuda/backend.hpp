#pragma once
// The CUDA backend: logical devices are (GPU ordinal, lane) pairs, each with its own stream. The
// same policy code that drives host::backend drives this one; only the memory and the kernels
// differ. Part of the CUDA add-on: link dparallel::cuda and compile with nvcc.
//
//   dparallel::data_parallel<my_model, dparallel::cuda::backend> dp(model, dparallel::cuda::devices(2));
//
// Inside a step function, launch the model's kernels on dparallel::cuda::current_stream().

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/dtype.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/kernels.hpp>
#include <dparallel/backend/cuda/memory.hpp>
#include <dparallel/backend/cuda/stream.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/profile.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
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

/// The backend tag handed to parallel<>.
struct backend {
  /// The CUDA stream of a logical device.
  using stream_type = cuda::stream;
  /// What the stream operations return: a CUDA event to wait on.
  using event_type = cuda::event;
  /// The kind of device this backend runs on.
  static constexpr device_kind kind = device_kind::cuda;

  /// One logical device per visible GPU; an error when there is none.
  static std::vector<device> all_devices() {
    int const n = device_count();
    if (n == 0) throw invalid_argument("dparallel: cuda backend: no GPU to run on (" + no_device_reason() + ")");
    return devices(n);
  }
  /// DDP's device for a rank when options::local_device is not given: thread and process ranks
  /// on one machine take the GPUs round-robin (rank % device_count()).
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

  /// `bytes` zeroed bytes of `d`'s GPU memory (bucket storage).
  static std::shared_ptr<std::byte> allocate(device d, std::size_t bytes) { return cuda::allocate(d, bytes); }

  /// Enqueues dst = src on `s`; the event completes when the copy has.
  static event copy(stream_type& s, tensor_ref dst, tensor_ref src) {
    return s.enqueue([&s, dst, src] { cuda::copy(s.native(), s.logical_device(), dst, src); });
  }
  /// Copies each src[i] to dst[i], launched as one piece of work.
  static event copy_all(stream_type& s, std::vector<tensor_ref> dst, std::vector<tensor_ref> src) {
    return s.enqueue([&s, dst = std::move(dst), src = std::move(src)] {
      for (std::size_t i = 0; i < dst.size(); ++i) cuda::copy(s.native(), s.logical_device(), dst[i], src[i]);
    });
  }
  /// Enqueues dst = sum_k w[k] * srcs[k] on `s` (host::weighted_sum's pairwise order).
  static event weighted_sum(stream_type& s, tensor_ref dst, std::vector<tensor_ref> srcs, std::vector<double> w) {
    return s.enqueue([&s, dst, srcs = std::move(srcs), w = std::move(w)] {
      cuda::weighted_sum(s.native(), s.logical_device(), dst, srcs, w);
    });
  }
};

}  // namespace cuda
DPARALLEL_NAMESPACE_END

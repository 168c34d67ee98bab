#pragma once
// A device names where memory lives and where work runs.

#include <dparallel/config.hpp>

#include <cstdint>
#include <string>

DPARALLEL_NAMESPACE_BEGIN

/// Which backend a device belongs to.
enum class device_kind : std::uint8_t { host, cuda };

/// A logical device. On the host backend `index` selects a logical device (a worker thread over
/// host memory). On the CUDA backend `index` is the GPU ordinal and `lane` tells apart several
/// logical devices on that one GPU (each with its own stream): cuda:0, cuda:0.1, cuda:0.2 are
/// three logical devices on GPU 0 (how one-GPU machines run multi-device code paths).
struct device {
  /// The backend the device belongs to.
  device_kind kind = device_kind::host;
  /// Logical host device, or GPU ordinal.
  int index = 0;
  /// CUDA: the logical device among those sharing one GPU (0 for the first).
  int lane = 0;

  friend constexpr bool operator==(device, device) = default;
};

/// "host:1", "cuda:0", "cuda:0.2" (lane 2 of GPU 0).
inline std::string to_string(device d) {
  // Appended piece by piece: GCC 12 at -O3 warns falsely (-Wrestrict) on `"." + std::string&&`.
  std::string s = d.kind == device_kind::host ? "host:" : "cuda:";
  s += std::to_string(d.index);
  if (d.lane != 0) {
    s += '.';
    s += std::to_string(d.lane);
  }
  return s;
}

/// The host memory every host logical device shares; the default device of a view.
inline constexpr device host_memory{device_kind::host, 0};

DPARALLEL_NAMESPACE_END

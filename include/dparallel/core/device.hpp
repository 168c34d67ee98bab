#pragma once
// A device names where memory lives and where work runs.

#include <dparallel/config.hpp>

#include <cstdint>
#include <string>

DPARALLEL_NAMESPACE_BEGIN

/// Which backend a device belongs to.
enum class device_kind : std::uint8_t { host, cuda };

/// A logical device. On the host backend `index` selects a logical device (a worker thread over
/// host memory); on the CUDA backend it is a logical device mapped to a GPU ordinal. Several
/// logical devices may share one physical device.
struct device {
  device_kind kind = device_kind::host;
  int index = 0;

  friend constexpr bool operator==(device, device) = default;
};

inline std::string to_string(device d) {
  return std::string(d.kind == device_kind::host ? "host:" : "cuda:") + std::to_string(d.index);
}

/// The host memory every host logical device shares; the default device of a view.
inline constexpr device host_memory{device_kind::host, 0};

DPARALLEL_NAMESPACE_END

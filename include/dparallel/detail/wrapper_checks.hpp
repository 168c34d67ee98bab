#pragma once
// The checks parallel<> makes of its construction arguments, DDP's choice of its local device, and
// DataParallel's warning about devices that differ: what the constructors decide before any
// replica, stream or collective exists.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/launch_gpu.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/profile.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// DataParallel's devices: at least one, each valid for the backend, no two the same, and
/// options::output_device among them. Returns the output device's position.
template <class Backend>
std::size_t check_dp_devices(std::vector<device> const& devices, options const& opts) {
  require(!devices.empty(), "parallel: expected at least one device, found an empty device list");
  for (std::size_t i = 0; i < devices.size(); ++i) {
    Backend::check_device(devices[i]);
    for (std::size_t j = 0; j < i; ++j)
      require(devices[i] != devices[j], "parallel: expected distinct devices, found " + to_string(devices[i]) +
                                            " at positions " + std::to_string(j) + " and " + std::to_string(i));
  }
  device const out = opts.output_device.value_or(devices[0]);
  auto const slot = static_cast<std::size_t>(std::find(devices.begin(), devices.end(), out) - devices.begin());
  require(slot < devices.size(),
          "parallel: expected output_device to be one of the wrapper's devices, found " + to_string(out));
  return slot;
}

/// DDP's device: options::local_device, else the device the group is bound to when it is of the
/// backend's kind (an NCCL rank's own GPU, whatever the launch), else the backend's choice for
/// this rank (CUDA: rank % visible GPUs), else device `rank` of the backend's kind. An explicit
/// local_device must be on the group's device (another lane of it is fine).
template <class Backend>
device ddp_local_device(process_group const& group, options const& opts) {
  auto const bound = group.bound_device();
  device dev = [&] {
    if (opts.local_device) return *opts.local_device;
    if constexpr (requires { Backend::default_device(group.rank()); }) {
      if (!bound || bound->kind != Backend::kind) return Backend::default_device(group.rank());
    }
    return default_rank_device(bound, Backend::kind, group.rank(), std::nullopt);
  }();
  Backend::check_device(dev);
  if (bound && bound->kind == Backend::kind)
    require(bound->index == dev.index, [&] {
      return "DDP on rank " + std::to_string(group.rank()) + ": expected options::local_device on the device of the "
             "group's communicator, " + to_string(*bound) + ", found " + to_string(dev) +
             "; leave local_device unset to take the group's, or make the group on " + to_string(dev);
    });
  return dev;
}

/// DataParallel on a backend that describes its devices (static Backend::describe(device)): one
/// warning through options::warning_sink when they differ by more than 25% in memory or
/// multiprocessor count (device_mismatch). Several logical devices on one GPU never differ.
template <class Backend>
void warn_if_devices_differ(std::vector<device> const& devices, options const& opts) {
  if constexpr (requires(device d) {
                  { Backend::describe(d) } -> std::convertible_to<device_properties>;
                }) {
    if (devices.size() < 2 || !opts.warning_sink) return;
    std::vector<device_properties> props;
    props.reserve(devices.size());
    for (auto const& d : devices) props.push_back(Backend::describe(d));
    if (auto line = device_mismatch(props); !line.empty()) opts.warning_sink(line);
  }
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

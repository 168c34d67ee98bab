#pragma once
// The state the policies of one wrapper share: the local devices, their streams, the model on
// each device, and the shard plan of the current step.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/profile.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/core/trace.hpp>

#include <cstddef>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// DDP: this rank's part in the current synchronised step, decided by join_control (policy/join.hpp).
/// `scale` and `root` are part of the policy interface (policy_set_join, policy/concepts.hpp);
/// `active` is join_control's own.
struct join_step {
  double scale = 1.0;   ///< factor on this rank's gradient before the average over the ranks (0: zeros)
  int root = 0;         ///< the rank whose buffers are broadcast (the lowest one still stepping)
  int active = 0;       ///< ranks still stepping (0 until a control collective ran)
};

template <class Model, class Backend>
struct replica_set {
  using model_type = Model;
  using backend_type = Backend;
  using stream_type = typename Backend::stream_type;
  using event_type = typename Backend::event_type;

  Model* master = nullptr;             ///< the user's model; lives on devices[0]
  std::vector<device> devices;         ///< local devices, devices[0] is the master's
  std::vector<Model*> models;          ///< models[i] runs on devices[i]; models[0] == master
  std::vector<std::unique_ptr<Model>> owned;  ///< replicas made by the wrapper (devices 1..n-1)
  std::vector<std::unique_ptr<stream_type>> streams;  ///< streams[i] is devices[i]'s queue
  dparallel::options opts;
  std::size_t output_slot = 0;         ///< index in devices of options::output_device
  process_group group;                 ///< DDP: this rank's group; empty for DataParallel
  bool sync = true;                    ///< false inside no_sync(): reduce nothing, accumulate
  join_step join;                      ///< DDP: this step's contribution (uneven inputs, sample weighting)
  trace_log* trace = nullptr;          ///< the wrapper's timeline when it traces (core/trace.hpp)

  // Refreshed at the start of every step (models may reallocate their storage between steps).
  std::vector<std::vector<tensor_ref>> params, grads, bufs;

  // The current step's plan.
  std::size_t batch = 0;
  std::vector<std::size_t> shard_sizes;    ///< per device; 0 = no shard this step
  std::vector<std::size_t> shard_offsets;  ///< per device
  std::vector<event_type> compute_done;    ///< per device: the step function's completion

  [[nodiscard]] std::size_t size() const noexcept { return devices.size(); }
  [[nodiscard]] int rank() const { return group.valid() ? group.rank() : 0; }
  [[nodiscard]] int world_size() const { return group.valid() ? group.size() : 1; }
  [[nodiscard]] bool active(std::size_t i) const noexcept { return shard_sizes[i] != 0; }
  [[nodiscard]] double weight(std::size_t i) const noexcept {
    return static_cast<double>(shard_sizes[i]) / static_cast<double>(batch);
  }

  /// Re-reads every model's tensors. The lists are refilled in place, so a step whose models have
  /// as many tensors as before allocates nothing here (the model's own parameters() and friends
  /// may still allocate the range they return: that is the model's choice).
  void refresh_views() {
    params.resize(size());
    grads.resize(size());
    bufs.resize(size());
    for (std::size_t i = 0; i < size(); ++i) {
      if constexpr (detail::traits_follow_master<Model>)  // DataParallel's replicas (not the master)
        if (models[i] != master) model_traits<Model>::follow_master(*models[i], *master);
      assign_refs(params[i], dparallel::parameters(*models[i]));
      assign_refs(grads[i], dparallel::gradients(*models[i]));
      assign_refs(bufs[i], dparallel::buffers(*models[i]));
    }
  }

 private:
  template <class Range>
  static void assign_refs(std::vector<tensor_ref>& out, Range&& tensors) {
    out.clear();
    for (auto&& t : tensors) out.emplace_back(t);
  }
};

/// Enqueues a step function's work on `s`, timed on the device when the stream can
/// (`s.enqueue_timed`: cuda::stream records timing events around it), plainly otherwise.
template <class Stream, class F>
auto enqueue_compute(Stream& s, F&& fn) {
  if constexpr (requires { s.enqueue_timed(std::forward<F>(fn)); }) return s.enqueue_timed(std::forward<F>(fn));
  else return s.enqueue(std::forward<F>(fn));
}

/// The device's own measure of the completed work behind `e` (cuda::event::gpu_elapsed), when its
/// backend has one: what auto_balance should compare, since on a GPU the host only sees launches.
template <class Event>
std::optional<profile_duration> device_time(Event const& e) {
  if constexpr (requires { e.gpu_elapsed(); }) {
    if (auto t = e.gpu_elapsed()) return std::chrono::duration_cast<profile_duration>(*t);
  }
  return std::nullopt;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

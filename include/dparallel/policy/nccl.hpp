#pragma once
// DataParallel over distinct GPUs with NCCL (part of the NCCL add-on, dparallel::nccl): the
// replicate and reduce policies of nccl::dp. When every device of the wrapper is its own GPU they
// use one NCCL communicator per device (ncclCommInitAll, made at construction):
//  - replicate: before every step, the master's parameters and buffers are broadcast to every
//    replica in one ncclGroupStart/End (ncclBroadcast from device 0, each on its device's stream);
//  - reduce: each replica's gradient is scaled by its shard's weight on its own stream (a replica
//    without a shard contributes zeros), then one group of ncclReduce (sum) lands
//    sum_i w_i * g_i in the master's gradients.
// When two logical devices share a GPU (NCCL refuses two ranks on one GPU), or there is a single
// device, they fall back to the copy/kernel path of policy::replicate_each_step and
// policy::reduce_to_master. NCCL's summation order is fixed for a given set of GPUs, so results
// repeat run to run; they equal the one-device gradient up to rounding (the copy/kernel path's
// pairwise order is not NCCL's).
//
//   dparallel::parallel<my_gpu_model, dparallel::nccl::dp, dparallel::cuda::backend> w(model, dparallel::cuda::devices(4));

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/parallel.hpp>
#include <dparallel/policy/reduce.hpp>
#include <dparallel/policy/replicate.hpp>

#include <nccl.h>

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace nccl {
namespace dp_detail {

/// One communicator per device of a DataParallel wrapper, device i being rank i.
class device_comms {
 public:
  explicit device_comms(std::vector<device> const& devs) {
    std::vector<int> ordinals;
    for (auto const& d : devs) ordinals.push_back(d.index);
    comms_.assign(devs.size(), nullptr);
    check(ncclCommInitAll(comms_.data(), static_cast<int>(comms_.size()), ordinals.data()), "ncclCommInitAll", 0);
  }
  device_comms(device_comms const&) = delete;
  device_comms& operator=(device_comms const&) = delete;
  ~device_comms() {
    for (auto c : comms_)
      if (c != nullptr) (void)ncclCommDestroy(c);
  }
  [[nodiscard]] ncclComm_t operator[](std::size_t i) const { return comms_[i]; }

 private:
  std::vector<ncclComm_t> comms_;
};

/// Whether every device is its own GPU (NCCL's requirement) and there are at least two.
inline bool distinct_gpus(std::vector<device> const& devs) {
  if (devs.size() < 2) return false;
  for (std::size_t i = 0; i < devs.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (devs[i].index == devs[j].index) return false;
  return true;
}

/// Runs `launch()` (NCCL calls) between ncclGroupStart and ncclGroupEnd; the group is closed also
/// when a call throws. A failed group is a comm_error naming `what`.
template <class F>
void in_group(char const* what, F&& launch) {
  check(ncclGroupStart(), "ncclGroupStart", 0);
  try {
    launch();
  } catch (...) {
    (void)ncclGroupEnd();
    throw;
  }
  check(ncclGroupEnd(), what, 0);
}

template <class Set>
constexpr void require_cuda() {
  static_assert(std::is_same_v<typename Set::backend_type, cuda::backend>,
                "dparallel::nccl::dp's policies run on the CUDA backend: parallel<M, nccl::dp, cuda::backend>");
}

/// What both NCCL policies hold: one communicator per device when the devices are distinct GPUs
/// (else none, and the policy takes its copy/kernel path), and that path's policy, kept as a
/// member so the lists it reuses between steps persist.
template <class Fallback>
struct with_comms {
  std::shared_ptr<device_comms> comms;
  Fallback fallback;

  template <class Set>
  void on_construct(Set& s) {
    require_cuda<Set>();
    if (distinct_gpus(s.devices)) comms = std::make_shared<device_comms>(s.devices);
    fallback.on_construct(s);
  }
};

}  // namespace dp_detail

/// Replicate: ncclBroadcast of the master's parameters and buffers from device 0 before every
/// step; the copy path of policy::replicate_each_step when the devices are not distinct GPUs.
struct broadcast_replicate : dp_detail::with_comms<policy::replicate_each_step> {
  /// Broadcasts the master's parameters and buffers to the replicas that receive a shard.
  template <class Set>
  void before_step(Set& s) {
    if (!comms) {
      fallback.before_step(s);
      return;
    }
    // One thread (stream 0's) launches the whole group, each call on its device's stream; the
    // other streams wait for the launch before they launch anything after it.
    auto const launched = s.streams[0]->enqueue([&s, c = comms] {
      dp_detail::in_group("ncclGroupEnd (replicate)", [&] {
        for (std::size_t i = 0; i < s.size(); ++i) {
          auto const& params = s.params[i];
          auto const& bufs = s.bufs[i];
          for (std::size_t k = 0; k < params.size() + bufs.size(); ++k) {
            tensor_ref const dst = k < params.size() ? params[k] : bufs[k - params.size()];
            tensor_ref const src = k < params.size() ? s.params[0][k] : s.bufs[0][k - params.size()];
            if (dst.size() == 0) continue;
            check(ncclBroadcast(src.data(), dst.data(), dst.size(), to_nccl(dst.dtype()), 0, (*c)[i],
                                s.streams[i]->native()),
                  "ncclBroadcast", static_cast<int>(i));
          }
        }
      });
    });
    for (std::size_t i = 1; i < s.size(); ++i) s.streams[i]->wait(launched);
  }
};
static_assert(replicate_policy<broadcast_replicate>);

/// Reduce: weights applied on each replica's stream, then grouped ncclReduce (sum) onto the
/// master; the pairwise copy/kernel path of policy::reduce_to_master when the devices are not
/// distinct GPUs.
struct weighted_reduce : dp_detail::with_comms<policy::reduce_to_master> {
  /// Nothing to do before the step functions run.
  template <class Set>
  void begin_step(Set&) {}
  /// Ignored: the reduction starts after every step function.
  template <class Set>
  void grad_ready(Set&, int, std::size_t) {}

  /// Weights each replica's gradients, then reduces them onto the master in one NCCL group.
  template <class Set>
  void finish(Set& s) {
    if (!comms) {
      fallback.finish(s);
      return;
    }
    // Each replica weights its own gradient (zeros when it had no shard).
    std::vector<typename Set::event_type> weighted;
    for (std::size_t i = 0; i < s.size(); ++i) {
      weighted.push_back(s.streams[i]->enqueue([&s, i] {
        auto& st = *s.streams[i];
        for (auto const& g : s.grads[i]) {
          if (s.active(i)) cuda::scale(st.native(), st.logical_device(), g, s.weight(i));
          else cuda::zero(st.native(), st.logical_device(), g);
        }
      }));
    }
    for (std::size_t i = 1; i < s.size(); ++i) s.streams[0]->wait(weighted[i]);
    auto const launched = s.streams[0]->enqueue([&s, c = comms] {
      dp_detail::in_group("ncclGroupEnd (reduce)", [&] {
        for (std::size_t i = 0; i < s.size(); ++i)
          for (auto const& g : s.grads[i]) {
            if (g.size() == 0) continue;
            check(ncclReduce(g.data(), g.data(), g.size(), to_nccl(g.dtype()), ncclSum, 0, (*c)[i],
                             s.streams[i]->native()),
                  "ncclReduce", static_cast<int>(i));
          }
      });
    });
    for (std::size_t i = 1; i < s.size(); ++i) s.streams[i]->wait(launched);
  }
};
static_assert(reduce_policy<weighted_reduce>);

/// DataParallel with NCCL between distinct GPUs (see the top of this header).
struct dp : dparallel::dp {
  /// ncclBroadcast between distinct GPUs.
  using replicate = broadcast_replicate;
  /// Weighted ncclReduce between distinct GPUs.
  using reduce = weighted_reduce;
};
static_assert(semantics<dp>);

}  // namespace nccl
DPARALLEL_NAMESPACE_END

#pragma once
// The NCCL clique of a nccl::dp wrapper (policy/nccl.hpp; its grouped calls are in
// comm/nccl/dp_transport.hpp): one communicator per device, the watchdog that aborts it, and the
// pre-multiplying sum operators it keeps. Part of the NCCL add-on (dparallel::nccl).

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/comm/detail/clique_watch.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace nccl {
namespace dp_detail {

/// One communicator per device of a DataParallel wrapper, device i being rank i; shared by the
/// wrapper's replicate and reduce policies (one clique, not two). A watchdog (the engine-neutral
/// collective_poller of comm/detail/progress.hpp, through clique_driver) follows every launched
/// group: it polls an event recorded after the group on each device's stream and
/// ncclCommGetAsyncError of each communicator, and when a group fails, or has not completed
/// within options::timeout, it aborts every communicator (ncclCommAbort: the only way to end a
/// hung NCCL collective; the communicators are unusable afterwards) and fails the group's work
/// with an error naming the device(s) and the cause. A group whose launch fails midway is
/// aborted the same way. Later groups fail at once with the first failure's reason.
class device_comms {
 public:
  device_comms(std::vector<device> const& devs, std::chrono::milliseconds timeout)
      : devs_(devs), timeout_(timeout), members_{this}, driver_{members_} {
    std::vector<int> ordinals;
    for (auto const& d : devs) ordinals.push_back(d.index);
    comms_.assign(devs.size(), nullptr);
    check(ncclCommInitAll(comms_.data(), static_cast<int>(comms_.size()), ordinals.data()), "ncclCommInitAll", 0);
    poller_ = std::make_unique<dparallel::detail::collective_poller<watch_driver>>(0, driver_);
  }
  device_comms(device_comms const&) = delete;
  device_comms& operator=(device_comms const&) = delete;
  ~device_comms() {
    poller_->stop();  // each pending group ends at its deadline at the latest
    if (poller_->aborted()) return;  // ncclCommAbort freed them, and their operators
    for (auto const& o : ops_) (void)ncclRedOpDestroy(o.op, comms_[o.device]);
    for (auto c : comms_)
      if (c != nullptr) (void)ncclCommDestroy(c);
  }
  [[nodiscard]] ncclComm_t operator[](std::size_t i) const { return comms_[i]; }
  [[nodiscard]] std::size_t size() const noexcept { return comms_.size(); }

  /// Runs `held = prepare()` (NCCL objects the group uses, e.g. reduction operators), then
  /// `launch(held)` (NCCL calls on these communicators, call i on `streams[i]`) between
  /// ncclGroupStart and ncclGroupEnd, destroys `held`, and records each stream's completion event
  /// for the watchdog; the group's work is kept until wait_all(). All of it runs under the
  /// poller's launch mutex and only while the clique is healthy; the watchdog's ncclCommAbort
  /// waits for that mutex, except for a launch still inside NCCL past its deadline and a grace
  /// of 100 ms (blocked behind a dead peer), which the abort ends: NCCL allows ncclCommAbort
  /// beside a blocked call (comm/detail/progress.hpp, "The launch mutex").
  /// Everything that can be checked is checked by the caller before (so no group is left
  /// half-filled by an argument error); if a call or ncclGroupEnd still fails, the clique is
  /// aborted (NCCL: after an error nothing can be assumed about the enqueued operations) and the
  /// error names `what`.
  template <class Prepare, class Launch>
  void run_group(std::string const& what, std::vector<cudaStream_t> const& streams, Prepare&& prepare,
                 Launch&& launch) {
    std::string launch_failure;
    work w = poller_->launch(describe(what), timeout_, [&] {
      try {
        auto held = prepare();
        check(ncclGroupStart(), "ncclGroupStart", 0);
        try {
          launch(held);
        } catch (...) {
          (void)ncclGroupEnd();
          throw;
        }
        check(ncclGroupEnd(), "ncclGroupEnd", 0);
        return record(streams);
      } catch (std::exception const& e) {
        launch_failure = e.what();
        throw;
      }
    });
    if (!launch_failure.empty()) poller_->abort("nccl::dp: launching " + what + " failed: " + launch_failure);
    if (w.ready()) {  // failed at launch (or the clique had failed before): fail this work now
      if (auto e = w.wait_nothrow()) std::rethrow_exception(e);
      return;
    }
    std::lock_guard lock(m_);
    pending_.push_back(std::move(w));
  }

  /// Device i's pre-multiplying sum by `w` over dtype `t` (`w` exact in `t`: see
  /// detail::choose_premul), made at its first use and kept while device i's weight for `t` stays
  /// `w`: a steady-state step creates no operator. A new weight replaces it (ncclRedOpDestroy,
  /// then ncclRedOpCreatePreMulSum). Call it only from run_group's `prepare` (under the launch
  /// mutex, on a healthy clique), so between groups: NCCL lets an operator be destroyed as soon as
  /// the last NCCL call given it has returned (NCCL API, "User Defined Reduction Operators",
  /// ncclRedOpDestroy), which the previous group's ncclGroupEnd has. The clique destroys the
  /// operators before its communicators; an aborted clique's went with ncclCommAbort.
  ncclRedOp_t premul(std::size_t i, dtype t, double w) {
    for (std::size_t k = 0; k < ops_.size(); ++k) {
      if (ops_[k].device != i || ops_[k].type != t) continue;
      if (ops_[k].weight == w) return ops_[k].op;
      ncclRedOp_t const old = ops_[k].op;
      ops_.erase(ops_.begin() + static_cast<std::ptrdiff_t>(k));
      check(ncclRedOpDestroy(old, comms_[i]), "ncclRedOpDestroy", static_cast<int>(i));
      break;
    }
    ops_.push_back({i, t, w, make_premul(comms_[i], t, w, static_cast<int>(i))});
    return ops_.back().op;
  }
  /// Waits for every group launched so far; throws the first failure (a timeout_error or
  /// comm_error naming the device(s)), the clique being aborted by then.
  void wait_all() {
    std::vector<work> ws;
    {
      std::lock_guard lock(m_);
      ws.swap(pending_);
    }
    std::exception_ptr first;
    for (auto const& w : ws)
      if (auto e = w.wait_nothrow(); e && !first) first = e;
    if (first) std::rethrow_exception(first);
  }

 private:
  // The clique as clique_driver sees it: member i is device i's communicator, its token the
  // event recorded after the group on device i's stream.
  struct members {
    using token = cudaEvent_t;
    device_comms* c;
    [[nodiscard]] std::size_t size() const { return c->comms_.size(); }
    [[nodiscard]] std::string name(std::size_t i) const {
      return "device " + std::to_string(i) + " (" + to_string(c->devs_[i]) + ")";
    }
    dparallel::detail::poll_result poll(std::size_t, cudaEvent_t& e) {
      cudaError_t const q = cudaEventQuery(e);
      if (q == cudaSuccess) return dparallel::detail::poll_result::done();
      (void)cudaGetLastError();
      if (q == cudaErrorNotReady) return dparallel::detail::poll_result::pending();
      return dparallel::detail::poll_result::failed(std::string("the GPU reported ") + cudaGetErrorName(q) + ": " +
                                                    cudaGetErrorString(q));
    }
    // NCCL reports errors of collectives already launched only through ncclCommGetAsyncError;
    // after one, the communicator must be aborted (NCCL API, ncclCommGetAsyncError).
    std::string async_error(std::size_t i) {
      ncclResult_t r = ncclSuccess;
      if (ncclCommGetAsyncError(c->comms_[i], &r) != ncclSuccess || r == ncclSuccess || r == ncclInProgress) return {};
      return "NCCL reported " + std::string(ncclGetErrorString(r));
    }
    void release(std::size_t, cudaEvent_t& e) noexcept { (void)cudaEventDestroy(e); }
    // ncclCommAbort with the communicator's GPU current; the poller calls it before it releases
    // the events of the failed groups.
    void abort(std::size_t i) noexcept {
      try {
        cuda::device_guard g(c->devs_[i].index);
        (void)ncclCommAbort(c->comms_[i]);
      } catch (...) {
        (void)ncclCommAbort(c->comms_[i]);
      }
    }
  };
  using watch_driver = dparallel::detail::clique_driver<members>;

  [[nodiscard]] std::string describe(std::string const& what) const {
    std::string s = "nccl::dp " + what + " over";
    for (auto const& d : devs_) s += " " + to_string(d);
    return s;
  }
  // One event per device, recorded on its stream after the group's calls (an event must be
  // recorded on a stream of the device it was created on: each is made with that device current).
  std::vector<cudaEvent_t> record(std::vector<cudaStream_t> const& streams) {
    std::vector<cudaEvent_t> events(streams.size(), nullptr);
    try {
      for (std::size_t i = 0; i < streams.size(); ++i) {
        cuda::device_guard g(devs_[i].index);
        cuda::check(cudaEventCreateWithFlags(&events[i], cudaEventDisableTiming), "cudaEventCreateWithFlags");
        cuda::check(cudaEventRecord(events[i], streams[i]), "cudaEventRecord");
      }
    } catch (...) {
      for (auto e : events)
        if (e != nullptr) (void)cudaEventDestroy(e);
      throw;
    }
    return events;
  }

  // A pre-multiplying sum by `w` over `t` on `comm` (the scalar is read before the call returns:
  // ncclScalarHostImmediate).
  static ncclRedOp_t make_premul(ncclComm_t comm, dtype t, double w, int rank) {
    float const f = static_cast<float>(w);
    __half const h = __float2half(f);
    __nv_bfloat16 const b = __float2bfloat16(f);
    void const* scalar = nullptr;
    switch (t) {
      case dtype::f64: scalar = &w; break;
      case dtype::f32: scalar = &f; break;
      case dtype::f16: scalar = &h; break;
      case dtype::bf16: scalar = &b; break;
      default:
        throw invalid_argument("dparallel: nccl::dp: expected floating-point gradients (F32, F64, F16, BF16), found " +
                               std::string(name_of(t)));
    }
    ncclRedOp_t op{};
    check(ncclRedOpCreatePreMulSum(&op, const_cast<void*>(scalar), to_nccl(t), ncclScalarHostImmediate, comm),
          "ncclRedOpCreatePreMulSum", rank);
    return op;
  }
  struct cached_op {
    std::size_t device;
    dtype type;
    double weight;
    ncclRedOp_t op;
  };

  std::vector<device> devs_;
  std::chrono::milliseconds timeout_;
  std::vector<ncclComm_t> comms_;
  std::vector<cached_op> ops_;  // used under the poller's launch mutex only
  members members_;
  watch_driver driver_;
  std::mutex m_;
  std::vector<work> pending_;  // groups launched since the last wait_all()
  std::unique_ptr<dparallel::detail::collective_poller<watch_driver>> poller_;  // last: its thread uses the others
};

/// The clique of the DataParallel wrapper whose replica set is `set`: made by the first policy
/// that asks, found by the second.
inline std::shared_ptr<device_comms> clique_for(void const* set, std::vector<device> const& devs,
                                               std::chrono::milliseconds timeout) {
  static std::mutex m;
  static std::map<void const*, std::weak_ptr<device_comms>> cliques;
  std::lock_guard lock(m);
  std::erase_if(cliques, [](auto const& kv) { return kv.second.expired(); });
  auto& slot = cliques[set];
  if (auto c = slot.lock()) return c;
  auto c = std::make_shared<device_comms>(devs, timeout);
  slot = c;
  return c;
}

/// Whether every device is its own GPU (NCCL's requirement) and there are at least two.
inline bool distinct_gpus(std::vector<device> const& devs) {
  if (devs.size() < 2) return false;
  for (std::size_t i = 0; i < devs.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (devs[i].index == devs[j].index) return false;
  return true;
}

}  // namespace dp_detail
}  // namespace nccl
DPARALLEL_NAMESPACE_END

#pragma once
// DataParallel over distinct GPUs with NCCL (part of the NCCL add-on, dparallel::nccl): the
// replicate and reduce policies of nccl::dp. When every device of the wrapper is its own GPU they
// use one NCCL communicator per device (ncclCommInitAll, made at construction):
//  - replicate: before every step, the master's parameters and buffers are broadcast to every
//    replica in one ncclGroupStart/End (ncclBroadcast from device 0, each on its device's stream);
//  - reduce: one group of ncclReduce with a pre-multiplying sum (ncclRedOpCreatePreMulSum: each
//    replica's gradient times its shard's weight, inside NCCL's kernel; a replica without a shard
//    contributes zeros) lands sum_i w_i * g_i in the master's gradients.
// Both policies share one clique (one communicator per device). A watchdog follows each group:
// when it fails, or has not completed within options::timeout (a peer GPU hung), every
// communicator is aborted (ncclCommAbort) and the step fails with an error naming the device(s)
// and the cause; later steps fail at once (construct a new wrapper).
// When two logical devices share a GPU (NCCL refuses two ranks on one GPU), or there is a single
// device, they fall back to the copy/kernel path of policy::replicate_each_step and
// policy::reduce_to_master. NCCL's summation order is fixed for a given set of GPUs, so results
// repeat run to run; they equal the one-device gradient up to rounding (the copy/kernel path's
// pairwise order is not NCCL's).
//
//   dparallel::parallel<my_gpu_model, dparallel::nccl::dp, dparallel::cuda::backend> w(model, dparallel::cuda::devices(4));

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/comm/detail/clique_watch.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/parallel.hpp>
#include <dparallel/policy/reduce.hpp>
#include <dparallel/policy/replicate.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <exception>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <type_traits>
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
    if (poller_->aborted()) return;  // ncclCommAbort freed them
    for (auto c : comms_)
      if (c != nullptr) (void)ncclCommDestroy(c);
  }
  [[nodiscard]] ncclComm_t operator[](std::size_t i) const { return comms_[i]; }
  [[nodiscard]] std::size_t size() const noexcept { return comms_.size(); }

  /// Runs `held = prepare()` (NCCL objects the group uses, e.g. reduction operators), then
  /// `launch(held)` (NCCL calls on these communicators, call i on `streams[i]`) between
  /// ncclGroupStart and ncclGroupEnd, destroys `held`, and records each stream's completion event
  /// for the watchdog; the group's work is kept until wait_all(). All of it runs under the
  /// poller's launch mutex, so never concurrently with the watchdog's ncclCommAbort (nothing may
  /// use a communicator while, or after, it is aborted), and only while the clique is healthy.
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

  std::vector<device> devs_;
  std::chrono::milliseconds timeout_;
  std::vector<ncclComm_t> comms_;
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

/// A sum that multiplies each rank's input by `w` first, inside NCCL's reduction kernel
/// (ncclRedOpCreatePreMulSum; the scalar has the reduction's dtype and is read by the host before
/// the call returns: ncclScalarHostImmediate). It replaces a separate scaling pass that rounded
/// f16/bf16 gradients to their own type once more before the sum. Destroyed after the last NCCL
/// call using it returned (NCCL: an operator may be destroyed as soon as the last NCCL function
/// given it returns).
class premul_sum {
 public:
  premul_sum(ncclComm_t comm, dtype t, double w) : comm_(comm) {
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
    check(ncclRedOpCreatePreMulSum(&op_, const_cast<void*>(scalar), to_nccl(t), ncclScalarHostImmediate, comm_),
          "ncclRedOpCreatePreMulSum", 0);
  }
  premul_sum(premul_sum const&) = delete;
  premul_sum& operator=(premul_sum const&) = delete;
  ~premul_sum() { (void)ncclRedOpDestroy(op_, comm_); }
  [[nodiscard]] ncclRedOp_t op() const noexcept { return op_; }

 private:
  ncclComm_t comm_;
  ncclRedOp_t op_{};
};

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
    if (distinct_gpus(s.devices)) comms = clique_for(&s, s.devices, s.opts.timeout);
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
      // Checked before ncclGroupStart: a bad tensor must not leave a half-launched group.
      for (std::size_t i = 0; i < s.size(); ++i)
        for (std::size_t k = 0; k < s.params[i].size() + s.bufs[i].size(); ++k) {
          tensor_ref const dst = k < s.params[i].size() ? s.params[i][k] : s.bufs[i][k - s.params[i].size()];
          tensor_ref const src = k < s.params[i].size() ? s.params[0][k] : s.bufs[0][k - s.params[i].size()];
          (void)to_nccl(dst.dtype());
          dparallel::detail::require(dst.size() == src.size() && dst.dtype() == src.dtype(), [&] {
            return "nccl::dp replicate: tensor " + std::to_string(k) + " of replica " + std::to_string(i) + " has " +
                   std::to_string(dst.size()) + " x " + std::string(name_of(dst.dtype())) + ", the master's " +
                   std::to_string(src.size()) + " x " + std::string(name_of(src.dtype()));
          });
        }
      std::vector<cudaStream_t> streams;
      for (std::size_t i = 0; i < s.size(); ++i) streams.push_back(s.streams[i]->native());
      c->run_group("broadcast (replicate)", streams, [] { return 0; }, [&](int) {
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
    // A replica without a shard contributes zeros (its gradient holds a stale value, and 0 * inf
    // would be NaN). The shard weights are applied inside NCCL's sum (premul_sum).
    std::vector<typename Set::event_type> zeroed;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s.active(i)) continue;
      zeroed.push_back(s.streams[i]->enqueue([&s, i] {
        auto& st = *s.streams[i];
        for (auto const& g : s.grads[i]) cuda::zero(st.native(), st.logical_device(), g);
      }));
    }
    for (auto const& e : zeroed) s.streams[0]->wait(e);
    // The group below enqueues ncclReduce on every device's stream from stream 0's thread: it
    // must come after each device's step function launched its backward on that stream, so
    // stream 0 waits for every step function's launches first (wait() needs the CUDA event,
    // which exists once the work launched).
    for (std::size_t i = 1; i < s.size(); ++i) s.streams[0]->wait(s.compute_done[i]);
    auto const launched = s.streams[0]->enqueue([&s, c = comms] {
      // Operators made, and every argument checked, before ncclGroupStart: no partial group.
      // They are made and destroyed inside run_group (never on an aborted communicator), the
      // destruction after ncclGroupEnd returned.
      using op_table = std::vector<std::vector<std::unique_ptr<dp_detail::premul_sum>>>;
      auto const make_ops = [&] {
        op_table ops(s.size());
        for (std::size_t i = 0; i < s.size(); ++i)
          for (auto const& g : s.grads[i])
            ops[i].push_back(std::make_unique<dp_detail::premul_sum>((*c)[i], g.dtype(), s.active(i) ? s.weight(i) : 0.0));
        return ops;
      };
      std::vector<cudaStream_t> streams;
      for (std::size_t i = 0; i < s.size(); ++i) streams.push_back(s.streams[i]->native());
      c->run_group("reduce", streams, make_ops, [&](op_table const& ops) {
        for (std::size_t i = 0; i < s.size(); ++i)
          for (std::size_t k = 0; k < s.grads[i].size(); ++k) {
            auto const& g = s.grads[i][k];
            if (g.size() == 0) continue;
            check(ncclReduce(g.data(), g.data(), g.size(), to_nccl(g.dtype()), ops[i][k]->op(), 0, (*c)[i],
                             s.streams[i]->native()),
                  "ncclReduce", static_cast<int>(i));
          }
      });
      // The watchdog's verdict on this step's groups (the broadcast and this reduce): a hung or
      // failed group was aborted by now and fails the step, naming the device(s) and the cause.
      c->wait_all();
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

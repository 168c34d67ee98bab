#pragma once
// The NCCL engine's communicator (included by <dparallel/comm/nccl.hpp>, with the ways to make
// its process groups): the communicator concept over NCCL for tensors in GPU memory. Part of the
// NCCL add-on (target dparallel::nccl); compile with nvcc or any compiler that sees the CUDA and
// NCCL headers.
//
// - nccl::make_groups(gpus): thread ranks of one process, one per GPU (ncclCommInitAll). NCCL
//   refuses two ranks on one GPU; logical devices sharing a GPU use the backend's copy/kernel path
//   (tests on a machine with one GPU may opt in to sharing, shared_gpu::allow_for_tests).
// - nccl::init_process_group(opts): one rank per process from the launcher's environment; the
//   unique id travels from rank 0 through `bootstrap` (an MPI group) when given, else through the
//   TCP rendezvous at MASTER_ADDR:MASTER_PORT (ncclCommInitRank). The rank's GPU is chosen as
//   comm/detail/launch_gpu.hpp says (one visible GPU per rank works; real sharing is refused).
// - process_group::split / new_group of an NCCL group, and so make_hierarchical: ncclCommSplit
//   (see communicator::subgroup).
//
// Guarantees of a communicator (see also docs/gpu.md):
// - Ordering: every collective runs on the communicator's own stream, after the GPU work the
//   issuing thread launched before the call: its dparallel CUDA stream inside stream work
//   (cuda::current_stream(), e.g. DDP's bucket copies); the caller's stream captured by a
//   forwarding wrapper (the desync detector, comm/detail/issue_order.hpp); else the legacy
//   default stream (the DDP constructor's broadcast from the user's thread). The returned work
//   completes when the GPU finished the collective.
// - Staging: a side in host memory (`in`, `out` or both) goes through a pinned + device block of
//   the communicator sized for that collective (comm/detail/staging_plan.hpp; in place stays in
//   place); a side in device memory must be on this rank's GPU and is used as it is. The blocks
//   are allocated once and reused; host inputs are copied before the call returns, host outputs
//   when the work completes.
// - Failure: a poll thread (comm/detail/progress.hpp) watches each collective's event and
//   ncclCommGetAsyncError without holding the communicator's lock. An NCCL or GPU error, a
//   collective not done within the timeout, and abort() call ncclCommAbort first, then release
//   the staging and fail every pending and later work with a comm_error (timeout_error) naming
//   this rank and the cause, instead of hanging.

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/memory.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/call_checks.hpp>
#include <dparallel/comm/detail/issue_order.hpp>
#include <dparallel/comm/detail/launch_gpu.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/detail/staging_plan.hpp>
#include <dparallel/comm/nccl/detail/resources.hpp>
#include <dparallel/comm/nccl_bootstrap.hpp>
#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace nccl {

/// NCCL's data type for `t`; invalid_argument for a dtype NCCL cannot reduce or move.
inline ncclDataType_t to_nccl(dtype t) {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::f16: return ncclFloat16;
    case dtype::bf16: return ncclBfloat16;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
  }
  throw invalid_argument("dparallel: NCCL: unsupported dtype (code " + std::to_string(static_cast<int>(t)) +
                         "); expected F32, F64, F16, BF16, I32, I64 or U8");
}

/// Checks a reduction's arguments before anything reaches NCCL: a dtype NCCL supports, and `avg`
/// only for floating dtypes (an integer average would be truncated differently on every engine).
inline void check_reduction(tensor_ref t, reduce_op op, char const* what) {
  (void)to_nccl(t.dtype());
  bool const floating = t.dtype() == dtype::f32 || t.dtype() == dtype::f64 || t.dtype() == dtype::f16 ||
                        t.dtype() == dtype::bf16;
  if (op == reduce_op::avg && !floating)
    throw invalid_argument(std::string("dparallel: NCCL ") + what + ": reduce_op::avg needs a floating dtype, found " +
                           std::string(name_of(t.dtype())) + "; use reduce_op::sum");
}

/// The tensors of one bucket must share one dtype (one NCCL call moves them as one buffer).
inline void check_bucket(std::span<tensor_ref const> tensors, char const* what) {
  for (std::size_t i = 1; i < tensors.size(); ++i)
    if (tensors[i].dtype() != tensors[0].dtype())
      throw invalid_argument(std::string("dparallel: ") + what + ": expected one dtype per bucket, found " +
                             std::string(name_of(tensors[0].dtype())) + " (tensor 0) and " +
                             std::string(name_of(tensors[i].dtype())) + " (tensor " + std::to_string(i) + ")");
}

/// Throws comm_error naming `rank` when an NCCL call failed.
inline void check(ncclResult_t r, char const* what, int rank, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  std::string msg = std::string("dparallel: NCCL on rank ") + std::to_string(rank) + ": " + what + " failed: " +
                    ncclGetErrorString(r);
  if (comm != nullptr) {
    char const* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') msg += std::string(" (") + last + ")";
  }
  throw comm_error(rank, msg);
}

/// One rank's NCCL communicator (satisfies the communicator concept).
class communicator {
 public:
  /// Takes ownership of `comm`, rank `rank` of `size` on GPU `gpu`.
  communicator(ncclComm_t comm, int rank, int size, device gpu, std::chrono::milliseconds timeout)
      : comm_(comm), rank_(rank), size_(size), dev_(gpu), timeout_ms_(timeout.count()), events_(gpu, cudaEventDisableTiming), staging_(gpu) {
    cuda::device_guard g(dev_.index);
    cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", dev_);
    void* zero = nullptr;
    cuda::check(cudaMalloc(&zero, sizeof(std::int32_t)), "cudaMalloc (barrier)", dev_);
    barrier_word_ = static_cast<std::int32_t*>(zero);
    // Zeroed on the communicator's own stream, so every collective (all on stream_) comes after
    // it (a non-blocking stream does not wait for the legacy stream's cudaMemset).
    cuda::check(cudaMemsetAsync(barrier_word_, 0, sizeof(std::int32_t), stream_), "cudaMemsetAsync (barrier)", dev_);
    poller_ = std::make_unique<dparallel::detail::collective_poller<driver>>(rank_, driver_);
  }
  communicator(communicator const&) = delete;
  communicator& operator=(communicator const&) = delete;
  /// Waits for the pending collectives (each fails at its timeout at the latest, aborting the
  /// communicator), then destroys the communicator, or has aborted it.
  ~communicator() {
    poller_->stop();
    cuda::device_guard g(dev_.index);
    // After ncclCommAbort the stream's NCCL kernels were ended, so this returns; only then are
    // the staging blocks and the barrier word freed (by the members' destructors and below).
    if (!poller_->aborted()) (void)ncclCommDestroy(comm_);
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
    (void)cudaFree(barrier_word_);
  }

  /// This rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of ranks.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The GPU this rank's collectives run on.
  [[nodiscard]] device gpu() const noexcept { return dev_; }
  /// The underlying NCCL communicator.
  [[nodiscard]] ncclComm_t native() const noexcept { return comm_; }
  /// How long a collective waits before the communicator is aborted with a timeout_error.
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  /// Applies to the collectives issued after the call.
  void set_timeout(std::chrono::milliseconds t) {
    dparallel::detail::require(t.count() > 0, "nccl::communicator::set_timeout: expected a positive timeout, found " +
                                                  std::to_string(t.count()) + " ms");
    timeout_ms_.store(t.count(), std::memory_order_relaxed);
  }
  /// Number of collectives this rank has finished (successfully or not).
  [[nodiscard]] std::uint64_t completed_ops() const { return poller_->completed(); }

  /// See communicator (ncclAllReduce on this rank's stream).
  work all_reduce(tensor_ref t, reduce_op op) {
    check_reduction(t, op, "all_reduce");
    return launch("all_reduce", t, t, [&](void const* in, void* out, ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(in, out, t.size(), to_nccl(t.dtype()), nccl_op(op), c, s);
    });
  }
  /// See communicator (ncclReduce).
  work reduce(tensor_ref t, int root, reduce_op op) {
    check_reduction(t, op, "reduce");
    check_root(root, "reduce");
    return launch("reduce", t, t, [&](void const* in, void* out, ncclComm_t c, cudaStream_t s) {
      return ncclReduce(in, out, t.size(), to_nccl(t.dtype()), nccl_op(op), root, c, s);
    });
  }
  /// See communicator (ncclBroadcast).
  work broadcast(tensor_ref t, int root) {
    (void)to_nccl(t.dtype());
    check_root(root, "broadcast");
    return launch("broadcast", t, t, [&](void const* in, void* out, ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(in, out, t.size(), to_nccl(t.dtype()), root, c, s);
    });
  }
  /// See communicator (ncclReduceScatter).
  work reduce_scatter(tensor_ref out, tensor_ref in, reduce_op op) {
    check_reduction(in, op, "reduce_scatter");
    check_sizes(out, in, "reduce_scatter");
    return launch("reduce_scatter", in, out, [&](void const* src, void* dst, ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(src, dst, out.size(), to_nccl(in.dtype()), nccl_op(op), c, s);
    });
  }
  /// See communicator (ncclAllGather).
  work all_gather(tensor_ref out, tensor_ref in) {
    (void)to_nccl(in.dtype());
    check_sizes(in, out, "all_gather");
    return launch("all_gather", in, out, [&](void const* src, void* dst, ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(src, dst, in.size(), to_nccl(in.dtype()), c, s);
    });
  }
  /// An all_reduce of the communicator's own zeroed device word: nothing is staged, nothing on
  /// the caller's stack is written later, and the word stays 0 (a sum of zeros).
  work barrier() {
    tensor_ref const t(barrier_word_, 1, dtype::i32, dev_);
    return launch("barrier", t, t, [&](void const* in, void* out, ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(in, out, 1, ncclInt32, ncclSum, c, s);
    });
  }

  /// Aborts the communicator (ncclCommAbort): every pending and later work of this rank fails with
  /// a comm_error naming this rank and `why`; the peers' collectives fail at their timeout.
  /// Returns once the pending works failed.
  void abort(std::string why) { poller_->abort(std::move(why)); }

  /// Blocks until every collective issued so far has finished (successfully or not).
  void drain() { poller_->drain(); }

  /// This rank's subgroup of a split (see process_group::split, which checked the requests and
  /// made `plan`, the same on every rank): ncclCommSplit of this communicator, the subgroup on
  /// this rank's GPU with this communicator's timeout; empty when the rank is in none. Every rank
  /// of this communicator calls it. Its failures name the rank in both numberings.
  process_group subgroup(dparallel::detail::subgroup_plan const& plan);

 private:
  // One launched collective, as the poller holds it.
  struct in_flight {
    cudaEvent_t done = nullptr;
    detail::staging_pool::block* staging = nullptr;
    void* host_out = nullptr;  // a staged result's host destination
    std::size_t out_offset = 0;
    std::size_t out_bytes = 0;
  };

  // The engine as collective_poller sees it (comm/detail/progress.hpp).
  struct driver {
    using handle = in_flight;
    communicator& c;
    bool device_set = false;  // the poll thread's current device is c.dev_ (set at its first use)
    // The poll thread is dparallel's own and never chose a device: a runtime call there would
    // create a primary context on GPU 0 (the thread's default device) in every rank's process.
    void on_poll_thread() {
      if (!device_set) device_set = cudaSetDevice(c.dev_.index) == cudaSuccess;
    }
    dparallel::detail::poll_result poll(in_flight& h) {
      on_poll_thread();
      cudaError_t const q = cudaEventQuery(h.done);
      if (q == cudaSuccess) return dparallel::detail::poll_result::done();
      (void)cudaGetLastError();
      if (q == cudaErrorNotReady) return dparallel::detail::poll_result::pending();
      return dparallel::detail::poll_result::failed(std::string("the GPU reported ") + cudaGetErrorName(q) + ": " +
                                                    cudaGetErrorString(q));
    }
    // NCCL reports errors of collectives already launched (a peer's network failure, a
    // misconfiguration found while running) only through ncclCommGetAsyncError; after an error
    // nothing can be assumed about the enqueued operations and the communicator must be
    // aborted (NCCL API, ncclCommGetAsyncError).
    std::string async_error() {
      on_poll_thread();  // called before each poll
      ncclResult_t r = ncclSuccess;
      if (ncclCommGetAsyncError(c.comm_, &r) != ncclSuccess || r == ncclSuccess || r == ncclInProgress) return {};
      std::string msg = std::string("NCCL reported ") + ncclGetErrorString(r);
      if (char const* last = ncclGetLastError(c.comm_); last != nullptr && *last != '\0') msg += std::string(" (") + last + ")";
      return msg;
    }
    void finish(in_flight& h) {
      if (h.host_out != nullptr) std::memcpy(h.host_out, h.staging->pinned + h.out_offset, h.out_bytes);
    }
    void release(in_flight& h) noexcept {
      if (h.done != nullptr) c.events_.give_back(h.done);
      c.staging_.give(h.staging);
    }
    // ncclCommAbort ends the communicator's kernels and frees its resources; it must come before
    // any memory a stuck collective uses is reused or freed (the poller releases after it).
    void abort_native() noexcept {
      (void)cudaSetDevice(c.dev_.index);
      (void)ncclCommAbort(c.comm_);
    }
    // A subgroup's failures also name the rank's parent rank and the members.
    dparallel::detail::comm_failure describe_failure(dparallel::detail::comm_failure f) const {
      return dparallel::detail::subgroup_failure(std::move(f), c.parent_ranks_);
    }
  };

  static ncclRedOp_t nccl_op(reduce_op op) { return op == reduce_op::avg ? ncclAvg : ncclSum; }

  void check_root(int root, char const* what) const {
    auto const problem = dparallel::detail::root_problem(root, size_);  // the words of every engine
    dparallel::detail::require(problem.empty(), [&] { return std::string("NCCL ") + what + ": " + problem; });
  }
  void check_sizes(tensor_ref small, tensor_ref big, char const* what) const {
    dparallel::detail::require(small.dtype() == big.dtype() && big.size() == small.size() * static_cast<std::size_t>(size_),
                               std::string("NCCL ") + what + ": expected " + std::to_string(size_) + " x " +
                                   std::to_string(small.size()) + " elements of " + std::string(name_of(small.dtype())) +
                                   " in the large tensor, found " + std::to_string(big.size()) + " of " +
                                   std::string(name_of(big.dtype())));
  }
  // A side of a collective: host memory is staged; device memory must be this rank's GPU's.
  dparallel::detail::staging_side side(tensor_ref t, char const* name, char const* what) const {
    if (t.size() == 0) return {t.data(), 0, false};
    int const where = cuda::pointer_ordinal(t.data());
    if (where >= 0)
      dparallel::detail::require(where == dev_.index, [&] {
        return std::string("NCCL ") + what + " on rank " + std::to_string(rank_) + ": expected `" + name +
               "` on GPU " + std::to_string(dev_.index) + " (this rank's) or in host memory, found memory on GPU " +
               std::to_string(where);
      });
    return {t.data(), t.size_bytes(), where < 0};
  }

  // Orders stream_ after the issuing thread's GPU work (CUDA: "cudaStreamWaitEvent makes all future
  // work submitted to the stream wait for all work captured in the event"; the event may be from
  // another device). The issuer is, in this order: the caller of a forwarding wrapper (its token,
  // see comm/detail/issue_order.hpp); the dparallel stream whose work runs on this thread; else
  // the legacy default stream, whose recorded event waits for all earlier work of every blocking
  // stream of the device (CUDA: the legacy default stream synchronises with all blocking
  // streams, per-thread default streams included; dparallel's own streams are non-blocking and
  // are covered by the first two cases).
  void order_after_issuer() {
    if (auto const& token = dparallel::detail::issue_order::current()) {
      auto const* e = static_cast<detail::issued_event const*>(token.get());
      cuda::check(cudaStreamWaitEvent(stream_, e->ev, 0), "cudaStreamWaitEvent", dev_);
      return;
    }
    auto const& cur = cuda::detail::current();
    if (cur.set && cur.dev.index != dev_.index) {  // pooled events are dev_'s; record on the issuer's GPU
      auto const t = detail::capture_cuda_issue();
      cuda::check(cudaStreamWaitEvent(stream_, static_cast<detail::issued_event const*>(t.get())->ev, 0),
                  "cudaStreamWaitEvent", dev_);
      return;
    }
    cudaStream_t const issuer = cur.set ? cur.stream : cudaStreamLegacy;
    cudaEvent_t const after = events_.take();
    cudaError_t e = cudaEventRecord(after, issuer);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, after, 0);
    events_.give_back(after);  // re-recording a pooled event later does not disturb this wait
    cuda::check(e, "cudaEventRecord / cudaStreamWaitEvent (ordering after the issuing stream)", dev_);
  }

  // Launches one collective on stream_ after the issuer's GPU work, staging exactly its host sides.
  template <class Call>
  work launch(char const* what, tensor_ref in, tensor_ref out, Call&& call) {
    // Before side()'s cudaPointerGetAttributes: the issuing thread may never have chosen a device
    // (a forwarding or desync thread), and a runtime call there would create a context on GPU 0.
    cuda::device_guard g(dev_.index);
    dparallel::detail::staging_plan const plan =
        dparallel::detail::plan_staging(side(in, "in", what), side(out, "out", what), what);
    std::string desc = std::string(what) + " of " + std::to_string(out.size()) + " x " + std::string(name_of(out.dtype()));
    return poller_->launch(std::move(desc), timeout(), [&] {  // runs here, on this thread, under g
      order_after_issuer();
      in_flight h;
      void const* src = in.data();
      void* dst = out.data();
      if (plan.any()) {
        h.staging = staging_.lease(plan.bytes);
        if (plan.stage_in) {
          std::memcpy(h.staging->pinned + plan.in_offset, in.data(), in.size_bytes());
          cudaError_t const e = cudaMemcpyAsync(h.staging->dev + plan.in_offset, h.staging->pinned + plan.in_offset,
                                                in.size_bytes(), cudaMemcpyHostToDevice, stream_);
          if (e != cudaSuccess) staging_.give(h.staging);  // nothing was queued that reads it
          cuda::check(e, "cudaMemcpyAsync (staging in)", dev_);
          src = h.staging->dev + plan.in_offset;
        }
        if (plan.stage_out) {
          dst = h.staging->dev + plan.out_offset;
          h.host_out = out.data();
          h.out_offset = plan.out_offset;
          h.out_bytes = out.size_bytes();
        }
      }
      // From here on the staging block may be read by queued GPU work: on an error it is kept
      // leased (freed with the communicator), never handed to another collective.
      check(call(src, dst, comm_, stream_), what, rank_, comm_);
      if (plan.stage_out)
        cuda::check(cudaMemcpyAsync(h.staging->pinned + plan.out_offset, dst, out.size_bytes(), cudaMemcpyDeviceToHost,
                                    stream_),
                    "cudaMemcpyAsync (staging out)", dev_);
      h.done = events_.take();
      cuda::check(cudaEventRecord(h.done, stream_), "cudaEventRecord", dev_);
      return h;
    });
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  device dev_;
  std::atomic<std::int64_t> timeout_ms_;
  cudaStream_t stream_ = nullptr;
  std::int32_t* barrier_word_ = nullptr;
  detail::event_pool events_;
  detail::staging_pool staging_;
  std::vector<int> parent_ranks_;  // a subgroup's members in its parent; empty otherwise (set before its first collective)
  driver driver_{*this};
  std::unique_ptr<dparallel::detail::collective_poller<driver>> poller_;  // last: its thread uses the others
};
static_assert(dparallel::communicator<communicator>);

inline process_group communicator::subgroup(dparallel::detail::subgroup_plan const& plan) {
  // NCCL's rules for ncclCommSplit (NCCL API, "ncclCommSplit"): it is a collective of every rank
  // of the parent, a rank passing NCCL_SPLIT_NOCOLOR takes part and gets no communicator; ranks
  // passing one color form one communicator ordered by key (ties by parent rank); no NCCL
  // operation may be outstanding on the parent ("otherwise, it might cause a deadlock"); config
  // NULL: the child inherits the parent's configuration (blocking, as ours). The colors and keys
  // come from the plan, which process_group::split / new_group computed on every rank from the
  // same exchanged requests (split_arguments_of: color = index of the rank's subgroup, key = its
  // group rank), so NCCL orders the members exactly as the plan, new_group's order included
  // (tested on the host against NCCL's rule: tests/test_subgroups.cpp).
  // The exchange was an all_gather of this communicator, waited for, after every earlier
  // collective on the same stream; drain() makes sure nothing else of this rank is pending.
  drain();
  dparallel::detail::split_arguments const args = dparallel::detail::split_arguments_of(plan, NCCL_SPLIT_NOCOLOR);
  ncclComm_t child = nullptr;
  // The child is made for the parent's CUDA device; this rank's GPU is current around the call
  // all the same (a thread rank may have another device current). The split runs as a launch of
  // the poll engine, so the parent's failure semantics apply: a failed or aborted parent refuses
  // it with its error, and a split still blocked at the timeout (a peer that died after the
  // exchange) aborts the parent, which ends the call (comm/detail/progress.hpp).
  cuda::device_guard g(dev_.index);
  work const w = poller_->launch("split into subgroups", timeout(), [&] {
    check(ncclCommSplit(comm_, args.color, args.key, &child, nullptr), "ncclCommSplit", rank_, comm_);
    in_flight h;
    h.done = events_.take();
    cuda::check(cudaEventRecord(h.done, stream_), "cudaEventRecord", dev_);
    return h;
  });
  try {
    w.wait();
  } catch (...) {
    if (child != nullptr) (void)ncclCommAbort(child);  // made, but the parent failed meanwhile
    throw;
  }
  if (child == nullptr) {
    dparallel::detail::require(plan.mine < 0, [&] {
      return "NCCL subgroup on rank " + std::to_string(rank_) + ": ncclCommSplit returned no communicator for group " +
             std::to_string(plan.mine) + " (expected one: this rank is group rank " + std::to_string(plan.group_rank) +
             " of " + dparallel::detail::rank_list_text(plan.members()) + ")";
    });
    return {};
  }
  auto const members = plan.members();
  std::shared_ptr<communicator> sub;
  try {
    sub = std::make_shared<communicator>(child, plan.group_rank, static_cast<int>(members.size()), dev_, timeout());
  } catch (...) {
    (void)ncclCommAbort(child);  // the communicator did not take it
    throw;
  }
  sub->parent_ranks_ = members;
  return process_group(std::move(sub));
}

}  // namespace nccl
DPARALLEL_NAMESPACE_END

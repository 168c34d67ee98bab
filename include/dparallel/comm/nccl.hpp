#pragma once
// The NCCL engine: the communicator concept over NCCL for tensors in GPU memory. Part of the NCCL
// add-on (target dparallel::nccl); compile with nvcc or any compiler that sees the CUDA and NCCL
// headers.
//
// - nccl::make_groups(gpus): thread ranks of one process, one per GPU (ncclCommInitAll). NCCL
//   refuses two ranks on one GPU; logical devices sharing a GPU use the backend's copy/kernel path.
// - nccl::init_process_group(opts): one rank per process from the launcher's environment; the
//   unique id travels from rank 0 through `bootstrap` (an MPI group) when given, else through the
//   TCP rendezvous at MASTER_ADDR:MASTER_PORT (ncclCommInitRank).
//
// Every collective runs on the communicator's own stream, after the work already launched on the
// caller's current dparallel CUDA stream (cuda::current_stream(), so DDP's buckets are reduced
// after their gradients were copied in); the returned work completes when the GPU finished it. A
// progress thread polls each collective's event and ncclCommGetAsyncError: an NCCL error, a
// collective whose peers do not come within the timeout, and abort() make the communicator call
// ncclCommAbort and fail every pending and later work with a comm_error (timeout_error) that
// names this rank and the cause, instead of hanging. Tensors in host memory (the wrappers' small
// control messages) are staged through pinned and device memory.

#include <dparallel/config.hpp>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/memory.hpp>
#include <dparallel/comm/communicator.hpp>
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
      : comm_(comm), rank_(rank), size_(size), dev_(gpu), timeout_(timeout) {
    cuda::device_guard g(dev_.index);
    cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", dev_);
    poller_ = std::thread([this] { poll(); });
  }
  communicator(communicator const&) = delete;
  communicator& operator=(communicator const&) = delete;
  /// Waits for the pending collectives (each fails at its timeout at the latest), then destroys
  /// the communicator (or has aborted it).
  ~communicator() {
    drain();
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    poller_.join();
    finish_abort();
    cuda::device_guard g(dev_.index);
    if (!aborted_) (void)ncclCommDestroy(comm_);
    (void)cudaStreamDestroy(stream_);
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
  [[nodiscard]] std::chrono::milliseconds timeout() const {
    std::lock_guard lock(m_);
    return timeout_;
  }
  /// Applies to the collectives issued after the call.
  void set_timeout(std::chrono::milliseconds t) {
    std::lock_guard lock(m_);
    timeout_ = t;
  }
  /// Number of collectives this rank has finished (successfully or not).
  [[nodiscard]] std::uint64_t completed_ops() const noexcept { return completed_.load(); }

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
  /// See communicator.
  work barrier() {
    std::int32_t one = 1;
    tensor_ref const t(&one, 1, dtype::i32);
    return all_reduce(t, reduce_op::sum);  // staged: `one` is copied before the call returns
  }

  /// Aborts the communicator (ncclCommAbort): every pending and later work of this rank fails with
  /// a comm_error naming this rank and `why`; the peers' collectives fail at their timeout.
  void abort(std::string why) {
    {
      std::lock_guard lock(m_);
      fail_locked(std::make_exception_ptr(
          comm_error(rank_, "dparallel: NCCL rank " + std::to_string(rank_) + " aborted: " + why)));
    }
    finish_abort();
  }

  /// Blocks until every collective issued so far has finished (successfully or not).
  void drain() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return pending_.empty(); });
  }

 private:
  struct pending_op {
    std::string what;
    cudaEvent_t done = nullptr;
    detail::work_promise promise;
    std::chrono::steady_clock::time_point deadline;
    std::shared_ptr<void> keep;  // staging memory, freed after the collective
    void* host_out = nullptr;    // host destination of a staged result
    void const* pinned_out = nullptr;
    std::size_t out_bytes = 0;
  };

  static ncclRedOp_t nccl_op(reduce_op op) { return op == reduce_op::avg ? ncclAvg : ncclSum; }

  void check_root(int root, char const* what) const {
    dparallel::detail::require(root >= 0 && root < size_, std::string("NCCL ") + what + ": expected a root in [0, " +
                                                               std::to_string(size_) + "), found " + std::to_string(root));
  }
  void check_sizes(tensor_ref small, tensor_ref big, char const* what) const {
    dparallel::detail::require(small.dtype() == big.dtype() && big.size() == small.size() * static_cast<std::size_t>(size_),
                               std::string("NCCL ") + what + ": expected " + std::to_string(size_) + " x " +
                                   std::to_string(small.size()) + " elements of " + std::string(name_of(small.dtype())) +
                                   " in the large tensor, found " + std::to_string(big.size()) + " of " +
                                   std::string(name_of(big.dtype())));
  }

  // Launches one collective on stream_ after the caller's current stream, with host tensors staged.
  template <class Call>
  work launch(char const* what, tensor_ref in, tensor_ref out, Call&& call) {
    std::lock_guard issue(issue_m_);
    pending_op op;
    op.what = what;
    work const result = op.promise.get_work();
    {
      std::lock_guard lock(m_);
      if (failure_) {
        op.promise.complete(failure_);
        return result;
      }
    }
    try {
      cuda::device_guard g(dev_.index);
      if (cuda::detail::current().set && cuda::detail::current().dev.index == dev_.index) {
        cudaEvent_t after = nullptr;
        cuda::check(cudaEventCreateWithFlags(&after, cudaEventDisableTiming), "cudaEventCreateWithFlags", dev_);
        cuda::check(cudaEventRecord(after, cuda::current_stream()), "cudaEventRecord", dev_);
        cuda::check(cudaStreamWaitEvent(stream_, after, 0), "cudaStreamWaitEvent", dev_);
        (void)cudaEventDestroy(after);
      }
      bool const in_host = cuda::pointer_ordinal(in.data()) < 0 && in.size() != 0;
      bool const out_host = cuda::pointer_ordinal(out.data()) < 0 && out.size() != 0;
      void const* src = in.data();
      void* dst = out.data();
      if (in_host || out_host) {
        auto staging = std::make_shared<staged>(in.size_bytes(), out.size_bytes(), dev_, stream_);
        if (in.size() != 0) {
          std::memcpy(staging->pinned_in.data(), in.data(), in.size_bytes());
          cuda::check(cudaMemcpyAsync(staging->dev_in.data(), staging->pinned_in.data(), in.size_bytes(),
                                      cudaMemcpyHostToDevice, stream_),
                      "cudaMemcpyAsync", dev_);
        }
        src = staging->dev_in.data();
        dst = in.data() == out.data() ? staging->dev_in.data() : staging->dev_out.data();
        op.keep = staging;
        op.host_out = out.data();
        op.pinned_out = staging->pinned_out.data();
        op.out_bytes = out.size_bytes();
        check(call(src, dst, comm_, stream_), what, rank_, comm_);
        if (out.size() != 0)
          cuda::check(cudaMemcpyAsync(staging->pinned_out.data(), dst, out.size_bytes(), cudaMemcpyDeviceToHost, stream_),
                      "cudaMemcpyAsync", dev_);
      } else {
        cuda::check_pointer(in, "NCCL: the input");
        cuda::check_pointer(out, "NCCL: the output");
        dparallel::detail::require(in.device().index == dev_.index,
                                   std::string("NCCL ") + what + ": expected a tensor on GPU " +
                                       std::to_string(dev_.index) + " (this rank's), found one on " +
                                       to_string(in.device()));
        check(call(src, dst, comm_, stream_), what, rank_, comm_);
      }
      cuda::check(cudaEventCreateWithFlags(&op.done, cudaEventDisableTiming), "cudaEventCreateWithFlags", dev_);
      cuda::check(cudaEventRecord(op.done, stream_), "cudaEventRecord", dev_);
    } catch (...) {
      if (op.done != nullptr) (void)cudaEventDestroy(op.done);
      op.done = nullptr;
      op.promise.complete(std::current_exception());
      return result;
    }
    {
      std::lock_guard lock(m_);
      op.deadline = std::chrono::steady_clock::now() + timeout_;
      if (failure_) {  // aborted while launching
        (void)cudaEventDestroy(op.done);
        op.promise.complete(failure_);
        return result;
      }
      pending_.push_back(std::move(op));
    }
    cv_.notify_all();
    return result;
  }

  struct staged {
    cuda::pinned_buffer<std::byte> pinned_in, pinned_out;
    cuda::device_buffer<std::byte> dev_in, dev_out;
    staged(std::size_t in_bytes, std::size_t out_bytes, device d, cudaStream_t s)
        : pinned_in(in_bytes), pinned_out(out_bytes), dev_in(in_bytes, d, s), dev_out(out_bytes, d, s) {}
  };

  // Fails every pending collective and all later ones with `e` (m_ held); the NCCL communicator
  // is aborted by finish_abort(), which the caller runs after releasing m_.
  void fail_locked(std::exception_ptr e) {
    if (!failure_) failure_ = std::move(e);
    if (!aborted_) {
      aborted_ = true;
      abort_pending_ = true;
    }
    for (auto& op : pending_) {
      op.promise.complete(failure_);
      if (op.done != nullptr) (void)cudaEventDestroy(op.done);
      ++completed_;
    }
    pending_.clear();
    idle_.notify_all();
  }

  // ncclCommAbort once, never while a launch is inside an NCCL call on this communicator
  // (issue_m_ serialises them; the lock order is issue_m_, then m_).
  void finish_abort() {
    std::lock_guard issue(issue_m_);
    bool run = false;
    {
      std::lock_guard lock(m_);
      run = std::exchange(abort_pending_, false);
    }
    if (run) (void)ncclCommAbort(comm_);
  }

  void poll() {
    (void)cudaSetDevice(dev_.index);
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait_for(lock, std::chrono::microseconds(200), [&] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) {
        if (stopping_) return;
        continue;
      }
      ncclResult_t async = ncclSuccess;
      if (!aborted_ && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        fail_locked(std::make_exception_ptr(comm_error(rank_, std::string("dparallel: NCCL on rank ") +
                                                                  std::to_string(rank_) + ": " + ncclGetErrorString(async) +
                                                                  " while running " + pending_.front().what)));
        lock.unlock();
        finish_abort();
        lock.lock();
        continue;
      }
      auto& op = pending_.front();
      cudaError_t const q = cudaEventQuery(op.done);
      if (q == cudaSuccess) {
        if (op.host_out != nullptr && op.out_bytes != 0) std::memcpy(op.host_out, op.pinned_out, op.out_bytes);
        (void)cudaEventDestroy(op.done);
        op.promise.complete();
        pending_.pop_front();
        ++completed_;
        if (pending_.empty()) idle_.notify_all();
      } else if (q != cudaErrorNotReady) {
        (void)cudaGetLastError();
        fail_locked(std::make_exception_ptr(comm_error(rank_, std::string("dparallel: NCCL on rank ") +
                                                                  std::to_string(rank_) + ": " + op.what +
                                                                  " failed on the GPU: " + cudaGetErrorString(q))));
      } else if (std::chrono::steady_clock::now() > op.deadline) {
        fail_locked(std::make_exception_ptr(timeout_error(
            rank_, std::string("dparallel: NCCL on rank ") + std::to_string(rank_) + ": " + op.what +
                       " did not complete within " + std::to_string(timeout_.count()) +
                       " ms: a peer did not join (dead, hung, or issuing other collectives)")));
      }
      if (abort_pending_) {
        lock.unlock();
        finish_abort();
        lock.lock();
      }
    }
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  device dev_;
  cudaStream_t stream_ = nullptr;
  std::chrono::milliseconds timeout_;
  mutable std::mutex m_;
  std::mutex issue_m_;
  std::condition_variable cv_, idle_;
  std::deque<pending_op> pending_;
  std::exception_ptr failure_;
  bool aborted_ = false;
  bool abort_pending_ = false;  // ncclCommAbort still to run (finish_abort)
  bool stopping_ = false;
  std::atomic<std::uint64_t> completed_{0};
  std::thread poller_;  // last: starts after the other members exist
};
static_assert(dparallel::communicator<communicator>);

/// Thread ranks of one process, rank i on GPU gpus[i] (distinct GPUs; NCCL refuses two ranks on
/// one GPU). Made together with ncclCommInitAll; hand group i to the thread that runs rank i.
inline std::vector<process_group> make_groups(std::vector<device> const& gpus,
                                              std::chrono::milliseconds timeout = std::chrono::seconds(300)) {
  dparallel::detail::require(!gpus.empty(), "nccl::make_groups: expected at least one GPU, found none");
  std::vector<int> ordinals;
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    cuda::check_device(gpus[i]);
    for (std::size_t j = 0; j < i; ++j)
      dparallel::detail::require(gpus[j].index != gpus[i].index,
                                 "nccl::make_groups: NCCL needs one rank per GPU, found ranks " + std::to_string(j) +
                                     " and " + std::to_string(i) + " on GPU " + std::to_string(gpus[i].index) +
                                     "; logical devices of one GPU use the CUDA backend's copy/kernel path");
    ordinals.push_back(gpus[i].index);
  }
  std::vector<ncclComm_t> comms(gpus.size(), nullptr);
  check(ncclCommInitAll(comms.data(), static_cast<int>(comms.size()), ordinals.data()), "ncclCommInitAll", 0);
  std::vector<process_group> out;
  for (std::size_t i = 0; i < gpus.size(); ++i)
    out.emplace_back(std::make_shared<communicator>(comms[i], static_cast<int>(i), static_cast<int>(gpus.size()),
                                                    gpus[i], timeout));
  return out;
}

/// One rank per process: resolves the launch from the environment (see init_process_group), picks
/// GPU local_rank % device_count() unless `gpu` is given, shares rank 0's unique id through
/// `bootstrap` (e.g. an MPI group) or the TCP rendezvous, and makes the communicator with
/// ncclCommInitRank.
inline distributed_group init_process_group(init_options const& opts = {}, process_group const& bootstrap = {},
                                            std::optional<device> gpu = std::nullopt,
                                            environment const& env = process_environment()) {
  return dparallel::init_process_group(
      [&](launch_info const& info, init_options const& o) -> process_group {
        int const n = cuda::device_count();
        if (n == 0 && !gpu)
          throw invalid_argument("dparallel: nccl::init_process_group on rank " + std::to_string(info.rank) +
                                 ": no GPU (" + cuda::no_device_reason() + ")");
        device const d = gpu.value_or(device{device_kind::cuda, info.local_rank % (n == 0 ? 1 : n), 0});
        cuda::check_device(d);
        ncclUniqueId id{};
        if (info.rank == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId", 0);
        auto const bytes = share_root_bytes(info, std::as_bytes(std::span(&id, 1)), sizeof id, bootstrap, o.timeout);
        std::memcpy(&id, bytes.data(), sizeof id);
        cuda::device_guard g(d.index);
        ncclComm_t comm = nullptr;
        check(ncclCommInitRank(&comm, info.world_size, id, info.rank), "ncclCommInitRank", info.rank);
        return process_group(std::make_shared<communicator>(comm, info.rank, info.world_size, d, o.timeout));
      },
      opts, env);
}

}  // namespace nccl
DPARALLEL_NAMESPACE_END

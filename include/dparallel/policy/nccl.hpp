#pragma once
// DataParallel over distinct GPUs with NCCL (part of the NCCL add-on, dparallel::nccl): the
// replicate and reduce policies of nccl::dp. When every device of the wrapper is its own GPU they
// use one NCCL communicator per device (ncclCommInitAll, made at construction):
//  - replicate: before every step, the master's parameters and buffers, flattened into one
//    bucket per dtype, are broadcast to every replica in one ncclGroupStart/End (ncclBroadcast
//    from device 0, one per bucket, each on its device's stream), and copied out of the buckets;
//  - reduce: each device's gradients are flattened into one bucket per dtype (in place when they
//    already lie back to back), and one group of ncclReduce, one call per bucket and device, with
//    a pre-multiplying sum (ncclRedOpCreatePreMulSum: each replica's gradient times its shard's
//    weight, inside NCCL's kernel; a replica without a shard contributes zeros) lands
//    sum_i w_i * g_i in the master's gradients. The clique keeps one operator per device and
//    dtype while its weight stays. A 16-bit bucket whose weights 16 bits cannot hold (a third)
//    is reduced in F32 and rounded once at the end (comm/nccl/detail/dp_plan.hpp).
// Both policies share one clique (one communicator per device). A watchdog follows each group:
// when it fails, or has not completed within options::timeout (a peer GPU hung), every
// communicator is aborted (ncclCommAbort) and the step fails with an error naming the device(s)
// and the cause; so is a group whose enqueue fails (an NCCL call or an operator's creation);
// later steps fail at once (construct a new wrapper).
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
#include <dparallel/comm/nccl/clique.hpp>
#include <dparallel/comm/nccl/detail/dp_plan.hpp>
#include <dparallel/comm/nccl/dp_transport.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/parallel.hpp>
#include <dparallel/policy/reduce.hpp>
#include <dparallel/policy/replicate.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace nccl {
namespace dp_detail {

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

/// Replicate: the master's parameters and buffers flattened into one bucket per dtype, then one
/// grouped ncclBroadcast per bucket and replica from device 0 before every step, and each replica
/// copies its buckets into its tensors on its own stream (no copy where a device's tensors are one
/// allocation); the copy path of policy::replicate_each_step when the devices are not distinct
/// GPUs.
struct broadcast_replicate : dp_detail::with_comms<policy::replicate_each_step> {
  /// Broadcasts the master's parameters and buffers to every replica.
  template <class Set>
  void before_step(Set& s) {
    if (!comms) {
      fallback.before_step(s);
      return;
    }
    plan(s);
    // One thread (stream 0's) fills the master's buckets and launches the whole group, each call
    // on its device's stream; the other streams wait for the launch before they copy their
    // buckets out (their copies follow the broadcast on their own stream).
    auto const launched = s.streams[0]->enqueue([this, &s, c = comms] {
      auto& st = *s.streams[0];
      for (std::size_t b = 0; b < buckets_.size(); ++b)
        if (!store_.in_place[0][b]) copy_members(st, 0, b, true);
      std::vector<cudaStream_t> streams;
      for (std::size_t i = 0; i < s.size(); ++i) streams.push_back(s.streams[i]->native());
      dp_detail::broadcast_flat(*c, streams, store_.flat);
    });
    for (std::size_t i = 1; i < s.size(); ++i) {
      s.streams[i]->wait(launched);
      s.streams[i]->enqueue([this, &s, i] {
        for (std::size_t b = 0; b < buckets_.size(); ++b)
          if (!store_.in_place[i][b]) copy_members(*s.streams[i], i, b, false);
      });
    }
  }

 private:
  // (calling thread) Every device's parameters then buffers, checked against the master's before
  // anything is enqueued (no group is left half-filled by an argument error), their buckets and
  // where those live. Read by the step's work until it completes (the step drains its streams).
  template <class Set>
  void plan(Set& s) {
    tensors_.resize(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) dparallel::detail::assign_joined(tensors_[i], s.params[i], s.bufs[i]);
    for (std::size_t i = 1; i < s.size(); ++i)
      for (std::size_t k = 0; k < tensors_[0].size(); ++k) {
        tensor_ref const src = tensors_[0][k];
        tensor_ref const dst = k < tensors_[i].size() ? tensors_[i][k] : tensor_ref{};
        (void)to_nccl(src.dtype());
        dparallel::detail::require(tensors_[i].size() == tensors_[0].size() && dst.size() == src.size() &&
                                       dst.dtype() == src.dtype(),
                                   [&] {
                                     return "nccl::dp replicate: tensor " + std::to_string(k) + " of replica " +
                                            std::to_string(i) + " has " + std::to_string(dst.size()) + " x " +
                                            std::string(name_of(dst.dtype())) + ", the master's " +
                                            std::to_string(src.size()) + " x " + std::string(name_of(src.dtype()));
                                   });
      }
    buckets_ = dparallel::detail::plan_flat_buckets(std::span<tensor_ref const>(tensors_[0]), {});
    store_.resize(s.size(), buckets_.size());
    for (std::size_t i = 0; i < s.size(); ++i)
      for (std::size_t b = 0; b < buckets_.size(); ++b)
        store_.place(i, b, buckets_[b], std::span<tensor_ref const>(tensors_[i]), s.devices[i], nullptr);
  }

  // Bucket b's members between device i's tensors and its flat bucket, on `st` (device i's
  // stream): into the bucket (`in`) or out of it.
  template <class Stream>
  void copy_members(Stream& st, std::size_t i, std::size_t b, bool in) {
    auto const& bk = buckets_[b];
    for (std::size_t j = 0; j < bk.members.size(); ++j) {
      tensor_ref const t = tensors_[i][bk.members[j]];
      tensor_ref const f = store_.flat[i][b].subview(bk.offsets[j], t.size());
      cuda::copy(st.native(), st.logical_device(), in ? f : t, in ? t : f);
    }
  }

  std::vector<std::vector<tensor_ref>> tensors_;       // per device: its parameters, then buffers
  std::vector<dparallel::detail::flat_bucket> buckets_;  // one per dtype
  dp_detail::flat_storage store_;                       // where each device's buckets live
};
static_assert(replicate_policy<broadcast_replicate>);

/// Reduce: each device's gradients flattened into one bucket per dtype (comm/nccl/detail/dp_plan.hpp),
/// then one grouped ncclReduce per bucket and device onto the master, the shard weights applied
/// inside NCCL's sum by one pre-multiplying operator per device and dtype (kept by the clique
/// while the weight stays); the pairwise copy/kernel path of policy::reduce_to_master when the
/// devices are not distinct GPUs.
struct weighted_reduce : dp_detail::with_comms<policy::reduce_to_master> {
  /// Nothing to do before the step functions run.
  template <class Set>
  void begin_step(Set&) {}
  /// Ignored: the reduction starts after every step function.
  template <class Set>
  void grad_ready(Set&, int, std::size_t) {}

  /// Flattens each device's gradients on its stream, reduces the buckets onto the master in one
  /// NCCL group, and copies the master's buckets back into its gradients.
  template <class Set>
  void finish(Set& s) {
    if (!comms) {
      fallback.finish(s);
      return;
    }
    plan(s);
    // Each device fills its buckets on its own stream, after its step function: its gradients
    // converted or copied in, or zeros when it had no shard (its gradient holds a stale value,
    // and 0 * inf would be NaN), or nothing when a bucket is its gradients' own memory.
    for (std::size_t i = 0; i < s.size(); ++i) {
      auto const packed = s.streams[i]->enqueue([this, &s, i] { pack(s, i); });
      if (i != 0) s.streams[0]->wait(packed);
    }
    // The group below enqueues ncclReduce on every device's stream from stream 0's thread: it
    // must come after each device's packing was launched on that stream, so stream 0 waits for
    // those launches first (wait() needs the CUDA event, which exists once the work launched).
    auto const launched = s.streams[0]->enqueue([this, &s, c = comms] {
      std::size_t const nb = buckets_.size();
      std::vector<cudaStream_t> streams;
      for (std::size_t i = 0; i < s.size(); ++i) streams.push_back(s.streams[i]->native());
      std::vector<dtype> types(nb);
      std::vector<std::vector<double>> weights(s.size(), std::vector<double>(nb));
      for (std::size_t b = 0; b < nb; ++b) {
        types[b] = buckets_[b].reduce_in;
        for (std::size_t i = 0; i < s.size(); ++i) weights[i][b] = weights_[b].weights[i];
      }
      dp_detail::reduce_flat(*c, streams, store_.flat, types, weights);
      unpack(s);
      // The watchdog's verdict on this step's groups (the broadcast and this reduce): a hung or
      // failed group was aborted by now and fails the step, naming the device(s) and the cause.
      c->wait_all();
    });
    for (std::size_t i = 1; i < s.size(); ++i) s.streams[i]->wait(launched);
  }

 private:
  // (calling thread) The step's buckets and weights, every argument checked before any work is
  // enqueued (no group is left half-filled by an argument error). Read by the step's work until
  // it completes: the step drains every stream before it returns or throws.
  template <class Set>
  void plan(Set& s) {
    sizes_.assign(s.shard_sizes.begin(), s.shard_sizes.end());
    auto const& master = s.grads[0];
    for (std::size_t i = 1; i < s.size(); ++i) {
      auto const& g = s.grads[i];
      bool same = g.size() == master.size();
      for (std::size_t k = 0; same && k < g.size(); ++k)
        same = g[k].size() == master[k].size() && g[k].dtype() == master[k].dtype();
      dparallel::detail::require(same, [&] {
        return "nccl::dp reduce: replica " + std::to_string(i) + " (" + to_string(s.devices[i]) +
               ") has gradients of other sizes or dtypes than the master's; every replica must be the "
               "master's copy (make_replica)";
      });
    }
    buckets_ = dparallel::detail::plan_flat_buckets(std::span<tensor_ref const>(master), sizes_);
    weights_.clear();
    for (auto const& b : buckets_) {
      dparallel::detail::require(b.grads == dtype::f32 || b.grads == dtype::f64 || b.grads == dtype::f16 ||
                                     b.grads == dtype::bf16,
                                 [&] {
                                   return "nccl::dp reduce: expected floating-point gradients (F32, F64, F16, BF16), "
                                          "found " +
                                          std::string(name_of(b.grads));
                                 });
      weights_.push_back(dparallel::detail::choose_premul(b.grads, sizes_));
    }
    store_.resize(s.size(), buckets_.size());
  }

  // (device i's stream) Fills device i's buckets.
  template <class Set>
  void pack(Set& s, std::size_t i) {
    auto& st = *s.streams[i];
    device const dev = st.logical_device();
    std::span<tensor_ref const> const grads(s.grads[i]);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto const& bk = buckets_[b];
      store_.place(i, b, bk, grads, dev, st.native());  // new memory zeroed on this stream
      tensor_ref const flat = store_.flat[i][b];
      if (!s.active(i)) {
        cuda::zero(st.native(), dev, flat);
      } else if (!store_.in_place[i][b]) {
        for (std::size_t j = 0; j < bk.members.size(); ++j) {
          tensor_ref const g = grads[bk.members[j]];
          cuda::convert(st.native(), dev, flat.subview(bk.offsets[j], g.size()), g);
        }
      }
    }
  }

  // (stream 0, after the group) The master's buckets back into its gradients, converted once.
  template <class Set>
  void unpack(Set& s) {
    auto& st = *s.streams[0];
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if (store_.in_place[0][b]) continue;
      auto const& bk = buckets_[b];
      for (std::size_t j = 0; j < bk.members.size(); ++j) {
        tensor_ref const g = s.grads[0][bk.members[j]];
        cuda::convert(st.native(), st.logical_device(), g, store_.flat[0][b].subview(bk.offsets[j], g.size()));
      }
    }
  }

  std::vector<std::size_t> sizes_;                            // shard size per device (0: none)
  std::vector<dparallel::detail::flat_bucket> buckets_;       // one per gradient dtype
  std::vector<dparallel::detail::premul_weights> weights_;    // per bucket
  dp_detail::flat_storage store_;                             // where each device's buckets live
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

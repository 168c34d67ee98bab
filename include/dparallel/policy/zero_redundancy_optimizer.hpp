#pragma once
// ZeRO stage 1's optimizer (PyTorch's ZeroRedundancyOptimizer): over a ddp_zero1 wrapper, each
// rank updates only its shard of every gradient bucket, with its shard of the optimizer state,
// and the updated parameters are all-gathered bucket by bucket.
//
//   dparallel::parallel<model, dparallel::ddp_zero1> w(m, rank);   // was: parallel<model, ddp>
//   dparallel::zero_redundancy_optimizer opt(w, my_rule{});        // any optim::update_rule
//   for (...) { w.step(batch, step_fn); opt.step(lr); }
//
// On the CUDA backend (NCCL engine) the same code runs with the CUDA optimizer kernels: include
// <dparallel/backend/cuda/optim_kernels.hpp> (nvcc) first. The shard copies and the update run
// on one stream (optim::backend_kernels<cuda::backend>: the calling thread's, the legacy default
// stream outside stream work), in issue order; see step() for the ordering against the
// collectives.

#include <dparallel/config.hpp>
#include <dparallel/backend/host/backend.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/optim/element.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/rule.hpp>
#include <dparallel/parallel.hpp>
#include <dparallel/policy/bucketed_reduce_scatter.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// ZeRO stage 1 over a wrapper whose reduce policy is policy::bucketed_reduce_scatter (the
/// ddp_zero1 bundle): the optimizer state is sharded like the gradient buckets, so each rank
/// holds 1/N of it (plus at most N - 1 elements of padding per bucket and slot).
///
/// step(lr), after the wrapper's synchronised step(): for each bucket in launch order, this rank's
/// shard of the parameters is copied into the bucket's storage, updated by the rule from the
/// rank's averaged gradient shard and state shard, and an all-gather of the bucket's storage is
/// started; then, bucket by bucket as the all-gathers complete, every parameter is copied back
/// from the storage. The update of a bucket overlaps the all-gathers of the buckets before it;
/// step() returns when every parameter is updated (the gathers do not yet overlap the next
/// forward).
///
/// The rule is elementwise (optim::update_rule), so the parameters are bitwise those of DDP with
/// the same rule applied to whole tensors, on the host and MPI engines (same reduction order), and
/// on NCCL wherever its reduce-scatter sums in the all-reduce's order (two ranks always).
/// Parameters must be f32 (16-bit parameters with master copies: not yet). The rule runs through
/// optim::backend_kernels of the wrapper's backend: on the host for host::backend, as the CUDA
/// optimizer kernels for cuda::backend (an optim::element_rule). The state is allocated at the
/// first step (the bucket plan is final then); steps after it allocate no state or bucket memory.
template <optim::update_rule Rule, class Wrapper>
class zero_redundancy_optimizer {
  using reducer_type = typename Wrapper::reduce_type;
  static_assert(std::is_same_v<reducer_type, policy::bucketed_reduce_scatter>,
                "dparallel: zero_redundancy_optimizer needs a wrapper whose reduce policy is "
                "policy::bucketed_reduce_scatter: build it as parallel<Model, dparallel::ddp_zero1> (or a bundle "
                "derived from ddp_zero1)");
  using backend_type = typename Wrapper::backend_type;
  // Every host-memory backend (host::backend or one derived from it) runs the host's loops.
  using kernels = optim::backend_kernels<
      std::conditional_t<backend_type::kind == device_kind::host, host::backend, backend_type>>;
  static_assert(requires { sizeof(kernels); },
                "dparallel: zero_redundancy_optimizer has no optimizer kernels for this backend: for cuda::backend "
                "include <dparallel/backend/cuda/optim_kernels.hpp> (compiled by nvcc) before using it");

 public:
  /// The update rule.
  using rule_type = Rule;
  /// The wrapper it updates.
  using wrapper_type = Wrapper;

  /// Over the parameters of `w` (by reference: it must outlive the optimizer), with `rule`.
  /// Throws invalid_argument naming the rank and parameter when a parameter is not f32.
  explicit zero_redundancy_optimizer(Wrapper& w, Rule rule = Rule{}) : w_(&w), rule_(std::move(rule)) {
    auto const params = parameter_refs(w.module());
    for (std::size_t i = 0; i < params.size(); ++i) {
      detail::require(params[i].dtype() == dtype::f32,
                      "zero_redundancy_optimizer on rank " + std::to_string(w.group().rank()) + ": parameter " +
                          std::to_string(i) + " is " + std::string(name_of(params[i].dtype())) +
                          ", expected F32 (the update rules work on F32 values)");
    }
  }

  zero_redundancy_optimizer(zero_redundancy_optimizer const&) = delete;
  zero_redundancy_optimizer& operator=(zero_redundancy_optimizer const&) = delete;

  /// One update with learning rate `lr` from the gradient shards of the wrapper's last
  /// synchronised step; every rank must call it (it all-gathers). Throws invalid_argument when
  /// the wrapper has reduced no gradients since the last update (e.g. only no_sync steps).
  ///
  /// Ordering on a GPU. (1) The update reads the gradient shards after the reduce-scatters'
  /// completion: the wrapper's step() waited for every bucket's work, and a work completes when
  /// the collective's completion event has (comm/nccl.hpp); work issued after that wait sees the
  /// collective's writes (CUDA: host-side synchronisation with an event orders later launches
  /// after the work it captured). (2) The all-gather of a bucket runs after its update: the NCCL
  /// engine makes its stream wait on an event recorded on the issuing thread's stream, the one
  /// the copy and the update kernel went to (cudaStreamWaitEvent: later work on the stream waits
  /// for all work captured in the event). (3) The parameters are copied back after the gather's
  /// work completed (waited on the host), and step() returns after kernels::finish synchronised
  /// that stream, since the wrapper's non-blocking streams would not wait for it.
  void step(double lr) {
    auto& r = w_->reducer();
    int const rank = w_->group().rank();
    if (r.reductions() == seen_reductions_)
      throw invalid_argument("dparallel: zero_redundancy_optimizer::step on rank " + std::to_string(rank) +
                             ": expected a synchronised step() of the wrapper since the last update, found none "
                             "(the gradient shards are stale); call the wrapper's step() outside no_sync() first");
    if (allocated_ && plan_ != r.plan_generation())
      throw invalid_argument("dparallel: zero_redundancy_optimizer::step on rank " + std::to_string(rank) +
                             ": the wrapper's bucket plan changed after the optimizer state was laid out");
    auto const c = rule_.constants(steps_ + 1, lr);  // may refuse lr: nothing changed yet
    seen_reductions_ = r.reductions();
    if (!allocated_) allocate_state(r);
    ++steps_;
    params_.clear();
    for (auto&& t : parameters(w_->module())) params_.emplace_back(t);
    std::size_t const nb = r.buckets().size();
    works_.assign(nb, work{});
    try {
      for (std::size_t b = 0; b < nb; ++b) update_bucket(r, b, c);
      for (std::size_t b = 0; b < nb; ++b) {
        works_[b].wait();
        copy_back(r, b);
      }
      kernels::finish(w_->devices()[0]);
    } catch (...) {
      // The buckets' storage must outlive the collectives still in flight.
      w_->group().abort("rank " + std::to_string(rank) + " failed in zero_redundancy_optimizer::step");
      w_->group().drain();
      throw;
    }
  }

  /// The same, in optim::optimizer's form (`opt.step(w, lr)`): `w` must be the wrapper the
  /// optimizer was built over.
  void step(Wrapper& w, double lr) {
    detail::require(&w == w_, "zero_redundancy_optimizer::step: expected the wrapper the optimizer was built over, "
                              "found another one");
    step(lr);
  }
  /// One update at the rule's default learning rate (Rule::default_lr, e.g. Adam's 1e-3).
  void step()
    requires requires { Rule::default_lr; }
  {
    step(static_cast<double>(Rule::default_lr));
  }

  /// This rank's shards of the averaged gradient, one per bucket, without their padding: what
  /// optim::clip_grad_norm_sharded(opt.gradient_shards(), group, max_norm) clips before step().
  /// Valid after the wrapper's synchronised step(), until the next step().
  [[nodiscard]] std::span<tensor_ref const> gradient_shards() {
    auto const& r = w_->reducer();
    shards_.clear();
    for (std::size_t b = 0; b < r.buckets().size(); ++b) shards_.push_back(r.grad_shard(b).subview(0, r.shard_valid(b)));
    return shards_;
  }

  /// The rule (its hyperparameters may be changed between steps).
  [[nodiscard]] Rule& rule() noexcept { return rule_; }
  /// The rule.
  [[nodiscard]] Rule const& rule() const noexcept { return rule_; }
  /// Updates made so far.
  [[nodiscard]] std::uint64_t steps() const noexcept { return steps_; }
  /// Bytes of optimizer state this rank holds (0 before the first step).
  [[nodiscard]] std::size_t state_bytes() const noexcept { return state_elements_ * sizeof(float); }
  /// This rank's shard of state slot `slot` (Rule::slot_names[slot]) for bucket `b` of the
  /// wrapper's reducer, shard_elements(b) values (empty before the first step, and for slots
  /// the rule does not use: optim::active_slots).
  [[nodiscard]] std::span<float const> state_shard(std::size_t slot, std::size_t b) const {
    if (slot * bucket_count_ + b >= slots_.size()) return {};
    auto const m = w_->reducer().shard_elements(b);
    return {slot_data(slot * bucket_count_ + b), m};
  }

 private:
  using constants_type = typename Rule::step_constants;

  [[nodiscard]] float* slot_data(std::size_t i) const { return reinterpret_cast<float*>(slots_.at(i).get()); }

  void allocate_state(reducer_type const& r) {
    bucket_count_ = r.buckets().size();
    plan_ = r.plan_generation();
    state_elements_ = 0;
    slots_.clear();
    active_ = optim::active_slots(rule_);  // slots from active_ on are never read: no storage
    allocated_ = true;
    for (std::size_t k = 0; k < active_; ++k) {
      for (std::size_t b = 0; b < bucket_count_; ++b) {
        std::size_t const m = r.shard_elements(b);
        slots_.push_back(backend_type::allocate(w_->devices()[0], m * sizeof(float)));  // zeroed
        state_elements_ += m;
      }
    }
  }

  // Copies this rank's shard of the bucket's parameters into the storage, updates it, starts the
  // all-gather of the storage.
  void update_bucket(reducer_type& r, std::size_t b, constants_type const& c) {
    auto const& spec = r.buckets()[b];
    tensor_ref const storage = r.bucket_storage(b);
    if (storage.size() == 0) return;
    std::size_t const lo = r.shard_offset(b), valid = r.shard_valid(b), m = r.shard_elements(b);
    for (std::size_t k = 0; k < spec.params.size(); ++k) {
      tensor_ref const p = params_[spec.params[k]];
      std::size_t const first = spec.offsets[k];
      std::size_t const a = std::max(first, lo), z = std::min(first + p.size(), lo + valid);
      if (a < z) kernels::copy(storage.subview(a, z - a), p.subview(a - first, z - a));
    }
    std::array<float*, optim::detail::slot_array_size<Rule>> s{};
    for (std::size_t k = 0; k < active_; ++k) s[k] = slot_data(k * bucket_count_ + b);
    if (valid != 0)
      kernels::apply(rule_, c, storage.subview(lo, valid), r.grad_shard(b).subview(0, valid),
                     std::span<float* const>(s.data(), Rule::slot_count));
    works_[b] = w_->group().all_gather(storage, storage.subview(lo, m));  // after the update: see step()
  }

  // Every parameter of bucket b from the gathered storage.
  void copy_back(reducer_type const& r, std::size_t b) {
    auto const& spec = r.buckets()[b];
    tensor_ref const storage = r.bucket_storage(b);
    for (std::size_t k = 0; k < spec.params.size(); ++k) {
      tensor_ref const p = params_[spec.params[k]];
      if (p.size() != 0) kernels::copy(p, storage.subview(spec.offsets[k], p.size()));
    }
  }

  Wrapper* w_;
  Rule rule_;
  std::uint64_t steps_ = 0;
  std::uint64_t seen_reductions_ = 0;
  std::uint64_t plan_ = 0;
  std::size_t bucket_count_ = 0;
  std::size_t state_elements_ = 0;
  std::size_t active_ = 0;  // slots the rule uses
  bool allocated_ = false;
  std::vector<std::shared_ptr<std::byte>> slots_;  // slot k of bucket b at k * bucket_count_ + b (Backend::allocate)
  std::vector<tensor_ref> params_;
  std::vector<tensor_ref> shards_;  // gradient_shards()
  std::vector<work> works_;
};

DPARALLEL_NAMESPACE_END

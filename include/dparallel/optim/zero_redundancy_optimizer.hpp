#pragma once
// ZeRO stage 1's optimizer (PyTorch's ZeroRedundancyOptimizer): over a ddp_zero1 wrapper, each
// rank updates only its shard of every gradient bucket, with its shard of the optimizer state,
// and the updated parameters are all-gathered bucket by bucket.
//
//   dparallel::parallel<model, dparallel::ddp_zero1> w(m, rank);   // was: parallel<model, ddp>
//   dparallel::optim::zero_redundancy_optimizer opt(w, my_rule{}); // any optim::update_rule
//   for (...) { w.step(batch, step_fn); opt.step(lr); }
//
// With zero_options{.overlap_gather = true} step() returns once the all-gathers are started, and
// they run on into the next step's forward: the step function calls opt.need(i) before it reads
// parameter i (docs/zero.md, "Overlapping the all-gather with the next forward").
//
// On the CUDA backend (NCCL engine) the same code runs with the CUDA optimizer kernels: include
// <dparallel/optim/cuda/kernels.hpp> (nvcc) first. The shard copies and the update run
// on one stream (optim::backend_kernels<cuda::backend>: the calling thread's, the legacy default
// stream outside stream work), in issue order; see step() for the ordering against the
// collectives.

#include <dparallel/config.hpp>
#include <dparallel/backend/host/backend.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/half.hpp>
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
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

namespace detail {
struct zero_state_access;  // optim/zero_checkpoint.hpp: saves and restores the sharded state
}  // namespace detail

/// Options of zero_redundancy_optimizer.
struct zero_options {
  /// step() starts the all-gathers of the updated parameters and returns; each bucket's gather is
  /// completed (and its parameters written) by need(i) for any parameter i of the bucket, by
  /// wait_gathers(), or by the next step(). The step function must call need(i) before it reads
  /// parameter i: a synchronised step that writes the gradient of a used parameter whose bucket
  /// was not waited for fails on every rank (the forward read stale values), naming it.
  bool overlap_gather = false;
  /// F16/BF16 parameters: each rank keeps an F32 master copy of its shard of them (like
  /// optim::optimizer_options::master_weights, 1/N of it), updates the master from the 16-bit
  /// gradient shard widened to F32 and all-gathers the master rounded to nearest even. Without it
  /// 16-bit parameters are refused.
  bool master_weights = false;
};

/// ZeRO stage 1 over a wrapper whose reduce policy is policy::bucketed_reduce_scatter (the
/// ddp_zero1 bundle): the optimizer state is sharded like the gradient buckets, so each rank
/// holds 1/N of it (plus at most N - 1 elements of padding per bucket and slot).
///
/// step(lr), after the wrapper's synchronised step(): for each bucket in launch order, this rank's
/// shard of the parameters is updated in place by the rule from the rank's averaged gradient shard
/// and state shard, copied into the bucket's storage, and an all-gather of the storage is started;
/// then, bucket by bucket as the all-gathers complete, the elements the other ranks updated are
/// copied into the parameters. On an engine with process_group::all_gather_coalesced (thread
/// ranks, shared memory) and without overlap_gather, the bucket's parameters (and a few elements
/// of padding) are gathered in place as a list instead: no copies into the storage and back. The
/// update of a bucket overlaps the all-gathers of the buckets before it (MPI, NCCL; thread ranks
/// and shared memory run the held gathers once every bucket is updated, on the calling thread);
/// step() returns when every parameter is updated, or, with zero_options::overlap_gather, once
/// every gather is started (buckets in reverse, so that the first layers' parameters, which the
/// forward reads first, are gathered first): the gathers then overlap the next forward.
///
/// The rule is elementwise (optim::update_rule), so the parameters are bitwise those of DDP with
/// the same rule applied to whole tensors, on the host and MPI engines (same reduction order), and
/// on NCCL wherever its reduce-scatter sums in the all-reduce's order (two ranks always).
/// Parameters are f32, or f16/bf16 with zero_options::master_weights (each rank then holds the F32
/// master copy of its shard: bitwise DDP with optim::optimizer_options::master_weights, whose
/// 16-bit gradient the reduce-scatter averages as the all-reduce does). The rule runs through
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
                "include <dparallel/optim/cuda/kernels.hpp> (compiled by nvcc) before using it");

 public:
  /// The update rule.
  using rule_type = Rule;
  /// The wrapper it updates.
  using wrapper_type = Wrapper;

  /// Over the parameters of `w` (by reference: it must outlive the optimizer), with `rule`.
  /// Throws invalid_argument naming the rank and parameter when a parameter is neither f32 nor
  /// (with opts.master_weights) f16/bf16. (Each gradient has its parameter's dtype: the wrapper
  /// checked it.)
  explicit zero_redundancy_optimizer(Wrapper& w, Rule rule = Rule{}, zero_options opts = {})
      : w_(&w), rule_(std::move(rule)), opts_(opts) {
    auto const params = parameter_refs(w.module());
    param_count_ = params.size();
    std::string const where = "zero_redundancy_optimizer on rank " + std::to_string(w.group().rank()) + ": parameter ";
    for (std::size_t i = 0; i < params.size(); ++i) {
      dtype const t = params[i].dtype();
      bool const half = dparallel::detail::is_half(t);
      dparallel::detail::require(t == dtype::f32 || (half && opts_.master_weights), [&] {
        return where + std::to_string(i) + " is " + std::string(name_of(t)) +
               (half ? "; 16-bit parameters are updated through an F32 master copy of each rank's shard: build the "
                       "optimizer with zero_options{.master_weights = true}"
                     : ", expected F32 (or F16/BF16 with zero_options::master_weights)");
      });
    }
  }

  zero_redundancy_optimizer(zero_redundancy_optimizer const&) = delete;
  zero_redundancy_optimizer& operator=(zero_redundancy_optimizer const&) = delete;
  /// Waits for the all-gathers still in flight (they write into the wrapper's bucket storage).
  ~zero_redundancy_optimizer() {
    if (opts_.overlap_gather) w_->reducer().set_stage_guard(nullptr);
    for (auto& wk : works_) {
      try {
        wk.wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): a failed gather was the step's to report
      }
    }
  }

  /// Parameter `i` (in parameters(module()) order) holds its updated value: with
  /// zero_options::overlap_gather, waits for the all-gather of its bucket and writes every
  /// parameter of that bucket; otherwise (or when done already) returns at once. Call it in the
  /// step function before the forward reads parameter `i`.
  void need(std::size_t i) {
    if (i >= param_count_)
      throw invalid_argument("dparallel: zero_redundancy_optimizer::need: expected a parameter index below " +
                             std::to_string(param_count_) + ", found " + std::to_string(i));
    if (pending_count_ != 0) complete(bucket_of_[i]);
  }
  /// Every parameter holds its updated value (every gather still in flight completed): before
  /// reading the parameters outside a step function (evaluation, a checkpoint, another optimizer).
  void wait_gathers() {
    if (pending_count_ == 0) return;
    for (std::size_t b = pending_.size(); b-- > 0;) complete(b);
  }
  /// Buckets whose all-gather step() started and nothing has waited for yet.
  [[nodiscard]] std::size_t pending_gathers() const noexcept { return pending_count_; }

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
    wait_gathers();  // none after a synchronised step (its guard completed them); to be sure
    seen_reductions_ = r.reductions();
    r.shards_consumed();
    if (!allocated_) allocate_state(r);
    ++steps_;
    params_.clear();
    for (auto&& t : parameters(w_->module())) params_.emplace_back(t);
    std::size_t const nb = r.buckets().size();
    works_.assign(nb, work{});
    if (in_place_) list_parameters(r);
    try {
      if (opts_.overlap_gather) {
        for (std::size_t b = nb; b-- > 0;) {
          update_bucket(r, b, c);
          pending_[b] = 1;
          ++pending_count_;
        }
        kernels::finish(w_->devices()[0]);  // the updates, before another stream's gather reads them
        return;
      }
      // The gathers are only waited for below: held, they run on this thread in drain() (thread
      // ranks, shared memory), with no hand-off to the communication thread and no wake-up.
      w_->group().hold();
      for (std::size_t b = 0; b < nb; ++b) update_bucket(r, b, c);
      w_->group().drain();
      for (std::size_t b = 0; b < nb; ++b) {
        works_[b].wait();
        if (!in_place_) copy_back(r, b);
      }
      kernels::finish(w_->devices()[0]);
    } catch (...) {
      // The buckets' storage must outlive the collectives still in flight.
      w_->group().abort("rank " + std::to_string(rank) + " failed in zero_redundancy_optimizer::step");
      w_->group().drain();
      throw;
    }
  }

  /// Leaves this step out (optim::grad_scaler found inf or NaN in the gradients): the gradient
  /// shards count as used, nothing is updated, the update count stays. Every rank must skip the
  /// same steps, or the parameters diverge.
  void skip() {
    auto& r = w_->reducer();
    if (r.reductions() == seen_reductions_)
      throw invalid_argument("dparallel: zero_redundancy_optimizer::skip on rank " + std::to_string(w_->group().rank()) +
                             ": expected a synchronised step() of the wrapper since the last update, found none");
    seen_reductions_ = r.reductions();
    r.shards_consumed();
  }

  /// The same, in optim::optimizer's form (`opt.step(w, lr)`): `w` must be the wrapper the
  /// optimizer was built over.
  void step(Wrapper& w, double lr) {
    dparallel::detail::require(&w == w_, "zero_redundancy_optimizer::step: expected the wrapper the optimizer was built over, "
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
  /// This rank's F32 master copy of its shard of bucket `b` (zero_options::master_weights, a
  /// 16-bit bucket), shard_elements(b) values; empty before the first step and for F32 buckets.
  [[nodiscard]] std::span<float const> master_shard(std::size_t b) const {
    if (b >= masters_.size() || !masters_[b]) return {};
    return {master_data(b), w_->reducer().shard_elements(b)};
  }
  /// This rank's shard of state slot `slot` (Rule::slot_names[slot]) for bucket `b` of the
  /// wrapper's reducer, shard_elements(b) values (empty before the first step, and for slots
  /// the rule does not use: optim::active_slots).
  [[nodiscard]] std::span<float const> state_shard(std::size_t slot, std::size_t b) const {
    if (slot * bucket_count_ + b >= slots_.size()) return {};
    auto const m = w_->reducer().shard_elements(b);
    return {slot_data(slot * bucket_count_ + b), m};
  }

 private:
  friend struct optim::detail::zero_state_access;
  using constants_type = typename Rule::step_constants;

  [[nodiscard]] float* slot_data(std::size_t i) const { return reinterpret_cast<float*>(slots_.at(i).get()); }
  [[nodiscard]] float* master_data(std::size_t b) const { return reinterpret_cast<float*>(masters_.at(b).get()); }

  void allocate_state(reducer_type& r) {
    bucket_count_ = r.buckets().size();
    pending_.assign(bucket_count_, 0);
    pending_count_ = 0;
    auto const params = parameter_refs(w_->module());
    bucket_of_.assign(params.size(), 0);
    for (std::size_t b = 0; b < bucket_count_; ++b)
      for (std::size_t i : r.buckets()[b].params) bucket_of_[i] = b;
    if (opts_.overlap_gather) r.set_stage_guard([this](std::size_t b, bool unused) { staging(b, unused); });
    plan_ = r.plan_generation();
    // Gathered in place (into the parameters) where the engine can, unless the gathers run on into
    // the next forward, which may read the parameters of the buckets it waited for meanwhile.
    in_place_ = !opts_.overlap_gather && w_->group().coalesces_in_place();
    gather_pads_.assign(bucket_count_, nullptr);
    gather_lists_.clear();
    if (in_place_) {
      gather_lists_.resize(bucket_count_);
      for (std::size_t b = 0; b < bucket_count_; ++b) {
        auto const& spec = r.buckets()[b];
        std::size_t at = 0;  // copying buckets lay their gradients out one after the other, as the list
        for (std::size_t k = 0; k < spec.params.size(); ++k) {
          dparallel::detail::require(spec.offsets[k] == at, "zero_redundancy_optimizer: expected bucket gradients laid out in "
                                                 "slot order");
          at += params[spec.params[k]].size();
        }
        std::size_t const pad = r.bucket_storage(b).size() - spec.elements;
        if (pad != 0) gather_pads_[b] = backend_type::allocate(w_->devices()[0], pad * size_of(spec.dtype));
      }
    }
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
    // The master shards of the 16-bit buckets: this rank's piece of each parameter, widened.
    masters_.assign(bucket_count_, nullptr);
    for (std::size_t b = 0; b < bucket_count_; ++b) {
      if (!dparallel::detail::is_half(r.buckets()[b].dtype) || r.shard_elements(b) == 0) continue;
      std::size_t const m = r.shard_elements(b), lo = r.shard_offset(b), valid = r.shard_valid(b);
      masters_[b] = backend_type::allocate(w_->devices()[0], m * sizeof(float));  // zeroed: the padding
      state_elements_ += m;
      auto const& spec = r.buckets()[b];
      for (std::size_t k = 0; k < spec.params.size(); ++k) {
        tensor_ref const p = params[spec.params[k]];
        std::size_t const first = spec.offsets[k];
        std::size_t const a = std::max(first, lo), z = std::min(first + p.size(), lo + valid);
        if (a < z) kernels::widen(master_data(b) + (a - lo), p.subview(a - first, z - a));
      }
    }
    kernels::finish(w_->devices()[0]);
    if (restore_) {  // state loaded before the plan was final (optim/zero_checkpoint.hpp)
      auto const f = std::move(restore_);
      restore_ = nullptr;
      f();
    }
  }

  // Updates this rank's shard of the bucket where it lies, in the parameters (piece by piece: the
  // shard covers parts of one or more parameters), copies the updated pieces into the storage and
  // starts the all-gather of the storage. Updating in place lets copy_back skip this rank's own
  // elements: per step the parameters are read and written once less than by an update in the
  // storage. A 16-bit bucket updates its F32 master shard and writes the pieces rounded
  // (kernels::apply_master). The rule is elementwise: the same bits as one update of the shard.
  void update_bucket(reducer_type& r, std::size_t b, constants_type const& c) {
    auto const& spec = r.buckets()[b];
    tensor_ref const storage = r.bucket_storage(b);
    if (storage.size() == 0) return;
    std::size_t const lo = r.shard_offset(b), valid = r.shard_valid(b), m = r.shard_elements(b);
    bool const master = b < masters_.size() && masters_[b] != nullptr;
    tensor_ref const grad = r.grad_shard(b);
    std::array<float*, optim::detail::slot_array_size<Rule>> s{};
    for (std::size_t k = 0; k < spec.params.size(); ++k) {
      tensor_ref const p = params_[spec.params[k]];
      std::size_t const first = spec.offsets[k];
      std::size_t const a = std::max(first, lo), z = std::min(first + p.size(), lo + valid);
      if (a >= z) continue;
      std::size_t const at = a - lo, n = z - a;  // the piece's place in the shard, its length
      for (std::size_t q = 0; q < active_; ++q) s[q] = slot_data(q * bucket_count_ + b) + at;
      std::span<float* const> const slots(s.data(), Rule::slot_count);
      tensor_ref const piece = p.subview(a - first, n);
      if (master) kernels::apply_master(rule_, c, piece, grad.subview(at, n), master_data(b) + at, slots);
      else kernels::apply(rule_, c, piece, grad.subview(at, n), slots);
      if (!in_place_) kernels::copy(storage.subview(a, n), piece);
    }
    // After the update: see step().
    if (in_place_) works_[b] = w_->group().all_gather_coalesced(gather_lists_[b]);
    else works_[b] = w_->group().all_gather(storage, storage.subview(lo, m));
  }

  // in_place_: each bucket's parameters, then its padding, as the list its all-gather fills in
  // place (the same array as the bucket's storage). Refilled every step (no allocation after the
  // first), since the model may hand out other views of the same parameters.
  void list_parameters(reducer_type const& r) {
    for (std::size_t b = 0; b < bucket_count_; ++b) {
      auto& list = gather_lists_[b];
      list.clear();
      for (std::size_t i : r.buckets()[b].params)
        if (params_[i].size() != 0) list.push_back(params_[i]);
      std::size_t const pad = r.bucket_storage(b).size() - r.buckets()[b].elements;
      if (pad != 0) list.emplace_back(gather_pads_[b].get(), pad, r.buckets()[b].dtype, w_->devices()[0]);
    }
  }

  // Bucket b's gather, if still pending: waited for, its parameters written.
  void complete(std::size_t b) {
    if (b >= pending_.size() || !pending_[b]) return;
    pending_[b] = 0;
    --pending_count_;
    try {
      works_[b].wait();
      copy_back(w_->reducer(), b);
      kernels::finish(w_->devices()[0]);
    } catch (...) {
      w_->group().abort("rank " + std::to_string(w_->group().rank()) +
                        " failed completing a zero_redundancy_optimizer all-gather");
      w_->group().drain();  // the other gathers write into the buckets' storage
      throw;
    }
  }

  // The stage guard (overlap_gather): a synchronised step is about to write a gradient into bucket
  // b's storage. Its gather is completed first (the storage is the gather's output); a pending
  // gather under a used parameter means the forward read that bucket's parameters before they
  // were updated.
  void staging(std::size_t b, bool unused) {
    if (b >= pending_.size() || !pending_[b]) return;
    wait_gathers();  // every bucket: the storage must be free before the step fails
    if (unused) return;
    auto const& ps = w_->reducer().buckets()[b].params;
    std::string list;
    for (std::size_t k = 0; k < ps.size() && k < 8; ++k)
      list += (k ? ", " : "") + dparallel::detail::parameter_label(w_->module(), ps[k]);
    if (ps.size() > 8) list += ", ...";
    throw invalid_argument("dparallel: zero_redundancy_optimizer with overlap_gather on rank " +
                           std::to_string(w_->group().rank()) + ": the step used parameter(s) " + list + " (bucket " +
                           std::to_string(b) +
                           ") before their all-gather was waited for, so its forward read the values from before the "
                           "last update; call opt.need(i) in the step function before reading parameter i (or "
                           "opt.wait_gathers() before the step)");
  }

  // Every parameter element of bucket b that other ranks updated, from the gathered storage (this
  // rank's own were updated in place by update_bucket).
  void copy_back(reducer_type const& r, std::size_t b) {
    auto const& spec = r.buckets()[b];
    tensor_ref const storage = r.bucket_storage(b);
    std::size_t const lo = r.shard_offset(b), hi = lo + r.shard_valid(b);  // this rank's own elements
    for (std::size_t k = 0; k < spec.params.size(); ++k) {
      tensor_ref const p = params_[spec.params[k]];
      std::size_t const first = spec.offsets[k], last = first + p.size();
      auto const from_storage = [&](std::size_t x, std::size_t y) {  // bucket elements [x, y)
        if (x < y) kernels::copy(p.subview(x - first, y - x), storage.subview(x, y - x));
      };
      from_storage(first, std::min(last, std::max(first, lo)));  // before the own shard
      from_storage(std::max(first, std::min(last, hi)), last);   // after it
    }
  }

  Wrapper* w_;
  Rule rule_;
  zero_options opts_;
  std::vector<char> pending_;            // overlap_gather: bucket b's gather started, not yet waited for
  std::size_t pending_count_ = 0;        // how many pending_ entries are set
  std::size_t param_count_ = 0;
  std::vector<std::size_t> bucket_of_;   // parameter -> bucket
  std::uint64_t steps_ = 0;
  std::uint64_t seen_reductions_ = 0;
  std::uint64_t plan_ = 0;
  std::size_t bucket_count_ = 0;
  std::size_t state_elements_ = 0;
  std::size_t active_ = 0;  // slots the rule uses
  bool allocated_ = false;
  std::vector<std::shared_ptr<std::byte>> slots_;  // slot k of bucket b at k * bucket_count_ + b (Backend::allocate)
  std::vector<std::shared_ptr<std::byte>> masters_;  // bucket b's F32 master shard; null for F32 buckets
  bool in_place_ = false;  // the all-gathers write into the parameters (*_coalesced engines, no overlap_gather)
  std::vector<std::vector<tensor_ref>> gather_lists_;  // in_place_: per bucket, its parameters and padding
  std::vector<std::shared_ptr<std::byte>> gather_pads_;  // in_place_: per bucket, room for its padding (or null)
  std::vector<tensor_ref> params_;
  std::vector<tensor_ref> shards_;  // gradient_shards()
  std::vector<work> works_;
  std::function<void()> restore_;  // fills the state at its allocation from a loaded checkpoint
  std::string state_set_;  // the ZeRO save set last loaded or saved (optim/detail/zero_sets.hpp)
};

}  // namespace optim

// The names they had before they moved into optim (the same class template and options).
using optim::zero_options;
using optim::zero_redundancy_optimizer;

DPARALLEL_NAMESPACE_END

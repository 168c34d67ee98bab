#pragma once
// DDP's reducer: gradients copied into buckets as they become ready, each full bucket reduced
// across the process group while backward goes on, results written back when the step ends.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/bucket_views.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/gradient_memory.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/comm_hook.hpp>
#include <dparallel/policy/replicate.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace policy {

/// Bucketed gradient reduction across the ranks of a process group (one local replica per rank).
///
/// - Buckets follow plan_buckets(): reverse parameter order, options::first_bucket_cap_mb for the
///   first and options::bucket_cap_mb for the others; after the first synchronised step they are
///   rebuilt once in the order the gradients became ready (rank 0's order, broadcast, so every
///   rank agrees).
/// - step_context::grad_ready(i) copies gradient i into its bucket; a bucket whose gradients are
///   all ready is reduced at once (buckets start strictly in order, so collectives match across
///   ranks). Buckets still pending when the step function returns are flushed then.
/// - The result is averaged over the world (ToRoot: reduced onto rank 0 only; the other ranks keep
///   their local gradients).
/// - Under no_sync, gradients are accumulated locally (weighted by each step's batch size); the
///   next synchronised step reduces the weighted mean of everything accumulated.
/// - With options::gradient_as_bucket_view the buckets are views of the gradients' own memory:
///   nothing is allocated or copied for them, each bucket is all-reduced in place (see
///   plan_views). Every rank's plan is checked against rank 0's at construction (a signature
///   all-gathered), so ranks that would issue different collectives fail there, every one of
///   them, with an error that says why.
/// - Without gradient_as_bucket_view, on an engine with process_group::all_reduce_coalesced
///   (thread ranks, shared memory), a bucket whose gradients were all marked after the step
///   function returned is reduced as the list of its gradients instead: no copies, the same bits.
///   A sharded reduction does the same (`launch_list`, with `pad_list` adding its padding) in
///   steps where the step function marked nothing and nothing was accumulated.
/// - register_comm_hook (the all-reduce form only) replaces each bucket's average by a hook's
///   reduction (policy/comm_hook.hpp); without one, the buckets are averaged by the group.
///
/// `Sharded` is void for DDP. A class derived from `bucketed_reduce<false, Derived>` (CRTP) takes
/// over what is generic to sharding the reduction (ZeRO-1: policy::bucketed_reduce_scatter): how
/// many elements each bucket's storage holds (`padded_elements`), the collective each
/// synchronised bucket starts (`launch_bucket`), whether the reduced buckets are written back to
/// the gradients (`scattering`), and what follows a synchronised step (`reduced`, after the
/// one-time rebuild); `on_plan` runs after every bucket plan. A sharded reduction takes no
/// communication hook (a hook reduces whole buckets).
template <bool ToRoot, class Sharded = void>
class bucketed_reduce {
  friend Sharded;  // ignored when Sharded is void
  static constexpr bool sharded = !std::is_void_v<Sharded>;

 public:
  /// The current bucket plan, in launch order.
  [[nodiscard]] std::vector<bucket_spec> const& buckets() const noexcept { return buckets_; }
  /// Whether the buckets are views of the gradients (options::gradient_as_bucket_view).
  [[nodiscard]] bool bucket_view() const noexcept { return view_; }
  /// Bytes of bucket storage this reducer holds (0 with gradient_as_bucket_view); the storage
  /// for no_sync accumulation, made the first time it is needed, is not counted.
  [[nodiscard]] std::size_t bucket_bytes() const noexcept {
    if (view_) return 0;
    std::size_t n = 0;
    for (auto const& b : buckets_) n += b.elements * size_of(b.dtype);
    return n;
  }

  /// Reduces each bucket with `hook` (and its `state`) instead of the group's average, from the
  /// next step on; see policy/comm_hook.hpp. Every rank must register the same kind of hook.
  template <class State, class Hook>
    requires(!ToRoot && !sharded && comm_hook<Hook, State>)
  void register_comm_hook(State state, Hook hook) {
    hook_.set(std::move(state), std::move(hook));
  }
  /// Whether DDP laid out the model's gradients (gradient_as_bucket_view with a model that has
  /// bind_gradients, core/gradient_memory.hpp): they then lie in memory from the process group.
  [[nodiscard]] bool gradients_bound() const noexcept { return bound_; }

  /// Whether a communication hook is registered.
  [[nodiscard]] bool has_comm_hook() const noexcept { return hook_.active(); }

  /// Plans the buckets and checks that every rank planned the same.
  template <class Set>
  void on_construct(Set& s) {
    detail::require(s.group.valid(), "bucketed reduce: expected a process group (use the DDP constructor)");
    if constexpr (ToRoot || sharded)
      detail::require(!s.opts.uneven_inputs && s.opts.average == average_mode::ranks,
                      "DDP: options::uneven_inputs and average_mode::samples work with the all-reduce reducer "
                      "(dparallel::ddp), found them with a reduce-to-root or sharded one; leave them off there");
    view_ = s.opts.gradient_as_bucket_view;
    if (view_) {
      // A model with bind_gradients moves its gradients into memory from the process group first
      // (core/gradient_memory.hpp); the buckets then follow them where they lie.
      std::string bind_error = detail::bind_replica_gradients(s, bound_);
      plan_views(s);
      if (!bind_error.empty()) plan_error_ = std::move(bind_error);  // reported on every rank by verify_plan
    } else {
      plan(s, reverse_order(s.params[0].size()));
    }
    verify_plan(s);
  }

  // The per-step members below are refilled in place (assign, clear): after the first step's
  // rebuild a step allocates no bucket memory and no bookkeeping. Checks on the per-step path
  // build their message only when they fail.
  /// Prepares this step's buckets (none under no_sync).
  template <class Set>
  void begin_step(Set& s) {
    std::size_t const n = s.params[0].size();
    if (n != counts_.size())
      throw invalid_argument("dparallel: DDP: the model has " + std::to_string(n) + " parameters now, expected the " +
                             std::to_string(counts_.size()) + " it had when the wrapper was built");
    if (view_) check_views(s);
    ready_.assign(n, false);
    seen_order_.clear();
    used_hook_ = false;
    next_bucket_ = 0;
    for (std::size_t b = 0; b < buckets_.size(); ++b) pending_[b] = buckets_[b].params.size();
    works_.assign(buckets_.size(), work{});
    first_accumulation_ = accumulated_ == 0;
    // Copying buckets on an engine with all_reduce_coalesced (thread ranks, shared memory): a bucket whose
    // gradients are all marked after the step function returned (none by grad_ready during
    // backward, which must leave the gradients alone until the step ends) is all-reduced as the
    // list of its gradients: the bits of the copy's all-reduce without the copies into bucket
    // storage and back.
    coalesce_ = false;
    flushing_ = false;
    if constexpr (!ToRoot && !sharded) coalesce_ = !view_ && s.sync && !hook_.active() && s.group.coalesces_in_place();
    if constexpr (sharded)  // reduce-scattered as the list of the gradients and the bucket's padding
      coalesce_ = s.sync && static_cast<Sharded const&>(*this).scattering() && s.group.coalesces_in_place();
    staged_.assign(buckets_.size(), 0);
    if (coalesce_) {
      lists_.resize(buckets_.size());
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        lists_[b].clear();
        for (std::size_t i : buckets_[b].params)
          if (s.grads[0][i].size() != 0) lists_[b].push_back(s.grads[0][i]);
        if constexpr (sharded) static_cast<Sharded&>(*this).pad_list(b, lists_[b]);
      }
    }
  }

  /// Gradient `i` is final: marks it ready (copying it into its bucket unless the buckets are views
  /// of the gradients) and starts, in bucket order, every bucket that is complete.
  template <class Set>
  void grad_ready(Set& s, int, std::size_t i) {
    if (i >= ready_.size())
      throw invalid_argument("dparallel: grad_ready: expected a parameter index below " +
                             std::to_string(ready_.size()) + ", found " + std::to_string(i));
    if (ready_[i])
      throw invalid_argument("dparallel: grad_ready: parameter " + detail::parameter_label(*s.models[0], i) +
                             " was marked ready twice in one step (rank " + std::to_string(s.group.rank()) + ")");
    used_hook_ = true;
    mark(s, i, false);
  }

  /// Enqueues, after the step function, the reduction of the buckets still pending and the wait
  /// for all of them; the reduced gradients end in the model's gradients.
  template <class Set>
  void finish(Set& s) {
    s.streams[0]->enqueue([this, &s] { finalize(s); });
  }

 private:
  template <class Set>
  void plan(Set& s, std::vector<std::size_t> const& order) {
    using backend = typename Set::backend_type;
    auto const& params = s.params[0];
    counts_.clear();
    std::vector<dtype> dtypes;
    for (auto const& p : params) {
      counts_.push_back(p.size());
      dtypes.push_back(p.dtype());
    }
    detail::require(s.opts.bucket_cap_mb > 0 && s.opts.first_bucket_cap_mb > 0,
                    "DDP: expected bucket_cap_mb and first_bucket_cap_mb > 0, found " +
                        std::to_string(s.opts.bucket_cap_mb) + " and " + std::to_string(s.opts.first_bucket_cap_mb));
    buckets_ = plan_buckets(counts_, dtypes, order, mib(s.opts.first_bucket_cap_mb), mib(s.opts.bucket_cap_mb));
    index_buckets();
    bool const had_accum = !accum_.empty();
    storage_.clear();
    accum_.clear();
    for (auto const& b : buckets_) {
      std::size_t elements = b.elements;
      if constexpr (sharded) elements = Sharded::padded_elements(b.elements, s.world_size());
      storage_.push_back(backend::allocate(s.devices[0], elements * size_of(b.dtype)));
    }
    if constexpr (sharded) static_cast<Sharded&>(*this).on_plan(s);
    // A rebuild (after a synchronised step: nothing is accumulated) lays the no_sync storage out
    // anew at once when it was in use, so the steps after the rebuild allocate nothing.
    if (had_accum) allocate_accum(s);
  }

  static std::size_t mib(double m) { return static_cast<std::size_t>(std::llround(m * 1024.0 * 1024.0)); }

  // gradient_as_bucket_view: the buckets follow the gradients' memory (core/bucket_views.hpp).
  template <class Set>
  void plan_views(Set& s) {
    auto const& grads = s.grads[0];
    detail::require(s.opts.bucket_cap_mb > 0 && s.opts.first_bucket_cap_mb > 0,
                    "DDP: expected bucket_cap_mb and first_bucket_cap_mb > 0, found " +
                        std::to_string(s.opts.bucket_cap_mb) + " and " + std::to_string(s.opts.first_bucket_cap_mb));
    counts_.assign(grads.size(), 0);
    for (std::size_t i = 0; i < grads.size(); ++i) counts_[i] = grads[i].size();
    auto plan = detail::plan_bucket_views(grads, mib(s.opts.first_bucket_cap_mb), mib(s.opts.bucket_cap_mb), s.rank());
    buckets_ = std::move(plan.buckets);
    base_slot_ = std::move(plan.base_slot);
    plan_error_ = std::move(plan.error);  // reported on every rank by verify_plan
    index_buckets();
    storage_.clear();
    accum_.clear();
  }

  // The bucket's memory: a view of the gradients, from its lowest one.
  template <class Set>
  tensor_ref bucket_ref(Set& s, std::size_t b) const {
    auto const& spec = buckets_[b];
    if (!view_) return tensor_ref(storage_[b].get(), spec.elements, spec.dtype, s.devices[0]);
    if (spec.elements == 0) return tensor_ref(nullptr, 0, spec.dtype);
    tensor_ref const lowest = s.grads[0][spec.params[base_slot_[b]]];
    return tensor_ref(lowest.data(), spec.elements, spec.dtype, lowest.device());
  }

  template <class Set>
  void check_views(Set& s) const {
    detail::check_bucket_views(s.grads[0], buckets_, base_slot_, s.rank());
  }

  // Every rank must have made the same plan (the same collectives follow from it): compare a
  // signature with rank 0's. The same error is raised on every rank.
  template <class Set>
  void verify_plan(Set& s) const {
    std::uint64_t h = 1469598103934665603ull;
    auto const mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (auto const& b : buckets_) {
      mix(static_cast<std::uint64_t>(b.dtype));
      mix(b.elements);
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        mix(b.params[k]);
        mix(b.offsets[k]);
      }
    }
    std::vector<std::int64_t> mine{view_ ? 1 : 0, static_cast<std::int64_t>(buckets_.size()),
                                   static_cast<std::int64_t>(h), plan_error_.empty() ? 0 : 1};
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(s.world_size()));
    s.group.all_gather(view(all), view(mine)).wait();
    auto const at = [&](int rank, std::size_t k) { return all[static_cast<std::size_t>(rank) * mine.size() + k]; };
    detail::require(plan_error_.empty(), plan_error_);
    for (int r = 0; r < s.world_size(); ++r)
      detail::require(at(r, 3) == 0, "DDP: rank " + std::to_string(r) + " could not plan its gradient buckets (its "
                                     "own error says why); expected every rank to plan the same buckets");
    for (int r = 1; r < s.world_size(); ++r) {
      auto const flag = [](std::int64_t v) { return v != 0 ? std::string("true") : std::string("false"); };
      detail::require(at(r, 0) == at(0, 0), "DDP: rank " + std::to_string(r) + " has gradient_as_bucket_view = " +
                                                flag(at(r, 0)) + ", rank 0 has " + flag(at(0, 0)) +
                                                "; expected every rank to pass the same options");
      detail::require(at(r, 1) == at(0, 1) && at(r, 2) == at(0, 2),
                      "DDP: rank " + std::to_string(r) + " planned " + std::to_string(at(r, 1)) +
                          " gradient buckets, rank 0 planned " + std::to_string(at(0, 1)) +
                          (at(r, 1) == at(0, 1) ? " too, but with different contents" : "") +
                          "; expected the same buckets on every rank" +
                          (view_ ? ": with gradient_as_bucket_view the buckets follow each rank's gradient memory, "
                                   "so every rank must lay out its gradients the same way (e.g. one flat buffer "
                                   "in parameter order)"
                                 : ""));
    }
  }

  void index_buckets() {
    bucket_of_.assign(counts_.size(), 0);
    slot_of_.assign(counts_.size(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      for (std::size_t k = 0; k < buckets_[b].params.size(); ++k) {
        bucket_of_[buckets_[b].params[k]] = b;
        slot_of_[buckets_[b].params[k]] = k;
      }
    }
    pending_.assign(buckets_.size(), 0);
    works_.assign(buckets_.size(), work{});
  }

  // Slot `slot` of bucket memory `m` (on `where`, the replica's device).
  static tensor_ref view_in(std::shared_ptr<std::byte> const& m, bucket_spec const& b, std::size_t slot,
                            std::size_t count, device where) {
    return tensor_ref(m.get() + b.offsets[slot] * size_of(b.dtype), count, b.dtype, where);
  }

  // Gradient i is final for this step: stage it in its bucket (or accumulate it under no_sync).
  template <class Set>
  void mark(Set& s, std::size_t i, bool unused) {
    using ops = typename Set::backend_type::immediate;
    ready_[i] = true;
    seen_order_.push_back(i);
    std::size_t const b = bucket_of_[i];
    auto const& spec = buckets_[b];
    tensor_ref const grad = s.grads[0][i];
    double const n = static_cast<double>(s.batch);
    if (!s.sync) {
      if (accum_.size() != buckets_.size()) allocate_accum(s);
      tensor_ref const acc = view_in(accum_[b], spec, slot_of_[i], counts_[i], s.devices[0]);
      if (first_accumulation_) ops::zero(acc);
      if (!unused) ops::add_scaled(acc, grad, n);
    } else if (view_ || (coalesce_ && flushing_ && staged_[b] == 0)) {  // the gradient is its own slot: in place
      if constexpr (sharded) static_cast<Sharded&>(*this).before_stage(b, unused);
      if (accumulated_ == 0) {
        if (unused) ops::zero(grad);
      } else {  // the same operations, in the same order, as below: the same bits
        tensor_ref const acc = view_in(accum_[b], spec, slot_of_[i], counts_[i], s.devices[0]);
        if (!unused) ops::add_scaled(acc, grad, n);
        ops::copy(grad, acc);
        ops::scale(grad, 1.0 / (static_cast<double>(accumulated_) + n));
      }
      weigh<ops>(grad, s.join.scale);
      if (--pending_[b] == 0) launch_ready(s);
    } else {
      if constexpr (sharded) static_cast<Sharded&>(*this).before_stage(b, unused);
      staged_[b] = 1;
      tensor_ref const dst = view_in(storage_[b], spec, slot_of_[i], counts_[i], s.devices[0]);
      if (accumulated_ == 0) {
        if (unused) ops::zero(dst);
        else ops::copy(dst, grad);
      } else {  // the weighted mean of the accumulated steps and this one
        tensor_ref const acc = view_in(accum_[b], spec, slot_of_[i], counts_[i], s.devices[0]);
        ops::copy(dst, acc);
        if (!unused) ops::add_scaled(dst, grad, n);
        ops::scale(dst, 1.0 / (static_cast<double>(accumulated_) + n));
      }
      weigh<ops>(dst, s.join.scale);
      if (--pending_[b] == 0) launch_ready(s);
    }
  }

  // This rank's weight in the average (policy/join.hpp): 1 leaves the bits as they are, 0 makes
  // the contribution zeros (a joined rank), anything else scales it (sample weighting).
  template <class Ops>
  static void weigh(tensor_ref t, double scale) {
    if (scale == 1.0) return;
    if (scale == 0.0) Ops::zero(t);
    else Ops::scale(t, scale);
  }

  template <class Set>
  void allocate_accum(Set& s) {
    using backend = typename Set::backend_type;
    accum_.clear();
    for (auto const& b : buckets_) accum_.push_back(backend::allocate(s.devices[0], b.elements * size_of(b.dtype)));
  }

  template <class Set>
  void launch_ready(Set& s) {
    while (next_bucket_ < buckets_.size() && pending_[next_bucket_] == 0) {
      tensor_ref const whole = bucket_ref(s, next_bucket_);
      bool const listed = coalesce_ && staged_[next_bucket_] == 0;
      if constexpr (sharded)
        works_[next_bucket_] = listed ? static_cast<Sharded&>(*this).launch_list(s, next_bucket_, lists_[next_bucket_])
                                      : static_cast<Sharded&>(*this).launch_bucket(s, next_bucket_, whole);
      else if (listed)
        works_[next_bucket_] = lists_[next_bucket_].empty()
                                   ? work{}
                                   : s.group.all_reduce_coalesced(lists_[next_bucket_], reduce_op::avg);
      else if (hook_.active())
        works_[next_bucket_] = hook_.launch(s.group, next_bucket_, whole, buckets_[next_bucket_], counts_);
      else
        works_[next_bucket_] = ToRoot ? s.group.reduce(whole, 0, reduce_op::avg) : s.group.all_reduce(whole, reduce_op::avg);
      ++next_bucket_;
    }
  }

  // Runs on the replica's stream after the step function: flush, wait, write back, rebuild once.
  template <class Set>
  void finalize(Set& s) {
    std::size_t const n = ready_.size();
    // The buckets flushed below are waited for at once (drain): they need not wake the group's
    // communication thread (a hook may wait for its own collectives inside, so not with one).
    bool const held = s.sync && !hook_.active();
    if (held) s.group.hold();
    try {
      flush(s, n);
    } catch (...) {
      if (held) s.group.release();  // the step fails: what was issued runs as it would have
      throw;
    }
    if (!s.sync) return;
    finish(s, n);
  }

  // finalize's first half: every gradient not marked yet is staged and its bucket issued.
  template <class Set>
  void flush(Set& s, std::size_t n) {
    flushing_ = true;  // the step function has returned: gradients may be reduced in place
    // A sharded reduction leaves the model's gradients as the step function computed them: it
    // reads them in place only where it has nothing to write into them (no accumulated steps, no
    // weight, no unused parameter to zero).
    if constexpr (sharded)
      if (used_hook_ || accumulated_ != 0 || s.join.scale != 1.0 || s.batch == 0) coalesce_ = false;
    if (used_hook_) {
      unused_.clear();
      for (std::size_t i = 0; i < n; ++i)
        if (!ready_[i]) unused_.push_back(i);
      if (!unused_.empty() && !s.opts.find_unused_parameters)
        throw invalid_argument("dparallel: DDP on rank " + std::to_string(s.group.rank()) +
                               ": the step called grad_ready() but never for parameter(s) " +
                               detail::parameter_list(*s.models[0], unused_) +
                               "; expected every parameter to be marked ready (a parameter not used in this "
                               "step?): call grad_ready for it or set options::find_unused_parameters = true");
      for (std::size_t i : unused_) mark(s, i, true);
    } else {
      // Backward order; a step without samples (a joined rank's, policy/join.hpp) has no gradients.
      for (std::size_t k = n; k-- > 0;) mark(s, k, s.batch == 0);
    }
    flushing_ = false;
    if (!s.sync) {
      accumulated_ += s.batch;
      first_accumulation_ = false;
    }
  }

  // finalize's second half, after a synchronised flush: wait, write back, rebuild once.
  template <class Set>
  void finish(Set& s, std::size_t n) {
    using ops = typename Set::backend_type::immediate;
    accumulated_ = 0;
    // One blocking wait for every bucket: drain() (the host communicator runs the collectives its
    // thread has not started on this thread, so no hand-off either); the waits in order (the
    // first failure is the one reported) then return at once instead of waking this thread once
    // per bucket.
    s.group.drain();
    for (auto const& w : works_) w.wait();
    if (hook_.active()) {  // the hooks' continuations, in launch order on every rank
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        tensor_ref const whole = bucket_ref(s, b);
        tensor_ref const r = hook_.result(b, whole, s.group.rank());
        if (r.data() != whole.data()) ops::copy(whole, r);
      }
    }
    bool keep = false;  // a sharded reduction keeps its result in the shards
    if constexpr (sharded) keep = static_cast<Sharded const&>(*this).scattering();
    if (!view_ && (!ToRoot || s.group.rank() == 0) && !keep) {
      for (std::size_t i = 0; i < n; ++i) {
        if (coalesce_ && staged_[bucket_of_[i]] == 0) continue;  // reduced in place
        auto const& spec = buckets_[bucket_of_[i]];
        ops::copy(s.grads[0][i], view_in(storage_[bucket_of_[i]], spec, slot_of_[i], counts_[i], s.devices[0]));
      }
    }
    if (!rebuilt_ && !view_) {  // view buckets follow the memory, not the ready order
      rebuilt_ = true;
      // Rank 0's observed order decides for everyone (ranks may observe different orders).
      std::vector<std::int64_t> order(seen_order_.begin(), seen_order_.end());
      try {
        s.group.broadcast(view(order), 0).wait();
      } catch (...) {
        s.group.drain();  // `order` must outlive the collective
        throw;
      }
      std::vector<std::size_t> o(order.begin(), order.end());
      plan(s, o);
    }
    if constexpr (sharded) static_cast<Sharded&>(*this).reduced(s);
  }

  std::vector<bucket_spec> buckets_;
  std::vector<std::size_t> counts_, bucket_of_, slot_of_, pending_, seen_order_;
  std::vector<std::size_t> base_slot_;  // view mode: the slot of each bucket's lowest gradient
  std::vector<std::size_t> unused_;     // finalize: the parameters not marked ready this step
  std::vector<bool> ready_;
  std::vector<std::shared_ptr<std::byte>> storage_, accum_;  // from Backend::allocate
  std::vector<work> works_;
  bool coalesce_ = false;   // this step: buckets not staged are reduced as lists of gradients
  bool flushing_ = false;   // inside flush(): the step function has returned
  std::vector<char> staged_;                    // per bucket: a gradient was copied into its storage
  std::vector<std::vector<tensor_ref>> lists_;  // per bucket: its gradients (coalesce_), in slot order
  detail::hook_slot hook_;  // register_comm_hook's hook, if any
  std::size_t next_bucket_ = 0;
  std::size_t accumulated_ = 0;  // samples accumulated under no_sync since the last synced step
  bool first_accumulation_ = true;
  bool used_hook_ = false;
  bool rebuilt_ = false;
  bool view_ = false;
  bool bound_ = false;  // the model's gradients were laid out here (detail::bind_replica_gradients)
  std::string plan_error_;  // view mode: why this rank's gradients cannot be bucketed (raised after the check)
};

using bucketed_all_reduce = bucketed_reduce<false>;
using bucketed_reduce_to_root = bucketed_reduce<true>;

}  // namespace policy
DPARALLEL_NAMESPACE_END

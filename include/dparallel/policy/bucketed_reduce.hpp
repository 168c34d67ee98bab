#pragma once
// DDP's reducer: gradients copied into buckets as they become ready, each full bucket reduced
// across the process group while backward goes on, results written back when the step ends.
// Reading order: the hooks (begin_step, grad_ready, finish), then the step top to bottom
// (stage, launch_ready, after_step_function, stage_the_rest, wait_and_write_back), then each
// route's staging. The buckets themselves (the plan, each parameter's locator, each bucket's
// memory and progress, the route enum) and the plan check are in policy/detail/bucket_layout.hpp.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/bucket_views.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/profile.hpp>
#include <dparallel/core/gradient_memory.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/comm_hook.hpp>
#include <dparallel/policy/detail/bucket_layout.hpp>

#include <algorithm>
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
///   ranks). Buckets still pending when the step function returns are staged and started then.
/// - The result is averaged over the world (ToRoot: reduced onto rank 0 only; the other ranks keep
///   their local gradients). Each rank's contribution is first multiplied by `s.join.scale`
///   (policy_set_join: uneven inputs and sample weighting; exactly 1 otherwise).
/// - Under no_sync, gradients are accumulated locally (weighted by each step's batch size); the
///   next synchronised step reduces the weighted mean of everything accumulated.
/// - With options::gradient_as_bucket_view the buckets are views of the gradients' own memory:
///   nothing is allocated or copied for them, each bucket is all-reduced in place (see
///   detail::bucket_layout::plan_views). Every rank's plan is checked against rank 0's at
///   construction (a signature all-gathered), so ranks that would issue different collectives
///   fail there, every one of them, with an error that says why.
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
  using route = detail::bucket_route;

 public:
  /// The current bucket plan, in launch order.
  [[nodiscard]] std::vector<bucket_spec> const& buckets() const noexcept { return layout_.plan; }
  /// Whether the buckets are views of the gradients (options::gradient_as_bucket_view).
  [[nodiscard]] bool bucket_view() const noexcept { return layout_.views; }
  /// Bytes of bucket storage this reducer holds (0 with gradient_as_bucket_view); the storage
  /// for no_sync accumulation, made the first time it is needed, is not counted.
  [[nodiscard]] std::size_t bucket_bytes() const noexcept {
    if (layout_.views) return 0;
    std::size_t n = 0;
    for (auto const& b : layout_.plan) n += b.elements * size_of(b.dtype);
    return n;
  }

  /// Reduces each bucket with `hook` (and its `state`) instead of the group's average, from the
  /// next step on; see policy/comm_hook.hpp. Every rank must register the same kind of hook.
  template <class State, class Hook>
    requires(!ToRoot && !sharded && comm_hook<Hook, State>)
  void register_comm_hook(State state, Hook hook) {
    comm_hook_.set(std::move(state), std::move(hook));
  }
  /// Whether DDP laid out the model's gradients (gradient_as_bucket_view with a model that has
  /// bind_gradients, core/gradient_memory.hpp): they then lie in memory from the process group.
  [[nodiscard]] bool gradients_bound() const noexcept { return gradients_bound_; }

  /// Whether a communication hook is registered.
  [[nodiscard]] bool has_comm_hook() const noexcept { return comm_hook_.active(); }

  /// Plans the buckets and checks that every rank planned the same.
  template <class Set>
  void on_construct(Set& s) {
    detail::require(s.group.valid(), "bucketed reduce: expected a process group (use the DDP constructor)");
    if constexpr (ToRoot || sharded)
      detail::require(!s.opts.uneven_inputs && s.opts.average == average_mode::ranks,
                      "DDP: options::uneven_inputs and average_mode::samples work with the all-reduce reducer "
                      "(dparallel::ddp), found them with a reduce-to-root or sharded one; leave them off there");
    if (s.opts.gradient_as_bucket_view) {
      // A model with bind_gradients moves its gradients into memory from the process group first
      // (core/gradient_memory.hpp); the buckets then follow them where they lie.
      std::string bind_error = detail::bind_replica_gradients(s, gradients_bound_);
      layout_.plan_views(s.grads[0], s.opts, s.rank());
      if (!bind_error.empty()) layout_.error = std::move(bind_error);  // raised on every rank by the check
    } else {
      plan(s, reverse_order(s.params[0].size()));
    }
    detail::verify_bucket_plan(s.group, layout_.plan, layout_.views, layout_.error);
  }

  /// Prepares this step's buckets and chooses its route. See Note [Steady-state allocations].
  template <class Set>
  void begin_step(Set& s) {
    std::size_t const n = s.params[0].size();
    if (n != layout_.counts.size())
      throw invalid_argument("dparallel: DDP: the model has " + std::to_string(n) + " parameters now, expected the " +
                             std::to_string(layout_.counts.size()) + " it had when the wrapper was built");
    if (layout_.views)
      detail::check_bucket_views(s.grads[0], layout_.plan, layout_.base_slot, s.rank(),
                                 [&s](std::size_t i) { return detail::parameter_label(*s.models[0], i); });
    marked_.assign(n, false);
    ready_order_.clear();
    grad_ready_called_ = false;
    step_function_returned_ = false;
    next_bucket_ = 0;
    route_ = choose_route(s);
    for (std::size_t b = 0; b < layout_.buckets.size(); ++b) {
      detail::reducer_bucket& bucket = layout_.buckets[b];
      bucket.pending = layout_.plan[b].params.size();
      bucket.copied = false;
      bucket.launched = work{};
      if (route_ != route::coalesced) continue;
      bucket.list.clear();  // read by its collective: see Note [Step scratch lifetime]
      for (std::size_t i : layout_.plan[b].params)
        if (s.grads[0][i].size() != 0) bucket.list.push_back(s.grads[0][i]);
      if constexpr (sharded) static_cast<Sharded&>(*this).pad_list(b, bucket.list);
    }
  }

  /// Gradient `i` is final: stages it in its bucket (see stage) and starts, in bucket order, every
  /// bucket that is complete.
  template <class Set>
  void grad_ready(Set& s, int, std::size_t i) {
    if (i >= marked_.size())
      throw invalid_argument("dparallel: grad_ready: expected a parameter index below " +
                             std::to_string(marked_.size()) + ", found " + std::to_string(i));
    if (marked_[i])
      throw invalid_argument("dparallel: grad_ready: parameter " + detail::parameter_label(*s.models[0], i) +
                             " was marked ready twice in one step (rank " + std::to_string(s.group.rank()) + ")");
    grad_ready_called_ = true;
    if constexpr (requires { s.trace; })
      if (s.trace != nullptr) s.trace->instant("grad ready", "compute", 1, "\"param\":" + std::to_string(i));
    stage(s, i, false);
  }

  /// Enqueues, after the step function, the reduction of the buckets still pending and the wait
  /// for all of them; the reduced gradients end in the model's gradients.
  template <class Set>
  void finish(Set& s) {
    s.streams[0]->enqueue([this, &s] { after_step_function(s); });
  }

 private:
  // ---- The step, top to bottom ------------------------------------------------------------------

  // No_sync accumulates; bucket views are reduced where they lie; copying buckets on an engine
  // that reduces a list of tensors in place (thread ranks, shared memory) go as lists of their
  // gradients: the bits of the copy's all-reduce without the copies into storage and back (a
  // comm hook wants one bucket array, so not with one). A sharded reduction does the same once it
  // reduce-scatters (its list ends with the bucket's padding).
  template <class Set>
  route choose_route(Set& s) const {
    if (!s.sync) return route::accumulate;
    if (layout_.views) return route::in_place;
    bool lists = false;
    if constexpr (sharded) lists = static_cast<Sharded const&>(*this).scattering();
    else lists = !ToRoot && !comm_hook_.active();
    return lists && s.group.coalesces_in_place() ? route::coalesced : route::copy;
  }

  // Gradient i is final for this step: stage it by the step's route, and launch its bucket when
  // it was the bucket's last.
  template <class Set>
  void stage(Set& s, std::size_t i, bool unused) {
    marked_[i] = true;
    ready_order_.push_back(i);
    if (route_ == route::accumulate) return accumulate(s, i, unused);
    std::size_t const b = layout_.locator[i].bucket;
    if constexpr (sharded) static_cast<Sharded&>(*this).before_stage(b, unused);
    if (in_place(layout_.buckets[b])) stage_in_place(s, i, unused);
    else stage_copy(s, i, unused);
    if (--layout_.buckets[b].pending == 0) launch_ready(s);
  }

  // Whether a gradient is staged where it lies: bucket views, and on the coalesced route once
  // the step function has returned, into a bucket none of whose gradients was copied.
  [[nodiscard]] bool in_place(detail::reducer_bucket const& b) const noexcept {
    return route_ == route::in_place || (route_ == route::coalesced && step_function_returned_ && !b.copied);
  }
  // Whether a bucket is reduced as the list of its gradients.
  [[nodiscard]] bool as_list(detail::reducer_bucket const& b) const noexcept {
    return route_ == route::coalesced && !b.copied;
  }

  // Starts every complete bucket in order (buckets start strictly in order, so the collectives
  // match across ranks).
  template <class Set>
  void launch_ready(Set& s) {
    auto& buckets = layout_.buckets;
    while (next_bucket_ < buckets.size() && buckets[next_bucket_].pending == 0) {
      if constexpr (requires { s.trace; })
        if (s.trace != nullptr) {
          launched_at_.resize(buckets.size());
          launched_at_[next_bucket_] = profile_clock::now();
        }
      buckets[next_bucket_].launched = launch(s, next_bucket_);
      ++next_bucket_;
    }
  }

  template <class Set>
  work launch(Set& s, std::size_t b) {
    detail::reducer_bucket const& bucket = layout_.buckets[b];
    tensor_ref const whole = bucket_ref(s, b);
    if constexpr (sharded) {
      auto& derived = static_cast<Sharded&>(*this);
      return as_list(bucket) ? derived.launch_list(s, b, bucket.list) : derived.launch_bucket(s, b, whole);
    } else {
      if (as_list(bucket))
        return bucket.list.empty() ? work{} : s.group.all_reduce_coalesced(bucket.list, reduce_op::avg);
      if (comm_hook_.active()) return comm_hook_.launch(s.group, b, whole, layout_.plan[b], layout_.counts);
      return ToRoot ? s.group.reduce(whole, 0, reduce_op::avg) : s.group.all_reduce(whole, reduce_op::avg);
    }
  }

  // Runs on the replica's stream after the step function: stage the rest, wait, write back,
  // rebuild once.
  template <class Set>
  void after_step_function(Set& s) {
    // The buckets launched below are waited for at once (drain): they need not wake the group's
    // communication thread (a hook may wait for its own collectives inside, so not with one).
    bool const held = s.sync && !comm_hook_.active();
    if (held) s.group.hold();
    try {
      stage_the_rest(s);
    } catch (...) {
      if (held) s.group.release();  // the step fails: what was issued runs as it would have
      throw;
    }
    if (!s.sync) return;
    wait_and_write_back(s);
  }

  // Every gradient not marked yet is staged (its bucket launched).
  template <class Set>
  void stage_the_rest(Set& s) {
    std::size_t const n = marked_.size();
    step_function_returned_ = true;  // gradients may now be reduced in place
    // A sharded reduction leaves the model's gradients as the step function computed them: it
    // reads them in place only where it has nothing to write into them (no accumulated steps, no
    // weight, no unused parameter to zero).
    if constexpr (sharded)
      if (route_ == route::coalesced &&
          (grad_ready_called_ || accumulated_ != 0 || s.join.scale != 1.0 || s.batch == 0))
        route_ = route::copy;
    if (grad_ready_called_) {
      unused_.clear();
      for (std::size_t i = 0; i < n; ++i)
        if (!marked_[i]) unused_.push_back(i);
      if (!unused_.empty() && !s.opts.find_unused_parameters)
        throw invalid_argument("dparallel: DDP on rank " + std::to_string(s.group.rank()) +
                               ": the step called grad_ready() but never for parameter(s) " +
                               detail::parameter_list(*s.models[0], unused_) +
                               "; expected every parameter to be marked ready (a parameter not used in this "
                               "step?): call grad_ready for it or set options::find_unused_parameters = true");
      for (std::size_t i : unused_) stage(s, i, true);
    } else {
      // Backward order; a step without samples (a joined rank's, policy/join.hpp) has no gradients.
      for (std::size_t k = n; k-- > 0;) stage(s, k, s.batch == 0);
    }
    step_function_returned_ = false;
    if (!s.sync) accumulated_ += s.batch;
  }

  // The step's buckets on the timeline, from launch until the step saw them complete (now).
  template <class Set>
  void trace_buckets(Set& s) {
    auto const now = profile_clock::now();
    for (std::size_t b = 0; b < layout_.buckets.size() && b < launched_at_.size(); ++b)
      s.trace->span("bucket", "comm", 1000, launched_at_[b], now,
                    "\"bucket\":" + std::to_string(b) + ",\"bytes\":" + std::to_string(bucket_ref(s, b).size_bytes()) +
                        ",\"op\":\"" + (sharded ? "reduce_scatter" : ToRoot ? "reduce" : "all_reduce") + "\"");
  }

  // After a synchronised step's staging: wait for every bucket, write the results back, rebuild
  // the plan once in the order the gradients became ready.
  template <class Set>
  void wait_and_write_back(Set& s) {
    using ops = typename Set::backend_type::immediate;
    accumulated_ = 0;
    // One blocking wait for every bucket: drain() (the host communicator runs the collectives its
    // thread has not started on this thread, so no hand-off either); the waits in order (the
    // first failure is the one reported) then return at once instead of waking this thread once
    // per bucket.
    s.group.drain();
    for (auto const& b : layout_.buckets) b.launched.wait();
    if constexpr (requires { s.trace; })
      if (s.trace != nullptr) trace_buckets(s);
    if (comm_hook_.active()) {  // the hooks' continuations, in launch order on every rank
      for (std::size_t b = 0; b < layout_.buckets.size(); ++b) {
        tensor_ref const whole = bucket_ref(s, b);
        tensor_ref const r = comm_hook_.result(b, whole, s.group.rank());
        if (r.data() != whole.data()) ops::copy(whole, r);
      }
    }
    bool keep = false;  // a sharded reduction keeps its result in the shards
    if constexpr (sharded) keep = static_cast<Sharded const&>(*this).scattering();
    if (!layout_.views && (!ToRoot || s.group.rank() == 0) && !keep) {
      for (std::size_t i = 0; i < marked_.size(); ++i) {
        detail::reducer_bucket const& bucket = layout_.buckets[layout_.locator[i].bucket];
        if (as_list(bucket)) continue;  // reduced in place
        ops::copy(s.grads[0][i], slot(s, bucket.storage, i));
      }
    }
    if (!rebuilt_ && !layout_.views) {  // view buckets follow the memory, not the ready order
      rebuilt_ = true;
      // Rank 0's observed order decides for everyone (ranks may observe different orders).
      std::vector<std::int64_t> order(ready_order_.begin(), ready_order_.end());
      try {
        s.group.broadcast(view(order), 0).wait();
      } catch (...) {
        s.group.drain();  // `order` must outlive the collective
        throw;
      }
      plan(s, std::vector<std::size_t>(order.begin(), order.end()));
    }
    if constexpr (sharded) static_cast<Sharded&>(*this).reduced(s);
  }

  // ---- Staging, per route -----------------------------------------------------------------------
  // Every synchronised route stages the same operations in the same order (the weighted mean of
  // the accumulated steps and this one, then this rank's weight), so every route gives the same bits.

  // no_sync: acc += batch * grad (acc zeroed by the first accumulating step).
  template <class Set>
  void accumulate(Set& s, std::size_t i, bool unused) {
    using ops = typename Set::backend_type::immediate;
    if (!layout_.has_accum) layout_.template allocate_accum<typename Set::backend_type>(s.devices[0]);
    tensor_ref const acc = slot(s, layout_.buckets[layout_.locator[i].bucket].accum, i);
    if (accumulated_ == 0) ops::zero(acc);
    if (!unused) ops::add_scaled(acc, s.grads[0][i], static_cast<double>(s.batch));
  }

  // The gradient is its own slot of the bucket.
  template <class Set>
  void stage_in_place(Set& s, std::size_t i, bool unused) {
    using ops = typename Set::backend_type::immediate;
    tensor_ref const grad = s.grads[0][i];
    if (accumulated_ == 0) {
      if (unused) ops::zero(grad);
    } else {
      double const n = static_cast<double>(s.batch);
      tensor_ref const acc = slot(s, layout_.buckets[layout_.locator[i].bucket].accum, i);
      if (!unused) ops::add_scaled(acc, grad, n);
      ops::copy(grad, acc);
      ops::scale(grad, 1.0 / (static_cast<double>(accumulated_) + n));
    }
    weigh<ops>(grad, s.join.scale);
  }

  // The gradient is copied into the bucket's storage.
  template <class Set>
  void stage_copy(Set& s, std::size_t i, bool unused) {
    using ops = typename Set::backend_type::immediate;
    detail::reducer_bucket& bucket = layout_.buckets[layout_.locator[i].bucket];
    bucket.copied = true;
    tensor_ref const dst = slot(s, bucket.storage, i);
    if (accumulated_ == 0) {
      if (unused) ops::zero(dst);
      else ops::copy(dst, s.grads[0][i]);
    } else {
      double const n = static_cast<double>(s.batch);
      ops::copy(dst, slot(s, bucket.accum, i));
      if (!unused) ops::add_scaled(dst, s.grads[0][i], n);
      ops::scale(dst, 1.0 / (static_cast<double>(accumulated_) + n));
    }
    weigh<ops>(dst, s.join.scale);
  }

  // This rank's weight in the average (policy_set_join, policy/join.hpp): 1 leaves the bits as
  // they are, 0 makes the contribution zeros (a joined rank), anything else scales it (sample
  // weighting).
  template <class Ops>
  static void weigh(tensor_ref t, double scale) {
    if (scale == 1.0) return;
    if (scale == 0.0) Ops::zero(t);
    else Ops::scale(t, scale);
  }

  // ---- Planning ---------------------------------------------------------------------------------

  // Copying buckets over the parameters in `order` (a sharded reduction pads each bucket's storage).
  template <class Set>
  void plan(Set& s, std::vector<std::size_t> const& order) {
    using backend = typename Set::backend_type;
    layout_.template plan_copies<backend>(s.params[0], s.opts, order, s.devices[0], [&](std::size_t elements) {
      if constexpr (sharded) return Sharded::padded_elements(elements, s.world_size());
      else return elements;
    });
    if constexpr (sharded) static_cast<Sharded&>(*this).on_plan(s);
  }

  template <class Set>
  tensor_ref bucket_ref(Set& s, std::size_t b) const {
    return layout_.whole(b, s.grads[0], s.devices[0]);
  }
  template <class Set>
  tensor_ref slot(Set& s, std::shared_ptr<std::byte> const& m, std::size_t i) const {
    return layout_.slot(m, i, s.devices[0]);
  }

  detail::bucket_layout layout_;  // the plan, each parameter's place in it, each bucket's memory and progress
  detail::hook_slot comm_hook_;   // register_comm_hook's hook, if any
  bool gradients_bound_ = false;  // the model's gradients were laid out here (bind_replica_gradients)
  bool rebuilt_ = false;          // the plan follows the first step's ready order
  std::size_t accumulated_ = 0;   // samples accumulated under no_sync since the last synced step

  // This step's (refilled in place; see Note [Steady-state allocations]).
  route route_ = route::copy;
  std::vector<bool> marked_;                 // per parameter: staged this step
  std::vector<std::size_t> ready_order_;     // the parameters in the order they were staged
  std::vector<std::size_t> unused_;          // stage_the_rest: the parameters grad_ready never named
  std::size_t next_bucket_ = 0;              // the first bucket not launched
  std::vector<profile_clock::time_point> launched_at_;  // per bucket, when tracing (core/trace.hpp)
  bool grad_ready_called_ = false;           // the step function called grad_ready (else all are staged after it)
  bool step_function_returned_ = false;      // inside stage_the_rest
};

using bucketed_all_reduce = bucketed_reduce<false>;
using bucketed_reduce_to_root = bucketed_reduce<true>;

}  // namespace policy
DPARALLEL_NAMESPACE_END

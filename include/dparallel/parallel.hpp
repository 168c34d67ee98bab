#pragma once
// parallel<Model, Semantics, Backend>: the one composition point. It owns one stream per local
// device and the replicas, and runs each step as scatter -> replicate -> compute -> reduce ->
// gather, each stage being a policy type taken from the Semantics bundle.

#include <dparallel/config.hpp>
#include <dparallel/backend/host/backend.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/batch.hpp>
#include <dparallel/core/contract_check.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/profile.hpp>
#include <dparallel/detail/rank_checks.hpp>
#include <dparallel/core/step_checks.hpp>
#include <dparallel/core/step_context.hpp>
#include <dparallel/core/trace.hpp>
#include <dparallel/policy/detail/replica_set.hpp>
#include <dparallel/detail/step_plan.hpp>
#include <dparallel/detail/typed_scratch.hpp>
#include <dparallel/detail/wrapper_checks.hpp>
#include <dparallel/policy/join.hpp>
#include <dparallel/policy/replica_set.hpp>
#include <dparallel/semantics.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// DataParallel or DistributedDataParallel around a model of the user's type, composed from the policies of
/// `Semantics` (see docs/design.md). Use the aliases data_parallel and distributed_data_parallel, or name a
/// bundle of your own.
template <class Model, class Semantics = dp, class Backend = host::backend>
class parallel {
  static_assert(check_model<Model>());
  static_assert(policy_set<replica_set<Model, Backend>>, "dparallel: replica_set lost a member of policy_set");
  static_assert(semantics<Semantics>,
                "dparallel: Semantics must name member types scatter, replicate, reduce and gather that satisfy "
                "scatter_policy, replicate_policy, reduce_policy and gather_policy (derive from dparallel::dp)");

 public:
  /// The wrapped model type.
  using model_type = Model;
  /// The bundle of policies.
  using semantics_type = Semantics;
  /// The backend (host::backend, cuda::backend).
  using backend_type = Backend;
  /// The bundle's scatter policy.
  using scatter_type = typename Semantics::scatter;
  /// The bundle's replicate policy.
  using replicate_type = typename Semantics::replicate;
  /// The bundle's reduce policy.
  using reduce_type = typename Semantics::reduce;
  /// The bundle's gather policy.
  using gather_type = typename Semantics::gather;

  /// Wraps `model` (by reference: it must outlive the wrapper) over `devices`; devices[0] holds
  /// the master model. Replicas for the other devices are made once, here.
  explicit parallel(Model& model, std::vector<device> devices = Backend::all_devices(), options opts = {})
    requires(!is_distributed_v<Semantics>)
  {
    static_assert(replicable_model<Model>,
                  "dparallel: DataParallel makes a replica per device: give the model a copy constructor, a member "
                  "`M make_replica(device) const`, or model_traits<M>::make_replica(M const&, device)");
    std::size_t const out_slot = detail::check_dp_devices<Backend>(devices, opts);
    verify_model(model, "parallel: the model");
    for (auto const& t : parameter_refs(model)) Backend::check_view(t, devices[0], "parallel: the model's parameter");

    rs_.master = &model;
    rs_.devices = std::move(devices);
    rs_.opts = std::move(opts);
    contracts_.enable(detail::contract_check_requested(rs_.opts.check_contracts));
    rs_.output_slot = out_slot;
    rs_.models.push_back(&model);
    for (std::size_t i = 1; i < rs_.size(); ++i) {
      rs_.owned.push_back(std::make_unique<Model>(make_replica(std::as_const(model), rs_.devices[i])));
      rs_.models.push_back(rs_.owned.back().get());
      detail::check_replica(rs_, i);
    }
    for (auto const& d : rs_.devices) rs_.streams.push_back(std::make_unique<typename Backend::stream_type>(d));
    rs_.compute_done.resize(rs_.size());
    rs_.refresh_views();
    replicate_.on_construct(rs_);
    reduce_.on_construct(rs_);
    detail::warn_if_devices_differ<Backend>(rs_.devices, rs_.opts);
    trace_.open(trace_directory(rs_.opts.trace), 0, 1);
    rs_.trace = trace_.log();
  }

  /// DDP: wraps this rank's `model` (by reference) in the process group `group`. Verifies that
  /// every rank has the same parameters and buffers and broadcasts rank 0's values; every rank
  /// must construct its wrapper (it is a collective).
  parallel(Model& model, process_group group, options opts = {})
    requires(is_distributed_v<Semantics>)
  {
    detail::require(group.valid(), "parallel: expected a process group, found an empty process_group");
    verify_model(model, "DDP on rank " + std::to_string(group.rank()) + ": the model");
    device const dev = detail::ddp_local_device<Backend>(group, opts);
    for (auto const& t : parameter_refs(model)) Backend::check_view(t, dev, "DDP: the model's parameter");
    auto const label = [&model](std::size_t i) { return detail::parameter_label(model, i); };
    registration_ = detail::parameter_registry::instance().add(parameter_refs(model), group.rank(), label);
    rs_.master = &model;
    rs_.devices = {dev};
    rs_.opts = std::move(opts);
    contracts_.enable(detail::contract_check_requested(rs_.opts.check_contracts));
    rs_.group = std::move(group);
    rs_.models.push_back(&model);
    rs_.streams.push_back(std::make_unique<typename Backend::stream_type>(dev));
    rs_.compute_done.resize(1);
    rs_.refresh_views();
    agreement_.enable(rs_);
    detail::as_ddp_constructor(rs_.rank(), [&] {
      replicate_.on_construct(rs_);
      if (rs_.world_size() > 1) detail::verify_shapes_across_ranks(rs_.group, detail::parameter_shapes_of(model), label);
      reduce_.on_construct(rs_);
    });
    trace_.open(trace_directory(rs_.opts.trace), rs_.rank(), rs_.world_size());  // after the collectives: aligned
    rs_.trace = trace_.log();
  }

  /// DDP: the same from anything that holds a process group as `group()`, e.g. the rank_context
  /// that spawn() passes: `parallel<M, ddp> w(m, rank)`.
  template <class Rank>
    requires(is_distributed_v<Semantics> && !std::is_convertible_v<Rank const&, process_group> &&
             requires(Rank const& r) {
               { r.group() } -> std::convertible_to<process_group const&>;
             })
  parallel(Model& model, Rank const& rank, options opts = {}) : parallel(model, process_group(rank.group()), std::move(opts)) {}

  parallel(parallel const&) = delete;
  parallel& operator=(parallel const&) = delete;
  /// Moves the wrapper; the moved-from wrapper must not be used.
  parallel(parallel&&) noexcept = default;
  /// Moves the wrapper; the moved-from wrapper must not be used.
  parallel& operator=(parallel&&) noexcept = default;
  ~parallel() = default;

  /// The master model: the user's optimizer updates it between steps.
  [[nodiscard]] Model& module() noexcept { return *rs_.master; }
  /// The master model.
  [[nodiscard]] Model const& module() const noexcept { return *rs_.master; }
  /// The model that runs on devices()[i] (replica(0) is module()).
  [[nodiscard]] Model const& replica(std::size_t i) const { return *rs_.models.at(i); }
  /// Mutable access, for policies that let every replica run its own optimizer.
  [[nodiscard]] Model& replica(std::size_t i) { return *rs_.models.at(i); }
  /// The reduce policy object (e.g. to inspect DDP's bucket plan).
  [[nodiscard]] reduce_type const& reducer() const noexcept { return reduce_; }
  /// The reduce policy object, mutable: for objects that work with it between steps (DDP's
  /// register_comm_hook; ZeRO-1's zero_redundancy_optimizer updates and all-gathers through its
  /// buckets).
  [[nodiscard]] reduce_type& reducer() noexcept { return reduce_; }
  /// DDP: this rank's process group.
  [[nodiscard]] process_group const& group() const noexcept { return rs_.group; }
  /// The local devices; devices()[0] holds the master.
  [[nodiscard]] std::vector<device> const& devices() const noexcept { return rs_.devices; }
  /// Where gathered outputs land (options::output_device, default the first device).
  [[nodiscard]] device output_device() const noexcept { return rs_.devices[rs_.output_slot]; }
  /// Shard sizes of the last step, one per device (0 = the device received no shard).
  [[nodiscard]] std::vector<std::size_t> const& last_shard_sizes() const noexcept { return rs_.shard_sizes; }
  /// The scatter policy object (e.g. policy::auto_balance's rates and smoothing).
  [[nodiscard]] scatter_type& scatterer() noexcept { return scatter_; }
  /// The scatter policy object.
  [[nodiscard]] scatter_type const& scatterer() const noexcept { return scatter_; }

  /// Where the time of the last step that succeeded went (see step_profile for the phases). Always
  /// recorded: a few clock reads per step and per device; a step that throws records nothing.
  [[nodiscard]] step_profile const& last_profile() const noexcept { return last_profile_; }
  /// The steps recorded since construction or reset_profile(): profile().mean() is the mean step,
  /// format_profile(profile()) a table of it.
  [[nodiscard]] profile_summary const& profile() const noexcept { return profile_; }
  /// Forgets the recorded steps; profile() starts again.
  void reset_profile() noexcept { profile_.reset(); }
  /// With options::trace or DPARALLEL_TRACE: writes the timeline so far (core/trace.hpp); the
  /// wrapper writes it again when destroyed. Returns the file's path (empty when not tracing).
  std::string flush_trace() { return trace_.flush(), trace_.path(); }
  /// Tells the wrapper how long the training loop waited for the next batch (e.g. a prefetching
  /// loader's last wait). The time noted since the previous step is reported as data_wait of the
  /// next step() (the step that consumes that batch); several calls add up.
  template <class Rep, class Period>
  void note_data_wait(std::chrono::duration<Rep, Period> waited) noexcept {
    data_wait_ += std::chrono::duration_cast<profile_duration>(waited);
  }

  /// RAII scope returned by no_sync().
  class [[nodiscard]] no_sync_scope {
   public:
    /// Turns synchronisation off on `p` until the scope ends.
    explicit no_sync_scope(parallel& p) : p_(&p), previous_(p.rs_.sync) { p.rs_.sync = false; }
    no_sync_scope(no_sync_scope const&) = delete;
    no_sync_scope& operator=(no_sync_scope const&) = delete;
    ~no_sync_scope() { p_->rs_.sync = previous_; }

   private:
    parallel* p_;
    bool previous_;
  };
  /// DDP gradient accumulation: steps inside the scope reduce nothing; their gradients are
  /// accumulated locally (weighted by batch size) and the first step after the scope reduces the
  /// weighted mean of all of them. `{ auto s = ddp.no_sync(); ddp.step(b1, f); } ddp.step(b2, f);`
  /// gives the gradient of one step on b1 and b2 together.
  no_sync_scope no_sync()
    requires(is_distributed_v<Semantics>)
  {
    return no_sync_scope(*this);
  }

  /// Runs one training step: the step function runs once per shard, on that shard's device, as
  /// step_fn(Model& replica, Shard shard, step_context& ctx) or step_fn(Model&, Shard); it must
  /// leave the gradient of the mean loss over its shard in gradients(replica). Returns the
  /// gathered outputs (nothing when step_fn returns void). An exception from any device is
  /// rethrown here as a dparallel::error naming the device; the wrapper stays usable.
  template <class B, class F>
  auto step(B const& batch, F&& step_fn) {
    // Each check stops here when it fails, so that its message is the only error.
    if constexpr (!check_batch<B>()) {
      return;
    } else {
      using shard_type = decltype(slice_batch(batch, 0, 0));
      if constexpr (!detail::check_step_function<std::remove_cvref_t<F>, Model, shard_type>()) {
        return;
      } else {
        return checked_step<shard_type>(batch, step_fn);
      }
    }
  }

  /// DataParallel on host devices: calls f(k, n) for every k < n = devices().size(), call k on
  /// device k's thread (the master's, k = 0, on the calling thread), all at once, and returns when
  /// every call has returned. As with a step's work, a call that its device's thread has not
  /// started when the caller is done with its own runs on the calling thread. An exception from a
  /// call is rethrown as a step's is (a device_error naming the device), after all of them
  /// finished. For work on the master's tensors that splits by elements: optim::optimizer updates
  /// the master this way, device k its stripes (core/stripes.hpp), which are the ones device k
  /// reduced and copies into the replicas.
  /// Not while a step runs (from a step function, or another thread).
  template <class F>
    requires(!is_distributed_v<Semantics> &&
             requires(typename Backend::stream_type& s) {
               s.hold();
               s.synchronize_here();
             })
  void on_each_device(F&& f) {
    struct frame {
      std::remove_reference_t<F>* fn;
      std::size_t n;
    } const fr{&f, rs_.size()};
    sync_guard guard{this};
    rs_.streams[0]->hold();  // its call runs here, in synchronize_streams
    for (std::size_t k = 0; k < fr.n; ++k) rs_.streams[k]->enqueue([at = &fr, k] { (*at->fn)(k, at->n); });
    guard.armed = false;
    detail::synchronize_streams(rs_.streams);
  }

  /// DDP with options::uneven_inputs: this rank's data ran out. Call it once after the rank's
  /// last step (every rank calls it, PyTorch's Join): it takes part in the other ranks' remaining
  /// synchronised steps with zero contributions and returns when every rank has joined, with the
  /// parameters and buffers of the rank that stepped last on every rank. See docs/join.md.
  void join()
    requires(is_distributed_v<Semantics>)
  {
    try {
      detail::run_join(rs_, replicate_, reduce_, join_, [this] { begin_streams(); });
    } catch (std::exception const& e) {
      rs_.group.abort(std::string("rank ") + std::to_string(rs_.rank()) + " failed in join(): " +
                      detail::without_prefix(e.what()));
      throw;
    }
  }

 private:
  template <class shard_type, class B, class F>
  auto checked_step(B const& batch, F& step_fn) {
    using out_type = typename detail::step_result<F, Model, shard_type>::type;

    if constexpr (is_distributed_v<Semantics>) {
      // A failure on one rank must not leave the others waiting: abort the group, naming us.
      try {
        return run_step<out_type, shard_type>(batch, step_fn);
      } catch (std::exception const& e) {
        rs_.group.abort(std::string("rank ") + std::to_string(rs_.rank()) + " failed in step(): " +
                        detail::without_prefix(e.what()));
        throw;
      }
    } else {
      return run_step<out_type, shard_type>(batch, step_fn);
    }
  }

  // One step. In the steady state it allocates nothing through Backend::allocate, and its own
  // lists are members refilled in place (Note [Steady-state allocations], policy/concepts.hpp).
  // Still allocating, per step: each piece of work enqueued on a host::stream (its event's shared
  // state, a std::function whose captures exceed its small buffer, a deque node now and then), the
  // scatter policy's shard sizes and the gathered result (public contracts), messages core helpers
  // build before checking, the model's own parameters()/gradients()/buffers(), and the step function.
  template <class out_type, class shard_type, class B, class F>
  auto run_step(B const& batch, F& step_fn) {
    constexpr bool returns_value = !std::is_void_v<out_type>;
    using slot_type = std::conditional_t<returns_value, std::optional<out_type>, char>;
    profile_duration const waited = std::exchange(data_wait_, profile_duration{});
    auto const entered = profile_clock::now();
    detail::plan_step(scatter_, rs_, batch_size(batch));
    rs_.refresh_views();
    if constexpr (is_distributed_v<Semantics>) agreement_.check(rs_);  // under desync detection: detail/rank_checks.hpp
    started_.resize(rs_.size());
    ended_.resize(rs_.size());
    auto const planned = profile_clock::now();
    // The output slots and the step contexts are members reused step after step; the slots are
    // emptied when the step ends (after the streams drained, whether it returns or throws).
    struct step_scratch {
      std::vector<slot_type> outs;  // per device
      std::vector<std::conditional_t<returns_value, out_type, char>> done;  // handed to the gather policy
    };
    step_scratch* scratch = nullptr;
    if constexpr (returns_value) {
      scratch = &scratch_.get<step_scratch>();
      scratch->outs.resize(rs_.size());
    }
    ctx_.resize(rs_.size());
    struct slots_guard {
      step_scratch* s;
      ~slots_guard() {
        if constexpr (returns_value) {
          for (auto& o : s->outs) o.reset();
          s->done.clear();
        }
      }
    } const empty_slots{scratch};
    // What each device's work reads; the work captures a pointer to it and its device index,
    // which std::function holds without allocating.
    struct frame {
      parallel* self;
      B const* batch;
      F* step_fn;
      step_scratch* scratch;
    } const fr{this, &batch, &step_fn, scratch};
    sync_guard guard{this};
    begin_streams();
    // The master's stream keeps its worker asleep: this thread runs its work in synchronize_streams()
    // below, where it would otherwise only wait (no hand-off, no wake-up on the critical path).
    if constexpr (requires { rs_.streams[0]->hold(); }) rs_.streams[0]->hold();
    if constexpr (is_distributed_v<Semantics>) join_.begin(rs_);  // uneven inputs: policy/join.hpp
    replicate_.before_step(rs_);
    reduce_.begin_step(rs_);
    if (contracts_.on()) contracts_.before_compute(rs_);  // core/contract_check.hpp
    for (std::size_t i = 0; i < rs_.size(); ++i) {
      if (!rs_.active(i)) continue;
      step_context::shard_info info;
      info.device = rs_.devices[i];
      info.replica = static_cast<int>(i);
      info.offset = rs_.shard_offsets[i];
      info.size = rs_.shard_sizes[i];
      info.batch = rs_.batch;
      info.rank = rs_.rank();
      info.world_size = rs_.world_size();
      ctx_[i] = step_context(info, &parallel::ready_trampoline, this);
      rs_.compute_done[i] = detail::enqueue_compute(*rs_.streams[i], [f = &fr, i] {
        parallel& self = *f->self;
        F& fn = *f->step_fn;
        auto shard =
            slice_batch(*f->batch, self.rs_.shard_offsets[i], self.rs_.shard_offsets[i] + self.rs_.shard_sizes[i]);
        if constexpr (!is_distributed_v<Semantics>)  // DataParallel: the shard moves to its device
          shard = detail::place_shard<Backend>(*self.rs_.streams[i], std::move(shard));
        Model& m = *self.rs_.models[i];
        // DataParallel: a replica's gradients start each step at zero (PyTorch's DataParallel makes
        // fresh replicas every step), so a step function that adds into them, after the user zeroed
        // module()'s, adds only this step's gradient.
        if constexpr (!is_distributed_v<Semantics> && requires(tensor_ref t) { Backend::immediate::zero(t); })
          if (i != 0)
            for (tensor_ref const& g : self.rs_.grads[i]) Backend::immediate::zero(g);
        self.started_[i] = profile_clock::now();
        if (self.contracts_.on()) self.contracts_.fill_device(self.rs_, i);
        detail::shard_scope<Model> bound(m, self.ctx_[i]);  // model_traits<Model>::begin_shard / end_shard
        if constexpr (returns_value) {
          auto& out = f->scratch->outs[i];
          if constexpr (detail::step_with_context<F, Model, shard_type>) out.emplace(fn(m, std::move(shard), self.ctx_[i]));
          else out.emplace(fn(m, std::move(shard)));
        } else {
          if constexpr (detail::step_with_context<F, Model, shard_type>) fn(m, std::move(shard), self.ctx_[i]);
          else fn(m, std::move(shard));
        }
        bound.close();
        self.ended_[i] = profile_clock::now();
        if (self.contracts_.on()) self.contracts_.after_step(self.rs_, i);
      });
    }
    reduce_.finish(rs_);
    if constexpr (is_distributed_v<Semantics>) join_.end(rs_);
    guard.armed = false;
    detail::synchronize_streams(rs_.streams);
    auto const drained = profile_clock::now();
    if constexpr (returns_value) {
      auto& done = scratch->done;
      done.clear();
      done.reserve(rs_.size());  // allocates only when the last gather took the storage (arithmetic outputs)
      for (std::size_t i = 0; i < rs_.size(); ++i)
        if (rs_.active(i)) done.push_back(std::move(*scratch->outs[i]));
      auto result = gather_type::gather(std::move(done), rs_);
      record_profile(waited, entered, planned, drained);
      return result;
    } else {
      record_profile(waited, entered, planned, drained);
    }
  }

  // Fills last_profile_ from the step's time points (see step_profile for the phases), adds it to
  // the summary and tells an observing scatter policy.
  void record_profile(profile_duration waited, profile_clock::time_point entered, profile_clock::time_point planned,
                      profile_clock::time_point drained) {
    auto const returned = profile_clock::now();
    auto first = drained, last = planned;
    step_profile& p = last_profile_;
    p.device_compute.assign(rs_.size(), profile_duration{});
    for (std::size_t i = 0; i < rs_.size(); ++i) {
      if (!rs_.active(i)) continue;
      first = std::min(first, started_[i]);
      last = std::max(last, ended_[i]);
      p.device_compute[i] = std::max(profile_duration{}, profile_duration(ended_[i] - started_[i]));
      if (auto gpu = detail::device_time(rs_.compute_done[i])) p.device_compute[i] = *gpu;  // GPU work, not launches
    }
    first = std::clamp(first, planned, drained);
    last = std::clamp(last, first, drained);
    p.data_wait = waited;
    p.scatter = planned - entered;
    p.replicate = first - planned;
    p.compute = last - first;
    p.reduce = drained - last;
    p.gather = returned - drained;
    p.total = returned - entered;
    p.batch = rs_.batch;
    p.rank = rs_.rank();
    p.world_size = rs_.world_size();
    p.devices = rs_.devices;
    p.shard_sizes = rs_.shard_sizes;
    profile_.add(p);
    trace_.record(entered, planned, first, last, drained, returned, waited, rs_.batch, started_, ended_,
                  [this](std::size_t i) { return rs_.active(i); });
    if constexpr (observing_scatter_policy<scatter_type>) scatter_.observe(p);
  }

  // On an exception between the first enqueue and the final synchronize, the streams must finish
  // before the step's locals (which the queued work references) go away.
  struct sync_guard {
    parallel* self;
    bool armed = true;
    ~sync_guard() {
      if (armed) detail::drain_streams(self->rs_.streams);
    }
  };

  // Each step (and each shadow step of join()) opens its streams first (detail::begin_streams).
  void begin_streams() { detail::begin_streams<Backend>(rs_.streams); }

  static void ready_trampoline(void* self, int replica, std::size_t param) {
    auto* p = static_cast<parallel*>(self);
    if (p->contracts_.on()) p->contracts_.on_ready(p->rs_, static_cast<std::size_t>(replica), param);
    p->reduce_.grad_ready(p->rs_, replica, param);
  }

  detail::replica_set<Model, Backend> rs_;
  detail::parameter_registry::handle registration_;  // DDP: this wrapper's parameter memory, while it lives
  replicate_type replicate_{};
  reduce_type reduce_{};
  scatter_type scatter_{};
  detail::join_control join_;  // DDP: uneven inputs and sample weighting (policy/join.hpp)
  detail::step_agreement agreement_;  // DDP under desync detection: batch sizes, sampler epochs
  detail::contract_check<Model, Backend> contracts_;  // options::check_contracts (core/contract_check.hpp)
  // Per-step scratch kept across steps: each device's step_context, and the output slots (their
  // type depends on the step function's output, see run_step).
  std::vector<step_context> ctx_;
  detail::typed_scratch scratch_;
  // Diagnostics: each device's step function start and end (written on its stream), the profile.
  std::vector<profile_clock::time_point> started_, ended_;
  step_profile last_profile_;
  profile_summary profile_;
  step_trace trace_;
  profile_duration data_wait_{};
};

/// torch.nn.DataParallel's counterpart (host backend by default).
template <class Model, class Backend = host::backend>
using data_parallel = parallel<Model, dp, Backend>;

/// torch.nn.parallel.DistributedDataParallel's counterpart (host backend by default).
template <class Model, class Backend = host::backend>
using distributed_data_parallel = parallel<Model, ddp, Backend>;

DPARALLEL_NAMESPACE_END

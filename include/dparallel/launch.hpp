#pragma once
// launch<Semantics>(world, fn): one entry point for DataParallel and DDP. One training function,
// fn(session&), runs as DataParallel (one process, N local devices) or DDP
// (N thread ranks, or this process's rank of an MPI / torchrun-style group) depending on the
// Semantics bundle alone:
//
//   template <class Semantics>
//   void train(dparallel::world const& w) {
//     dparallel::launch<Semantics>(w, [&](auto& s) {
//       model m = make_model();
//       auto par = s.wrap(m);                                    // parallel<model, Semantics>
//       auto plan = s.batches(data.size(), {.global_batch = 128, .seed = 1});
//       for (std::size_t j = 0; j < plan.size(); ++j) {
//         auto b = load(plan[j]);                                // this participant's samples
//         par.step(b, step_fn);
//         sgd(par.module());
//       }
//     });
//   }
//   train<dparallel::dp>(dparallel::world::local(4));   // DataParallel over host:0..3
//   train<dparallel::ddp>(dparallel::world::local(4));  // DDP over 4 thread ranks
//
// What a batch means is the library's business: batch_plan hands DataParallel the global batch
// (every replica's samples, in replica order) and a DDP rank its own part of it, both drawn from
// distributed_sampler with one sampler replica per device or rank, so both modes visit the same
// samples in the same steps and DataParallel's shard i is exactly DDP rank i's batch.

#include <dparallel/config.hpp>
#include <dparallel/backend/host/backend.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/data/distributed_sampler.hpp>
#include <dparallel/parallel.hpp>
#include <dparallel/spawn.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Where launch() runs a training function: a count of local participants, a list of devices, or
/// this process's rank of an existing process group. The Semantics bundle decides what a
/// participant is: a device for DataParallel, a rank for DDP.
class world {
 public:
  /// `n` participants in this process: DataParallel over the backend's devices 0..n-1, or DDP
  /// over `n` thread ranks (spawn) whose rank r runs on device r.
  [[nodiscard]] static world local(int n, spawn_options spawn = {}) {
    detail::require(n >= 1, [&] { return "world::local: expected at least one participant, found " + std::to_string(n); });
    world w;
    w.size_ = n;
    w.spawn_ = spawn;
    return w;
  }
  /// These devices: DataParallel over them (devices[0] holds the master), or DDP over one
  /// thread rank per device.
  [[nodiscard]] static world on(std::vector<device> devices, spawn_options spawn = {}) {
    detail::require(!devices.empty(), "world::on: expected at least one device, found an empty list");
    world w;
    w.size_ = static_cast<int>(devices.size());
    w.devices_ = std::move(devices);
    w.spawn_ = spawn;
    return w;
  }
  /// This process's rank of `group` (e.g. mpi::init_process_group() or a rendezvous): DDP over
  /// the group's ranks. DataParallel bundles reject it: they run in one process.
  [[nodiscard]] static world of(process_group group) {
    detail::require(group.valid(), "world::of: expected a process group, found an empty process_group");
    world w;
    w.size_ = group.size();
    w.group_ = std::move(group);
    return w;
  }
  /// The same for a rank_context (a spawned rank).
  [[nodiscard]] static world of(rank_context const& rank) { return of(rank.group()); }

  /// Number of participants: devices (DataParallel) or ranks (DDP).
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The process group of world::of; empty otherwise.
  [[nodiscard]] process_group const& group() const noexcept { return group_; }
  /// The devices of world::on; empty otherwise (the backend's first size() devices are used).
  [[nodiscard]] std::vector<device> const& devices() const noexcept { return devices_; }
  /// How spawned thread ranks wait for each other (world::local and world::on under DDP).
  [[nodiscard]] spawn_options const& spawn() const noexcept { return spawn_; }

 private:
  world() = default;
  int size_ = 0;
  std::vector<device> devices_;
  process_group group_;
  spawn_options spawn_;
};

/// Options of session::batches(): the sampler's (shuffle, seed, drop_last, order; the same on
/// every participant) and the global batch, which the participants share equally.
struct batch_options {
  /// Samples per optimizer step over all participants; a multiple of the number of replicas.
  std::size_t global_batch = 0;
  /// Draw a new order every epoch (from seed + epoch).
  bool shuffle = true;
  /// Must be the same on every rank.
  std::uint64_t seed = 0;
  /// Drop the tail instead of padding (distributed_sampler's drop_last).
  bool drop_last = false;
  /// Sampler replicas the data is read as; 0 = `replicas()` of the training function's `session`
  /// object. DataParallel (and a one-device reference) may read the data as any number of
  /// replicas, e.g. as a DDP run of that many ranks would, so that both visit the same batches;
  /// under DDP it must be the world size.
  int replicas = 0;
  /// The permutation a shuffled epoch follows (distributed_sampler's; default PyTorch's).
  shuffle_order order = shuffle_order::torch;
};

/// The batches of one participant, epoch by epoch: the data is read by `replicas` sampler
/// replicas (distributed_sampler, rank r of replicas), each taking global_batch / replicas samples
/// per step, and step j of this participant is the concatenation, in replica order, of step j of
/// the replicas it covers: all of them for DataParallel (the global batch), its own for a DDP rank.
class batch_plan {
 public:
  /// Covers replicas [first, first + count) of `replicas` over a dataset of `dataset_size` samples.
  batch_plan(std::size_t dataset_size, int replicas, int first, int count, batch_options const& o)
      : per_replica_(replicas >= 1 ? o.global_batch / static_cast<std::size_t>(replicas) : 0) {
    detail::require(replicas >= 1 && first >= 0 && count >= 1 && first + count <= replicas, [&] {
      return "batch_plan: expected replicas [first, first + count) within [0, replicas), found first " +
             std::to_string(first) + ", count " + std::to_string(count) + ", replicas " + std::to_string(replicas);
    });
    detail::require(o.global_batch != 0 && o.global_batch % static_cast<std::size_t>(replicas) == 0, [&] {
      return "batch_plan: expected a global_batch that is a positive multiple of the " + std::to_string(replicas) +
             " replicas, found " + std::to_string(o.global_batch) + "; set batch_options::global_batch";
    });
    sampler_options const so{.shuffle = o.shuffle, .seed = o.seed, .drop_last = o.drop_last, .order = o.order};
    for (int r = first; r < first + count; ++r) samplers_.emplace_back(dataset_size, replicas, r, so);
  }

  /// Selects the epoch (the same on every participant, before its first step).
  void set_epoch(std::uint64_t epoch) {
    for (auto& s : samplers_) s.set_epoch(epoch);
  }
  /// Continues where a checkpoint's sampler position stands (checkpoint::progress().sampler, a
  /// position_after of the saved run): selects its epoch and returns the step to run next, so that the
  /// rest of the run visits exactly the batches an uninterrupted run would. Throws
  /// invalid_argument when the position is not the start of a step of this plan (another global
  /// batch or world size), lies past the epoch, or was taken in another shuffle order.
  [[nodiscard]] std::size_t resume(sampler_position const& p) {
    detail::require(p.index % per_replica_ == 0, [&] {
      return "batch_plan::resume: the position's index " + std::to_string(p.index) +
             " is not the start of a step of " + std::to_string(per_replica_) +
             " samples per replica (a checkpoint of another global batch or world size?)";
    });
    for (auto& s : samplers_) s.resume(p);
    return static_cast<std::size_t>(p.index) / per_replica_;
  }
  /// The position to save after step j of the current epoch: the next step's start, or the next
  /// epoch's start after the last step. Every participant saves the same one.
  [[nodiscard]] sampler_position position_after(std::size_t j) const {
    auto const& s = samplers_.front();
    if (j + 1 >= size()) return {s.epoch() + 1, 0, s.options().order};
    return s.position_after((j + 1) * per_replica_);
  }
  /// Steps per epoch (the last may be smaller than the others when the replicas' share is not a
  /// multiple of their per-step part).
  [[nodiscard]] std::size_t size() const noexcept {
    return (samplers_.front().size() + per_replica_ - 1) / per_replica_;
  }
  /// This participant's sample indices of step j.
  [[nodiscard]] std::vector<std::size_t> operator[](std::size_t j) const {
    detail::require(j < size(), [&] {
      return "batch_plan: expected a step below " + std::to_string(size()) + ", found " + std::to_string(j);
    });
    std::vector<std::size_t> out;
    for (auto const& s : samplers_) {
      std::size_t const lo = j * per_replica_, hi = std::min(s.size(), lo + per_replica_);
      out.insert(out.end(), s.indices().begin() + static_cast<std::ptrdiff_t>(lo),
                 s.indices().begin() + static_cast<std::ptrdiff_t>(hi));
    }
    return out;
  }
  /// Samples each sampler replica contributes to a full step.
  [[nodiscard]] std::size_t per_replica() const noexcept { return per_replica_; }
  /// The sampler replicas this participant covers, in order.
  [[nodiscard]] std::vector<distributed_sampler> const& samplers() const noexcept { return samplers_; }

 private:
  std::size_t per_replica_;
  std::vector<distributed_sampler> samplers_;
};

/// What launch() hands the training function: one participant's view of the world. Its members
/// are the same for every bundle; their meaning follows the bundle (see each).
template <class Semantics, class Backend = host::backend>
class session {
 public:
  /// The bundle launch<> was given (dp, ddp, ...).
  using semantics_type = Semantics;
  /// The backend its devices belong to.
  using backend_type = Backend;
  /// Whether this participant is one rank of a process group (DDP bundles).
  static constexpr bool distributed = is_distributed_v<Semantics>;

  /// DataParallel over `devices`.
  explicit session(std::vector<device> devices)
    requires(!distributed)
      : devices_(std::move(devices)) {}
  /// DDP: rank `group.rank()` of `group`, its replica on `dev` (default: the backend's choice).
  explicit session(process_group group, std::optional<device> dev = std::nullopt)
    requires(distributed)
      : group_(std::move(group)), device_(dev) {}

  /// This participant's rank (0 for DataParallel: one process).
  [[nodiscard]] int rank() const { return group_.valid() ? group_.rank() : 0; }
  /// Number of ranks (1 for DataParallel).
  [[nodiscard]] int world_size() const { return group_.valid() ? group_.size() : 1; }
  /// The data-parallel degree: devices (DataParallel) or ranks (DDP).
  [[nodiscard]] int replicas() const { return distributed ? world_size() : static_cast<int>(devices_.size()); }
  /// True on the participant that should print and write files (rank 0).
  [[nodiscard]] bool is_main() const { return rank() == 0; }
  /// DDP: this rank's process group; DataParallel: an empty one.
  [[nodiscard]] process_group const& group() const noexcept { return group_; }

  /// Wraps `model` (by reference: it must outlive the wrapper) as parallel<Model, Semantics,
  /// Backend>: over this participant's devices (DataParallel) or in its process group (DDP; a
  /// collective: every rank must wrap its model).
  template <class Model>
  [[nodiscard]] parallel<Model, Semantics, Backend> wrap(Model& model, options opts = {}) const {
    if constexpr (distributed) {
      if (!opts.local_device && device_) opts.local_device = device_;
      return parallel<Model, Semantics, Backend>(model, group_, std::move(opts));
    } else {
      return parallel<Model, Semantics, Backend>(model, devices_, std::move(opts));
    }
  }

  /// The batches this participant feeds to step(): DataParallel gets the global batch (split
  /// across its devices by the scatter policy), a DDP rank its own part (from the sampler).
  [[nodiscard]] batch_plan batches(std::size_t dataset_size, batch_options const& o) const {
    int const replicas = o.replicas == 0 ? this->replicas() : o.replicas;
    if constexpr (distributed) {
      detail::require(replicas == world_size(), [&] {
        return "session::batches: expected batch_options::replicas to be 0 or the world size " +
               std::to_string(world_size()) + " under DDP, found " + std::to_string(replicas) +
               "; every rank reads its own sampler replica";
      });
      return batch_plan(dataset_size, replicas, rank(), 1, o);
    } else {
      return batch_plan(dataset_size, replicas, 0, replicas, o);
    }
  }

 private:
  std::vector<device> devices_;
  process_group group_;
  std::optional<device> device_;
};

namespace detail {
template <class Backend>
std::vector<device> first_devices(int n) {
  if constexpr (std::is_same_v<Backend, host::backend>) {
    return host::devices(n);
  } else {
    std::vector<device> out;
    for (int i = 0; i < n; ++i) out.push_back(device{Backend::kind, i});
    return out;
  }
}
}  // namespace detail

/// Runs `fn(session<Semantics, Backend>&)` on every participant of `w`, as the bundle says:
/// - DataParallel: once, on the calling thread, over w's devices;
/// - DDP with world::local / world::on: on w.size() thread ranks (spawn, host backend), joined
///   before it returns; a rank's exception is rethrown as spawn rethrows it;
/// - DDP with world::of(group): once, as this process's rank of the group.
/// Changing the bundle is the only change needed to move a training function between them.
template <class Semantics, class Backend = host::backend, class F>
void launch(world const& w, F&& fn) {
  static_assert(semantics<Semantics>, "dparallel::launch: the first template argument must be a semantics bundle "
                                      "(dparallel::dp, dparallel::ddp or one derived from them)");
  static_assert(std::is_invocable_v<F&, session<Semantics, Backend>&>,
                "dparallel::launch: the training function must be callable as fn(session&); take `auto& s`");
  if constexpr (is_distributed_v<Semantics>) {
    if (w.group().valid()) {
      session<Semantics, Backend> s(w.group());
      fn(s);
      return;
    }
    detail::require(std::is_same_v<Backend, host::backend>,
                    "launch: DDP thread ranks run on the host backend; for other backends pass "
                    "world::of(group) with that backend's process group (e.g. nccl::init_process_group())");
    std::vector<device> const devs = w.devices();
    dparallel::spawn(
        w.size(),
        [&](rank_context& r) {
          std::optional<device> dev;
          if (!devs.empty()) dev = devs[static_cast<std::size_t>(r.rank())];
          session<Semantics, Backend> s(r.group(), dev);
          fn(s);
        },
        w.spawn());
  } else {
    detail::require(!w.group().valid(), [&] {
      return "launch: DataParallel runs in one process over local devices, found a world of a process group (rank " +
             std::to_string(w.group().rank()) + " of " + std::to_string(w.group().size()) +
             "); pass world::local(n) or world::on(devices), or use a DDP bundle";
    });
    session<Semantics, Backend> s(w.devices().empty() ? detail::first_devices<Backend>(w.size()) : w.devices());
    fn(s);
  }
}

/// The mean of a step's loss over this participant's samples, from what step() returned: the
/// shard-weighted mean of DataParallel's per-device values, or a DDP rank's own value.
template <class P, class Out>
[[nodiscard]] double local_mean(P const& par, Out const& out) {
  if constexpr (std::is_arithmetic_v<Out>) {
    return static_cast<double>(out);
  } else {
    double sum = 0;
    std::size_t n = 0, k = 0;
    for (std::size_t size : par.last_shard_sizes()) {
      if (size == 0) continue;
      sum += static_cast<double>(out[k++]) * static_cast<double>(size);
      n += size;
    }
    return n == 0 ? 0.0 : sum / static_cast<double>(n);
  }
}

/// The mean of a step's loss over every participant's samples, for logging: local_mean under
/// DataParallel (one process sees the whole batch); under DDP the sample-weighted mean over all
/// ranks (a collective on the wrapper's group: every rank calls it after the same step, and every
/// rank gets the same value, so one training function prints the same numbers under DataParallel
/// and DDP).
template <class P, class Out>
[[nodiscard]] double global_mean(P const& par, Out const& out) {
  double const mine = local_mean(par, out);
  if constexpr (!is_distributed_v<typename P::semantics_type>) {
    return mine;
  } else {
    std::size_t n = 0;
    for (std::size_t size : par.last_shard_sizes()) n += size;
    std::vector<double> v{mine * static_cast<double>(n), static_cast<double>(n)};
    par.group().all_reduce(view(v)).wait();
    return v[1] == 0 ? 0.0 : v[0] / v[1];
  }
}

DPARALLEL_NAMESPACE_END

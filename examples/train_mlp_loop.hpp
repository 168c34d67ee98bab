// train_mlp's training loop and what every mode shares: the epoch's data plan, the batches,
// plain SGD, the evaluation and the parameter fingerprint (see train_mlp.hpp for the other parts).
#pragma once

#include "train_mlp.hpp"
#if DPARALLEL_EXAMPLE_CUDA
#include "train_mlp_cuda.hpp"
#endif

#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/clip.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/optim/state.hpp>
#include <dparallel/optim/zero_checkpoint.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>

namespace example {

// ------------------------------------------------------------------------------------------------
// What every mode shares

/// One batch as the loader makes it (so that worker threads can make batches ahead): the ids of
/// its samples, and, unless the step copies its own rows (see batch_making), their images and
/// labels copied out of the data set. view() is the batch the model reads (images with rows =
/// samples), valid while this object lives.
struct gathered_batch {
  std::vector<std::size_t> ids;
  std::vector<float> images;  // empty when made with batch_making::ids
  std::vector<std::int32_t> labels;

  [[nodiscard]] std::size_t samples() const noexcept { return ids.size(); }
  [[nodiscard]] batch view() const {
    std::size_t const n = labels.size();
    return {dparallel::tensor_view<float const>(images.data(), n * mlp::inputs, n),
            dparallel::tensor_view<std::int32_t const>(labels.data(), n, n)};
  }
};

/// What the loader does for each batch: copy the samples' rows (the model then reads views of
/// them), or keep their ids alone for a step that copies each shard's rows on the thread that
/// computes it (DataParallel: each device copies its own shard, in parallel, as each DDP rank
/// copies its own part; copied on the training thread, the rows would be a serial part of every
/// DP step that the devices wait for).
enum class batch_making { rows, ids };

/// Copies the samples `samples` names, in that order. Reads `data` only: safe to call from
/// several loader workers, or several devices, at once.
inline gathered_batch gather(fashion_mnist::dataset const& data, std::span<std::size_t const> samples,
                             batch_making making = batch_making::rows) {
  gathered_batch out;
  out.ids.assign(samples.begin(), samples.end());
  if (making == batch_making::ids) return out;
  // One pass over the batch's bytes: reserved, then appended (no zero fill before the copy).
  out.images.reserve(samples.size() * mlp::inputs);
  out.labels.reserve(samples.size());
  for (std::size_t const s : samples) {
    float const* src = data.images.data() + s * mlp::inputs;
    out.images.insert(out.images.end(), src, src + mlp::inputs);
    out.labels.push_back(data.labels[s]);
  }
  return out;
}

/// The update after each step, as --optimizer, --weight-decay and --clip-grad-norm ask (see
/// make_update), and for the optimizers with state, that state for --save-checkpoint and --resume.
struct updater {
  std::function<void(double lr)> step;
  std::function<void(dparallel::checkpoint&)> add_state;  // empty: no state (plain SGD)
  // ZeRO-1: the sharded state in files of its own beside the checkpoint (zero_state_path), saved
  // and loaded by every rank together (optim/zero_checkpoint.hpp), before the checkpoint, whose
  // progress records which save goes with it. Empty otherwise.
  std::function<void(std::string const& checkpoint, dparallel::training_progress& p)> save_files;
  std::function<void(std::string const& checkpoint, dparallel::training_progress const& p)> load_files;
};

/// Where --zero 1 keeps the optimizer state of checkpoint `c`: "run.ckpt" -> "run.optim.ckpt"
/// (and its shards "run.optim.rank0-of-2.ckpt", ...).
inline std::filesystem::path zero_state_path(std::string const& c) {
  std::filesystem::path p(c);
  return p.replace_filename(p.stem().string() + ".optim" + p.extension().string());
}

/// `with(rule)` for the update rule --optimizer and --weight-decay name.
template <class With>
auto with_rule(config const& cfg, With&& with) {
  namespace optim = dparallel::optim;
  std::optional<double> const wd = cfg.weight_decay >= 0 ? std::optional<double>(cfg.weight_decay) : std::nullopt;
  if (cfg.optimizer == "adam") return with(optim::adam({.weight_decay = wd}));
  if (cfg.optimizer == "adamw") return with(optim::adamw({.weight_decay = wd}));
  return with(optim::sgd({.momentum = cfg.optimizer == "momentum" ? 0.9 : 0.0, .weight_decay = wd.value_or(0.0)}));
}

/// The update after each step: an optimizer of dparallel::optim over `m` (the master, or this DDP
/// rank's replica: every rank updates its own from the same reduced gradients, so the replicas stay
/// identical), after clipping the gradients. `target` is what the optimizer steps: `m` itself, or
/// the DataParallel wrapper around it, whose devices' threads then share the update of the master
/// (the same bits as one thread: the rules are elementwise). The defaults are plain SGD,
/// p <- p - lr g.
template <class Target>
updater make_update(config const& cfg, mlp& m, Target& target) {
  namespace optim = dparallel::optim;
  return with_rule(cfg, [&m, &target, clip = cfg.clip_grad_norm](auto rule) -> updater {
    auto opt = std::make_shared<optim::optimizer<decltype(rule)>>(target, rule);
    updater u{[&m, &target, opt, clip](double lr) {
                if (clip > 0) optim::clip_grad_norm(m, clip);
                opt->step(target, lr);
              },
              {},
              {},
              {}};
    if (opt->slots_kept() != 0) u.add_state = [&m, opt](dparallel::checkpoint& ck) { optim::add_to(ck, *opt, m); };
    return u;
  });
}
inline updater make_update(config const& cfg, mlp& m) { return make_update(cfg, m, m); }

/// --zero 1: the same rule over this rank's shards of the ddp_zero1 wrapper `w` (ZeRO-1), after
/// clipping the gradient shards (one scalar collective). --optimizer sgd is optim::sgd here. Its
/// sharded state goes to files of its own beside --save-checkpoint's (--zero-save chooses how) and
/// --resume reads them on any number of ranks.
template <class Wrapper>
updater make_zero_update(config const& cfg, Wrapper& w) {
  namespace optim = dparallel::optim;
  auto const mode = cfg.zero_gathered ? optim::zero_save_mode::gathered : optim::zero_save_mode::sharded;
  return with_rule(cfg, [&w, mode, clip = cfg.clip_grad_norm](auto rule) -> updater {
    auto opt = std::make_shared<dparallel::optim::zero_redundancy_optimizer<decltype(rule), Wrapper>>(w, rule);
    return {[&w, opt, clip](double lr) {
              if (clip > 0) optim::clip_grad_norm_sharded(opt->gradient_shards(), w.group(), clip);
              opt->step(lr);
            },
            {},
            [opt, mode](std::string const& c, dparallel::training_progress& p) {
              optim::save_zero_state(zero_state_path(c), *opt, mode).record(p);
            },
            [opt](std::string const& c, dparallel::training_progress const& p) {
              auto const id = optim::zero_state_id::recorded(p);
              if (!id)
                throw dparallel::error(c + " records no ZeRO-1 optimizer state (it was not saved with --zero 1): "
                                           "its optimizer state, if it has one, is inside it; resume it without --zero 1");
              optim::load_zero_state(zero_state_path(c), *opt, id);
            }};
  });
}

/// --resume with an optimizer that has state: the checkpoint again, strictly, with that state (the
/// model's values are those load_start read). Every rank reads it.
inline void load_optimizer_state(config const& cfg, updater const& u, mlp& m) {
  if (cfg.resume.empty() || !u.add_state) return;
  dparallel::checkpoint ckpt(m);
  u.add_state(ckpt);
  try {
    ckpt.load(cfg.resume);
  } catch (dparallel::error const& e) {
    throw std::runtime_error("--resume --optimizer " + cfg.optimizer + ": " + e.what());
  }
}

/// Fraction of `test` that `m` classifies correctly.
inline double evaluate(mlp& m, fashion_mnist::dataset const& test) {
  constexpr std::size_t chunk = 1000;
  std::size_t correct = 0;
  for (std::size_t first = 0; first < test.size(); first += chunk) {
    std::size_t const n = std::min(chunk, test.size() - first);
    batch const b{dparallel::tensor_view<float const>(test.images.data() + first * mlp::inputs, n * mlp::inputs, n),
                  dparallel::tensor_view<std::int32_t const>(test.labels.data() + first, n, n)};
    correct += m.count_correct(b);
  }
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

inline fingerprint parameter_fingerprint(mlp& m) {
  double sum = 0, sq = 0;
  for (auto const& p : dparallel::parameters(m))
    for (float x : p) {
      sum += static_cast<double>(x);
      sq += static_cast<double>(x) * static_cast<double>(x);
    }
  return {sum, std::sqrt(sq)};
}

using seconds = std::chrono::duration<double>;

/// How steady the training speed was: samples per second over stretches of `steps_per_stretch`
/// steps (the loop's whole iteration: data, step, update), and their spread. On a quiet machine
/// the stretches agree within a few per cent; other work on the machine shows as a wide spread.
class stretch_rates {
 public:
  static constexpr std::size_t steps_per_stretch = 20;
  /// A new epoch: what lies between epochs (the evaluation) is not training. The epoch's first
  /// step only starts the clock (it carries the epoch's set-up).
  void new_epoch() { started_ = false; }
  /// One step of `samples` samples done now.
  void add(std::size_t samples) {
    auto const now = std::chrono::steady_clock::now();
    if (!started_) {
      started_ = true;
      start_ = now;
      steps_ = samples_ = 0;
      return;
    }
    samples_ += samples;
    if (++steps_ == steps_per_stretch) {
      rates_.push_back(static_cast<double>(samples_) / seconds(now - start_).count());
      start_ = now;
      steps_ = samples_ = 0;
    }
  }
  /// Half the range of the stretches' rates (the slowest and fastest 10% left out when there are
  /// ten or more) over their median: 0.05 reads "within +-5%". 0 with fewer than two stretches.
  [[nodiscard]] double spread() const {
    if (rates_.size() < 2) return 0;
    std::vector<double> r = rates_;
    std::sort(r.begin(), r.end());
    std::size_t const cut = r.size() >= 10 ? r.size() / 10 : 0;
    double const median = r[r.size() / 2];
    return (r[r.size() - 1 - cut] - r[cut]) / (2 * median);
  }

 private:
  std::chrono::steady_clock::time_point start_;
  bool started_ = false;
  std::size_t steps_ = 0, samples_ = 0;
  std::vector<double> rates_;
};

/// The model train() evaluates, fingerprints and saves: on the host backend, the master itself.
inline mlp& host_model(mlp& m) { return m; }

#if DPARALLEL_EXAMPLE_CUDA
/// The master of a --backend cuda run, as train() drives it: SGD runs on the GPU; evaluation,
/// fingerprints and files read `host`, a copy of the GPU parameters made when asked for. (So both
/// backends evaluate and save with the same host code.)
struct gpu_master {
  train_mlp_cuda::runner* run;
  mlp host;
};
/// --backend cuda: plain SGD on the GPU (the command line refuses the other optimizers there).
inline updater make_update(config const&, gpu_master& m) {
  return {[&m](double lr) { m.run->sgd(static_cast<float>(lr)); }, {}, {}, {}};
}
inline void load_optimizer_state(config const&, updater const&, gpu_master&) {}
inline mlp& host_model(gpu_master& m) {
  m.run->download(m.host);
  return m.host;
}
#endif

/// The training loop every mode runs. `step(gathered_batch const&, std::chrono::nanoseconds waited)
/// -> double` is the mode: it returns the mean loss over the batch it was given (a DDP rank's part of
/// the global batch) and leaves the gradient of the global batch's mean loss in `master`'s gradients (`waited`: how long the loop waited for this batch, for
/// the wrapper's profile). Then the optimizer (make_update, or `update_override` when given: ZeRO-1's)
/// updates `master`; after each epoch `master` is evaluated on the test set.
/// `master` is an mlp, or a gpu_master on the CUDA backend (see host_model).
/// `rank` is -1 for modes that see the whole global batch; a DDP rank passes its rank and gets
/// only its own part of every batch (rank 0 alone evaluates, prints and writes files).
///
/// Each epoch's batches come from a dparallel::loader (--workers threads make them ahead, in
/// order) over the plan's index lists, so the batches, hence the results, do not depend on
/// --workers. `making` says whether the loader copies the rows (with --workers, it always does) or
/// leaves that to the step.
///
/// The loop starts where `start.progress` stands (epoch, step, and the sampler position: the
/// number of its indices each sampler replica has consumed in that epoch) and stops after the last
/// epoch or at step cfg.steps, whichever comes first; the progress at that point is what
/// --save-checkpoint writes, with the position of the next batch (an epoch's end is the next
/// epoch's start).
///
/// With --uneven (ddp), rank r takes the epoch's batches but its last r, then calls
/// `end_epoch()` (the wrapper's join()) before the epoch's evaluation.
///
/// The epoch's training loss is summed on each rank and, for DDP, over the ranks once at the
/// epoch's end (`sum_over_ranks`, an all-reduce of two numbers): no collective or host wait is
/// added to a step just to print a loss.
template <class Master, class Step>
result train(config const& cfg, training_data const& data, start_point const& start, Master& master, int rank,
             Step&& step, updater update_override = {}, std::function<void()> const& end_epoch = {},
             std::function<void(std::array<double, 2>&)> const& sum_over_ranks = {},
             batch_making making = batch_making::rows) {
  result r;
  bool const reports = rank <= 0;
  if (cfg.workers != 0) making = batch_making::rows;  // the loader's threads copy ahead
  auto const make = [&data, making](std::span<std::size_t const> samples) { return gather(data.train, samples, making); };
  updater const update = update_override.step ? std::move(update_override) : make_update(cfg, master);
  load_optimizer_state(cfg, update, master);
  if (!cfg.resume.empty() && update.load_files) {  // every rank
    try {
      update.load_files(cfg.resume, start.progress);
    } catch (dparallel::error const& e) {
      throw std::runtime_error("--resume --zero 1: " + std::string(e.what()));
    }
  }
  auto const epochs = static_cast<std::uint64_t>(cfg.epochs);
  dparallel::training_progress p = start.progress;
  r.start_step = p.step;
  bool early_taken = false, evaluated = false;
  seconds total{0};
  std::size_t seen = 0;
  stretch_rates speed;
  while (p.epoch < epochs && p.step < cfg.steps) {
    auto const begin = std::chrono::steady_clock::now();
    int const epoch = static_cast<int>(p.epoch);
    // This participant's batches: every sampler replica's part of each global batch (the one
    // process of single and DP) or its own rank's; from the checkpoint's position on a resume.
    int const covers = rank < 0 ? cfg.sampler_replicas : 1;
    dparallel::batch_plan plan(data.train.size(), cfg.sampler_replicas, rank < 0 ? 0 : rank, covers,
                               {.global_batch = cfg.global_batch, .seed = p.seed, .order = p.sampler.order});
    plan.set_epoch(p.epoch);
    std::size_t first = 0;
    try {
      dparallel::detail::require(p.sampler.epoch == p.epoch, [&] {
        return "the position is of epoch " + std::to_string(p.sampler.epoch) + ", the checkpoint's epoch is " +
               std::to_string(p.epoch);
      });
      first = plan.resume(p.sampler);
      dparallel::detail::require(first < plan.size(), "the position is past the epoch's last step");
    } catch (dparallel::error const& e) {
      throw std::runtime_error("--resume: the checkpoint's sampler position (epoch " +
                               std::to_string(p.sampler.epoch) + ", index " + std::to_string(p.sampler.index) +
                               ") is not the start of a batch of epoch " + std::to_string(p.epoch) + " (" +
                               std::to_string(plan.size()) + " batches of " + std::to_string(plan.per_replica()) +
                               " samples per replica): " + e.what() +
                               "; it was not written by this program's --save-checkpoint");
    }
    // Batches first.. of the epoch; every replica's part of a step has the same size (the sampler
    // pads), so a global batch is this participant's times the replicas it does not cover.
    std::vector<std::vector<std::size_t>> lists;
    std::vector<std::size_t> global_sizes;
    for (std::size_t k = first; k < plan.size(); ++k) {
      lists.push_back(plan[k]);
      global_sizes.push_back(lists.back().size() * static_cast<std::size_t>(cfg.sampler_replicas / covers));
    }
    dparallel::loader batches(lists, make, {.num_workers = cfg.workers});
    speed.new_epoch();
    std::array<double, 2> loss{0, 0};  // this rank's sum of loss x samples, and its samples
    std::size_t samples = 0, j = first;
    std::size_t const drop = cfg.uneven && rank > 0 ? static_cast<std::size_t>(rank) : 0;
    std::size_t const last = plan.size() - std::min(drop, plan.size());
    for (; j < last && p.step < cfg.steps; ++j) {
      std::optional<gathered_batch> const made = batches.next();
      if (!made) throw std::logic_error("train_mlp: the loader ended before the epoch's last batch");
      r.data_wait_seconds += seconds(batches.last_wait()).count();
      double const mean = step(*made, batches.last_wait());
      update.step(cfg.lr);
      loss[0] += mean * static_cast<double>(made->samples());
      loss[1] += static_cast<double>(made->samples());
      std::size_t const n = global_sizes[j - first];
      samples += n;
      speed.add(n);
      p.sampler = plan.position_after(j);
      if (++p.step == early_steps) {
        early_taken = true;
        r.early_steps = early_steps;
        r.early = parameter_fingerprint(host_model(master));  // once; well under a millisecond
      }
    }
    if (end_epoch) end_epoch();
    if (sum_over_ranks) sum_over_ranks(loss);
    if (j == last) p.sampler = {.epoch = ++p.epoch, .index = 0, .order = p.sampler.order};
    seconds const took = std::chrono::steady_clock::now() - begin;
    total += took;
    seen += samples;
    r.train_loss = loss[1] == 0 ? 0.0 : loss[0] / loss[1];
    if (!reports) continue;
    r.test_accuracy = evaluate(host_model(master), data.test);
    evaluated = true;
    std::printf("epoch %d/%d  train_loss %.4f  test_accuracy %.4f  samples/s %.0f  (%.2f s)", epoch + 1, cfg.epochs,
                r.train_loss, r.test_accuracy, static_cast<double>(samples) / took.count(), took.count());
    if (first != 0 || j != plan.size()) std::printf("  batches %zu-%zu of %zu", first + 1, j, plan.size());
    std::printf("\n");
    std::fflush(stdout);
  }
  if (reports && !evaluated)  // no step ran: the start model's
    r.test_accuracy = evaluate(host_model(master), data.test);
  r.train_seconds = total.count();
  r.samples_per_s = seen == 0 ? 0.0 : static_cast<double>(seen) / total.count();
  r.rate_spread = speed.spread();
  r.params = parameter_fingerprint(host_model(master));
  r.steps = p.step;
  if (!early_taken) {
    r.early_steps = static_cast<std::size_t>(p.step);
    r.early = r.params;
  }
  p.extra.erase("zero.set");  // a resumed checkpoint's optimizer save is not this run's
  p.extra.erase("zero.step");
  if (!cfg.save_checkpoint.empty() && update.save_files) update.save_files(cfg.save_checkpoint, p);  // every rank
  if (reports) save_outputs(cfg, data, p, host_model(master), update.add_state);
  return r;
}

}  // namespace example

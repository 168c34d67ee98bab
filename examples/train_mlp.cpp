// train_mlp: trains the 784-512-ReLU-10 MLP on Fashion-MNIST, on one device (--mode single) or
// with DataParallel over host logical devices (--mode dp --devices N), and reports the test
// accuracy, the throughput and a fingerprint of the trained parameters.
//
// Every mode shares the data, the batch order, the batch gathering, the optimizer and the
// evaluation; a mode only says how one global batch becomes a loss and the gradient of the mean
// loss on the master model (see `modes` below). With the same seed, the modes visit the same
// batches in the same order. The model sums per-block gradients with the same pairwise tree as
// dparallel's reductions (see mlp::forward_backward), so with global batch 128 on 2 or 4 devices
// every full batch gives bitwise the one-device gradient, and the runs differ only through the
// epoch's last, partial batch (result::early, taken after 20 steps, is bitwise equal).
//
// --mode ddp --comm mpi runs the ranks as MPI processes instead of threads (built when MPI was
// found): `mpirun -np 2 train_mlp --mode ddp --comm mpi ...`. Rank 0 alone prints; the MPI
// communicator reduces in rank order, so the result is bitwise that of --comm thread.
//
// Files (dparallel/io): --save writes the trained model as a safetensors state dict, --init starts
// from one instead of the seeded initialisation, --save-checkpoint writes the whole training state
// (model, epoch, step, sampler position, seed; plain SGD has no optimizer state) and --resume
// continues from one: a run stopped after k steps (--steps) and resumed gives bitwise the
// parameters of a run that never stopped. Every rank reads --init and --resume; rank 0 alone
// writes (the master model in dp, rank 0's replica in ddp: all replicas are equal).
//
// --backend cuda (built when CMake found CUDA) trains the same model on GPUs: mlp_cuda.cuh, driven
// through train_mlp_cuda.hpp by the same loop, so the batches, the order and the files are those of
// the host backend; --backend auto (the default) takes CUDA when a GPU is visible, else the host.
// ddp on CUDA runs over NCCL: thread ranks need one GPU each; --comm nccl makes the ranks the
// processes of an mpirun or torchrun-style launch.

#include "fashion_mnist.hpp"
#include "mlp.hpp"
#if DPARALLEL_EXAMPLE_CUDA
#include "train_mlp_cuda.hpp"
#endif

#include <dparallel/dparallel.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/state_dict.hpp>
#if DPARALLEL_EXAMPLE_MPI
#include <dparallel/comm/mpi.hpp>
#endif

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>  // getpid

namespace {

// ------------------------------------------------------------------------------------------------
// Options

struct config {
  std::string mode = "single";
  std::string backend = "auto";  // host, cuda, or auto (resolved by parse_command_line: cuda when a GPU is visible)
  std::string backend_reason;    // why --backend auto chose the backend it did (empty when given)
  int gpus = 0;                  // visible GPUs (counted when the backend may be cuda)
  std::string comm = "thread";   // ddp: thread ranks, MPI processes, or NCCL processes (--backend cuda)
  int devices = 0;  // 0 = the mode's default
  int epochs = 5;
  std::size_t global_batch = 128;
  double lr = 0.1;
  std::uint64_t seed = 1;
  int sampler_replicas = 0;  // 0 = the mode's default (single, dp: 1; ddp: --devices)
  bool json = false;
  bool help = false;
  std::string data = fashion_mnist::default_dir;
  std::size_t train_samples = 0;  // 0 = the whole training set
  std::size_t workers = 0;        // --workers: loader threads making batches ahead (0: on the training thread)
  bool profile = false;           // --profile: print where the step time went at the end
  bool seed_given = false;
  // Stop after this many optimizer steps in total, counting those before --resume.
  std::uint64_t steps = std::numeric_limits<std::uint64_t>::max();
  std::string init;             // --init: a state dict to start from
  std::string resume;           // --resume: a checkpoint to continue from
  std::string save;             // --save: the trained model's state dict
  std::string save_checkpoint;  // --save-checkpoint: the training state at the end
};

/// A bad command line: reported with exit code 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct training_data {
  fashion_mnist::dataset train, test;
};

/// Where training starts: the model (seeded, or read from --init or --resume) and the progress
/// (zero with --seed, or the checkpoint's). Read once per process, before any wrapper or rank
/// exists; every mode starts from a copy of `model`.
struct start_point {
  mlp model;
  dparallel::training_progress progress{};
  bool resumed = false;
};

/// Sum and L2 norm of all parameters, accumulated in double in parameters() order.
struct fingerprint {
  double sum = 0;
  double l2 = 0;
};

/// Optimizer steps after which result::early is taken.
constexpr std::size_t early_steps = 20;

/// What a run reports.
struct result {
  int devices = 1;
  double train_loss = 0;     // mean loss over the batches of the last epoch run (sample-weighted)
  double test_accuracy = 0;  // after the last epoch
  double samples_per_s = 0;  // training samples / training wall time, all epochs
  double train_seconds = 0;  // training wall time, all epochs, evaluation excluded
  fingerprint params;        // of the trained parameters
  // Of the parameters after the first `early_steps` optimizer steps (at the end if the run stopped
  // before them or resumed after them): equal to the bit between modes whose gradients are
  // (example_check compares them).
  std::size_t early_steps = 0;
  fingerprint early;
  std::uint64_t start_step = 0;  // optimizer steps done before this run (--resume)
  std::uint64_t steps = 0;       // optimizer steps done at the end, start_step included
  double data_wait_seconds = 0;  // time the training loop waited for its batches (the loader's)
};

// ------------------------------------------------------------------------------------------------
// What every mode shares

/// The samples of one epoch, as DDP with R ranks reads them: rank r reads the indices that
/// dparallel::distributed_sampler (shuffled from seed + epoch) gives it, in batches of B / R, and
/// global batch j is the concatenation, in rank order, of every rank's batch j. Single and dp runs
/// with --sampler-replicas R visit exactly the batches of a DDP run with R ranks, in the same
/// order (R = 1 is the plain shuffled order).
class epoch_plan {
 public:
  epoch_plan(std::size_t dataset_size, int replicas, std::size_t global_batch, std::uint64_t seed, int epoch)
      : per_rank_(global_batch / static_cast<std::size_t>(replicas)) {
    for (int r = 0; r < replicas; ++r) {
      dparallel::distributed_sampler sampler(dataset_size, replicas, r, {.shuffle = true, .seed = seed});
      sampler.set_epoch(static_cast<std::uint64_t>(epoch));
      streams_.emplace_back(sampler.begin(), sampler.end());
    }
  }
  /// Number of global batches (the last may be smaller).
  [[nodiscard]] std::size_t batches() const { return (streams_[0].size() + per_rank_ - 1) / per_rank_; }
  /// Rank r's samples of global batch j.
  [[nodiscard]] std::span<std::uint32_t const> slice(std::size_t j, int r) const {
    auto const& s = streams_[static_cast<std::size_t>(r)];
    std::size_t const first = j * per_rank_;
    return std::span<std::uint32_t const>(s).subspan(first, std::min(per_rank_, s.size() - first));
  }
  /// Every rank's samples of global batch j, in rank order.
  [[nodiscard]] std::vector<std::uint32_t> global(std::size_t j) const {
    std::vector<std::uint32_t> all;
    for (int r = 0; r < static_cast<int>(streams_.size()); ++r) {
      auto const part = slice(j, r);
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
  [[nodiscard]] std::size_t samples() const { return streams_.size() * streams_[0].size(); }

 private:
  std::size_t per_rank_;
  std::vector<std::vector<std::uint32_t>> streams_;
};

/// One batch's samples copied out of the dataset into buffers of its own (what the loader's make
/// function returns, so that worker threads can make batches ahead); view() is the batch the
/// model reads (images with rows = samples), valid while this object lives.
struct gathered_batch {
  std::vector<float> images;
  std::vector<std::int32_t> labels;

  [[nodiscard]] batch view() const {
    std::size_t const n = labels.size();
    return {dparallel::tensor_view<float const>(images.data(), n * mlp::inputs, n),
            dparallel::tensor_view<std::int32_t const>(labels.data(), n, n)};
  }
};

/// Copies the samples `samples` names, in that order. Reads `data` only: safe to call from
/// several loader workers at once.
gathered_batch gather(fashion_mnist::dataset const& data, std::span<std::size_t const> samples) {
  gathered_batch out{std::vector<float>(samples.size() * mlp::inputs), std::vector<std::int32_t>(samples.size())};
  for (std::size_t i = 0; i < samples.size(); ++i) {
    float const* src = data.images.data() + samples[i] * mlp::inputs;
    std::copy(src, src + mlp::inputs, out.images.begin() + static_cast<std::ptrdiff_t>(i * mlp::inputs));
    out.labels[i] = data.labels[samples[i]];
  }
  return out;
}

/// Plain SGD on the master: p -= lr * g for every parameter, reached through the same
/// customisation points dparallel uses.
void sgd(mlp& m, float lr) {
  auto params = dparallel::parameters(m);
  auto grads = dparallel::gradients(m);
  for (std::size_t k = 0; k < params.size(); ++k)
    for (std::size_t i = 0; i < params[k].size(); ++i) params[k][i] -= lr * grads[k][i];
}

/// Fraction of `test` that `m` classifies correctly.
double evaluate(mlp& m, fashion_mnist::dataset const& test) {
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

fingerprint parameter_fingerprint(mlp& m) {
  double sum = 0, sq = 0;
  for (auto const& p : dparallel::parameters(m))
    for (float x : p) {
      sum += static_cast<double>(x);
      sq += static_cast<double>(x) * static_cast<double>(x);
    }
  return {sum, std::sqrt(sq)};
}

using seconds = std::chrono::duration<double>;

/// Reads --init or --resume (every process does, before any wrapper or rank exists): the
/// seeded model, or the state dict of --init (strict: every name and shape must match), or the
/// model and progress of the checkpoint of --resume. Errors name the option and the file.
start_point load_start(config const& cfg) {
  start_point s{mlp(cfg.seed)};
  s.progress.seed = cfg.seed;
  // Whether a file is a checkpoint, to tell a checkpoint passed to --init or a state dict passed
  // to --resume; nothing when it cannot be read (the load below says why).
  auto is_checkpoint = [](std::string const& path) -> std::optional<bool> {
    try {
      return dparallel::safetensors_reader(path).metadata().contains(std::string(dparallel::checkpoint::format_key));
    } catch (dparallel::error const&) {
      return std::nullopt;
    }
  };
  if (!cfg.init.empty()) {
    if (is_checkpoint(cfg.init) == true)
      throw std::runtime_error("--init " + cfg.init + ": expected a state dict (as --save writes), found a "
                               "training checkpoint (as --save-checkpoint writes); continue it with --resume");
    try {
      dparallel::load_state_dict(cfg.init, s.model);
    } catch (dparallel::error const& e) {
      throw std::runtime_error(std::string("--init: ") + e.what());
    }
  }
  if (!cfg.resume.empty()) {
    if (is_checkpoint(cfg.resume) == false)
      throw std::runtime_error("--resume " + cfg.resume + ": expected a training checkpoint (as --save-checkpoint "
                               "writes), found no checkpoint marker in it; start from a state dict (as --save "
                               "writes) with --init");
    dparallel::checkpoint ckpt(s.model);  // plain SGD: no optimizer tensors
    try {
      ckpt.load(cfg.resume);
    } catch (dparallel::error const& e) {
      throw std::runtime_error(std::string("--resume: ") + e.what());
    }
    s.progress = ckpt.progress();
    s.resumed = true;
    if (cfg.seed_given && cfg.seed != s.progress.seed)
      throw std::runtime_error("--resume " + cfg.resume + ": the checkpoint continues a run of seed " +
                               std::to_string(s.progress.seed) + " (its shuffles), found --seed " +
                               std::to_string(cfg.seed) + "; leave --seed out");
  }
  return s;
}

/// --save and --save-checkpoint: fails before training, not after it, when a file cannot be
/// written: its folder is missing, the name is a directory (or another non-file), or the folder
/// takes no new file (probed by creating and removing one: the save writes a temporary file there
/// and renames it over the target).
void check_outputs_writable(config const& cfg) {
  namespace fs = std::filesystem;
  for (auto const& [option, file] :
       {std::pair{"--save", &cfg.save}, std::pair{"--save-checkpoint", &cfg.save_checkpoint}}) {
    if (file->empty()) continue;
    fs::path const target(*file);
    fs::path const folder = target.parent_path();
    std::string const what = std::string(option) + " " + *file + ": ";
    if (!folder.empty() && !fs::is_directory(folder))
      throw std::runtime_error(what + "expected the folder " + folder.string() + " to exist, found none; create it first");
    std::error_code ec;
    fs::file_status const st = fs::status(target, ec);
    if (fs::is_directory(st))
      throw std::runtime_error(what + "expected a file name, found a directory; name a file in it, e.g. " +
                               (target / "model.safetensors").string());
    if (fs::exists(st) && !fs::is_regular_file(st))
      throw std::runtime_error(what + "expected a regular file (or a new name), found another kind of file");
    fs::path const probe = (folder.empty() ? fs::path(".") : folder) /
                           ("." + target.filename().string() + ".probe-" + std::to_string(::getpid()));
    std::FILE* const p = std::fopen(probe.c_str(), "wx");
    int const error = errno;
    if (p == nullptr)
      throw std::runtime_error(what + "cannot create a file in the folder " +
                               (folder.empty() ? std::string(".") : folder.string()) + " (" +
                               std::error_code(error, std::generic_category()).message() +
                               "); choose a writable folder");
    std::fclose(p);
    fs::remove(probe, ec);
  }
}

/// --resume: checks that this run reads the data as the checkpoint's run did (the settings its
/// sampler position depends on, which save_outputs records), so that resuming continues it exactly.
void check_resume(config const& cfg, start_point const& start, training_data const& data) {
  if (!start.resumed) return;
  struct setting {
    char const *key, *option;
    std::size_t value;
  };
  for (setting const& s : {setting{"global_batch", "--batch", cfg.global_batch},
                           setting{"sampler_replicas", "--sampler-replicas",
                                   static_cast<std::size_t>(cfg.sampler_replicas)},
                           setting{"train_samples", "--train-samples", data.train.size()}}) {
    auto const it = start.progress.extra.find(s.key);
    if (it == start.progress.extra.end())
      throw std::runtime_error("--resume " + cfg.resume + ": expected the checkpoint's metadata to hold 'user." +
                               s.key + "', found none: it was not written by train_mlp --save-checkpoint");
    if (it->second != std::to_string(s.value))
      throw std::runtime_error("--resume " + cfg.resume + ": the checkpoint was written by a run with " + s.option +
                               " " + it->second + ", found " + s.option + " " + std::to_string(s.value) +
                               "; resume with the settings it was written with (its sampler position counts "
                               "their batches)");
  }
}

/// Writes --save and --save-checkpoint (rank 0 only): the model `m`, and the training state
/// `progress` with the settings that give its sampler position a meaning.
void save_outputs(config const& cfg, training_data const& data, dparallel::training_progress const& progress, mlp& m) {
  if (!cfg.save.empty()) {
    dparallel::save_state_dict(cfg.save, m, {{"steps", std::to_string(progress.step)}});
    std::printf("train_mlp: saved the model after %llu steps to %s\n",
                static_cast<unsigned long long>(progress.step), cfg.save.c_str());
  }
  if (!cfg.save_checkpoint.empty()) {
    dparallel::checkpoint ckpt(m);  // plain SGD: no optimizer tensors to register
    ckpt.progress() = progress;
    ckpt.progress().extra = {{"global_batch", std::to_string(cfg.global_batch)},
                             {"sampler_replicas", std::to_string(cfg.sampler_replicas)},
                             {"train_samples", std::to_string(data.train.size())},
                             {"mode", cfg.mode}};
    ckpt.save(cfg.save_checkpoint);
    std::printf("train_mlp: saved a checkpoint (epoch %llu, step %llu) to %s\n",
                static_cast<unsigned long long>(progress.epoch), static_cast<unsigned long long>(progress.step),
                cfg.save_checkpoint.c_str());
  }
  std::fflush(stdout);
}

/// The model train() evaluates, fingerprints and saves: on the host backend, the master itself.
mlp& host_model(mlp& m) { return m; }

#if DPARALLEL_EXAMPLE_CUDA
/// The master of a --backend cuda run, as train() drives it: SGD runs on the GPU; evaluation,
/// fingerprints and files read `host`, a copy of the GPU parameters made when asked for. (So both
/// backends evaluate and save with the same host code.)
struct gpu_master {
  train_mlp_cuda::runner* run;
  mlp host;
};
void sgd(gpu_master& m, float lr) { m.run->sgd(lr); }
mlp& host_model(gpu_master& m) {
  m.run->download(m.host);
  return m.host;
}
#endif

/// The training loop every mode runs. `step(batch const&, std::chrono::nanoseconds waited) ->
/// double` is the mode: it returns the mean loss over the global batch and leaves the gradient of
/// that mean loss in `master`'s gradients (`waited`: how long the loop waited for this batch, for
/// the wrapper's profile). Then SGD updates `master`; after each epoch `master` is evaluated on the test set.
/// `master` is an mlp, or a gpu_master on the CUDA backend (see host_model).
/// `rank` is -1 for modes that see the whole global batch; a DDP rank passes its rank and gets
/// only its own part of every batch (rank 0 alone evaluates, prints and writes files).
///
/// Each epoch's batches come from a dparallel::loader (--workers threads make them ahead, in
/// order) over the plan's index lists, so the batches, hence the results, do not depend on
/// --workers.
///
/// The loop starts where `start.progress` stands (epoch, step, and the sampler position: the
/// number of its indices each sampler replica has consumed in that epoch) and stops after the last
/// epoch or at step cfg.steps, whichever comes first; the progress at that point is what
/// --save-checkpoint writes, with the position of the next batch (an epoch's end is the next
/// epoch's start).
template <class Master, class Step>
result train(config const& cfg, training_data const& data, start_point const& start, Master& master, int rank,
             Step&& step) {
  result r;
  bool const reports = rank <= 0;
  auto const make = [&data](std::span<std::size_t const> samples) { return gather(data.train, samples); };
  auto const lr = static_cast<float>(cfg.lr);
  std::size_t const per_rank = cfg.global_batch / static_cast<std::size_t>(cfg.sampler_replicas);
  auto const epochs = static_cast<std::uint64_t>(cfg.epochs);
  dparallel::training_progress p = start.progress;
  r.start_step = p.step;
  bool early_taken = false, evaluated = false;
  seconds total{0};
  std::size_t seen = 0;
  while (p.epoch < epochs && p.step < cfg.steps) {
    auto const begin = std::chrono::steady_clock::now();
    int const epoch = static_cast<int>(p.epoch);
    epoch_plan const plan(data.train.size(), cfg.sampler_replicas, cfg.global_batch, p.seed, epoch);
    std::size_t const first = static_cast<std::size_t>(p.sampler.index) / per_rank;
    if (p.sampler.epoch != p.epoch || p.sampler.index % per_rank != 0 || first >= plan.batches())
      throw std::runtime_error("--resume: the checkpoint's sampler position (epoch " +
                               std::to_string(p.sampler.epoch) + ", index " + std::to_string(p.sampler.index) +
                               ") is not the start of a batch of epoch " + std::to_string(p.epoch) + " (" +
                               std::to_string(plan.batches()) + " batches of " + std::to_string(per_rank) +
                               " samples per replica); it was not written by this program's --save-checkpoint");
    // Batches first.. of the epoch: the whole global batch, or this rank's part of it.
    std::vector<std::vector<std::size_t>> lists;
    std::vector<std::size_t> global_sizes;
    for (std::size_t k = first; k < plan.batches(); ++k) {
      std::vector<std::uint32_t> const all = plan.global(k);
      global_sizes.push_back(all.size());
      if (rank < 0) {
        lists.emplace_back(all.begin(), all.end());
      } else {
        auto const part = plan.slice(k, rank);
        lists.emplace_back(part.begin(), part.end());
      }
    }
    dparallel::loader batches(lists, make, {.num_workers = cfg.workers});
    double loss_sum = 0;
    std::size_t samples = 0, j = first;
    for (; j < plan.batches() && p.step < cfg.steps; ++j) {
      std::optional<gathered_batch> const made = batches.next();
      if (!made) throw std::logic_error("train_mlp: the loader ended before the epoch's last batch");
      r.data_wait_seconds += seconds(batches.last_wait()).count();
      double const loss = step(made->view(), batches.last_wait());
      sgd(master, lr);
      std::size_t const n = global_sizes[j - first];
      loss_sum += loss * static_cast<double>(n);
      samples += n;
      p.sampler.index = (j + 1) * per_rank;
      if (++p.step == early_steps) {
        early_taken = true;
        r.early_steps = early_steps;
        r.early = parameter_fingerprint(host_model(master));  // once; well under a millisecond
      }
    }
    if (j == plan.batches()) p.sampler = {.epoch = ++p.epoch, .index = 0};
    seconds const took = std::chrono::steady_clock::now() - begin;
    total += took;
    seen += samples;
    r.train_loss = loss_sum / static_cast<double>(samples);
    if (!reports) continue;
    r.test_accuracy = evaluate(host_model(master), data.test);
    evaluated = true;
    std::printf("epoch %d/%d  train_loss %.4f  test_accuracy %.4f  samples/s %.0f  (%.2f s)", epoch + 1, cfg.epochs,
                r.train_loss, r.test_accuracy, static_cast<double>(samples) / took.count(), took.count());
    if (first != 0 || j != plan.batches()) std::printf("  batches %zu-%zu of %zu", first + 1, j, plan.batches());
    std::printf("\n");
    std::fflush(stdout);
  }
  if (reports && !evaluated)  // no step ran: the start model's
    r.test_accuracy = evaluate(host_model(master), data.test);
  r.train_seconds = total.count();
  r.samples_per_s = seen == 0 ? 0.0 : static_cast<double>(seen) / total.count();
  r.params = parameter_fingerprint(host_model(master));
  r.steps = p.step;
  if (!early_taken) {
    r.early_steps = static_cast<std::size_t>(p.step);
    r.early = r.params;
  }
  if (reports) save_outputs(cfg, data, p, host_model(master));
  return r;
}

// ------------------------------------------------------------------------------------------------
// The modes: one function each, sharing everything above.

/// --profile in single mode: the loop's total wait for its batches (no wrapper, no step profile).
void print_single_profile(config const& cfg, result const& r) {
  if (!cfg.profile) return;
  std::printf("train_mlp: profile: data wait %.3f ms in total over %llu steps (--mode single has no wrapper, "
              "so no step profile)\n",
              r.data_wait_seconds * 1e3, static_cast<unsigned long long>(r.steps - r.start_step));
}

/// One device: the model runs the whole global batch itself. No wrapper, so no step profile:
/// --profile prints only the loop's total wait for its batches.
result run_single(config const& cfg, training_data const& data, start_point const& start) {
  mlp model = start.model;
  result r = train(cfg, data, start, model, -1, [&](batch const& b, std::chrono::nanoseconds) {
    return static_cast<double>(model.forward_backward(b));
  });
  r.devices = 1;
  print_single_profile(cfg, r);
  return r;
}

/// --profile: the wrapper's table of its mean step (rank 0 alone prints under DDP).
template <class Wrapper>
void print_profile(config const& cfg, Wrapper const& wrapper) {
  if (!cfg.profile) return;
  std::printf("%s", dparallel::format_profile(wrapper.profile()).c_str());
  std::fflush(stdout);
}

/// DataParallel over `cfg.devices` host logical devices: each step splits the global batch into
/// shards (torch.chunk), copies the master's parameters to the replicas, runs forward/backward on
/// every shard concurrently and reduces the shard-weighted gradients onto the master.
result run_dp(config const& cfg, training_data const& data, start_point const& start) {
  mlp model = start.model;
  dparallel::data_parallel<mlp> dp(model, dparallel::host::devices(cfg.devices));
  result r = train(cfg, data, start, dp.module(), -1, [&](batch const& b, std::chrono::nanoseconds waited) {
    dp.note_data_wait(waited);
    std::vector<float> const losses =
        dp.step(b, [](mlp& m, batch shard, dparallel::step_context&) { return m.forward_backward(shard); });
    // One mean loss per device that received a shard, in device order: weight each by its size.
    double sum = 0;
    std::size_t k = 0;
    for (std::size_t size : dp.last_shard_sizes())
      if (size != 0) sum += static_cast<double>(losses[k++]) * static_cast<double>(size);
    return sum / static_cast<double>(b.images.rows());
  });
  r.devices = cfg.devices;
  print_profile(cfg, dp);
  return r;
}

#if DPARALLEL_EXAMPLE_MPI
result run_ddp_mpi(config const& cfg, training_data const& data, start_point const& start);
#endif

/// DistributedDataParallel over `cfg.devices` thread ranks (dparallel::spawn): every rank holds a
/// replica, reads its own part of each global batch (distributed_sampler), and DDP averages the
/// gradients over the ranks with a bucketed all-reduce; every rank then runs the same SGD step.
/// With --comm mpi, run_ddp_mpi does the same with one rank per MPI process.
result run_ddp(config const& cfg, training_data const& data, start_point const& start) {
#if DPARALLEL_EXAMPLE_MPI
  if (cfg.comm == "mpi") return run_ddp_mpi(cfg, data, start);
#endif
  result out;
  dparallel::spawn(cfg.devices, [&](dparallel::rank_context& rank) {
    mlp model = start.model;
    dparallel::distributed_data_parallel<mlp> ddp(model, rank.group());
    result r = train(cfg, data, start, ddp.module(), rank.rank(), [&](batch const& b, std::chrono::nanoseconds waited) {
      ddp.note_data_wait(waited);
      float const loss =
          ddp.step(b, [](mlp& m, batch shard, dparallel::step_context&) { return m.forward_backward(shard); });
      // The global batch's mean loss, for the progress line: sum of (loss x samples) over ranks.
      std::array<double, 2> sums{static_cast<double>(loss) * static_cast<double>(b.images.rows()),
                                 static_cast<double>(b.images.rows())};
      rank.group().all_reduce(dparallel::view(sums)).wait();
      return sums[0] / sums[1];
    });
    if (rank.rank() == 0) {
      out = r;
      print_profile(cfg, ddp);
    }
  });
  out.devices = cfg.devices;
  return out;
}

/// This process's rank under --comm mpi or nccl (-1: the ranks, if any, are threads).
int process_rank = -1;

#if DPARALLEL_EXAMPLE_MPI
/// The MPI process group of --comm mpi (set by main; under --comm nccl, NCCL's bootstrap). Only in
/// builds with MPI: without, nothing sets it and GCC rightly flags its use as a null dereference.
dparallel::process_group const* mpi_group = nullptr;

/// DDP with one rank per MPI process: the same training as run_ddp, over the MPI group; each
/// process reads its own part of every global batch. Returns rank 0's result on rank 0.
result run_ddp_mpi(config const& cfg, training_data const& data, start_point const& start) {
  dparallel::process_group const& group = *mpi_group;
  mlp model = start.model;
  dparallel::distributed_data_parallel<mlp> ddp(model, group);
  result r = train(cfg, data, start, ddp.module(), group.rank(), [&](batch const& b, std::chrono::nanoseconds waited) {
    ddp.note_data_wait(waited);
    float const loss =
        ddp.step(b, [](mlp& m, batch shard, dparallel::step_context&) { return m.forward_backward(shard); });
    std::array<double, 2> sums{static_cast<double>(loss) * static_cast<double>(b.images.rows()),
                               static_cast<double>(b.images.rows())};
    group.all_reduce(dparallel::view(sums)).wait();
    return sums[0] / sums[1];
  });
  r.devices = group.size();
  if (group.rank() == 0) print_profile(cfg, ddp);
  return r;
}
#endif

#if DPARALLEL_EXAMPLE_CUDA
/// The NCCL process group of --comm nccl (set by main).
dparallel::distributed_group const* nccl_group = nullptr;

/// The training loop with a GPU runner as the master (rank as train() takes it).
result train_on_gpu(config const& cfg, training_data const& data, start_point const& start,
                    train_mlp_cuda::runner& run, int rank) {
  gpu_master master{&run, start.model};
  return train(cfg, data, start, master, rank,
               [&run](batch const& b, std::chrono::nanoseconds waited) { return run.step(b, waited); });
}

/// --profile: a GPU runner's wrapper table (rank 0 alone prints under DDP).
void print_gpu_profile(config const& cfg, train_mlp_cuda::runner const& run) {
  if (!cfg.profile) return;
  std::printf("%s", run.profile().c_str());
  std::fflush(stdout);
}

/// --backend cuda: the mode's runner (train_mlp_cuda.hpp) on the GPUs, through the same loop as the
/// host backend. ddp: thread ranks need one GPU each (NCCL); --comm nccl runs one rank per process.
result run_cuda(config const& cfg, training_data const& data, start_point const& start) {
  auto const announce = [](train_mlp_cuda::runner const& run) {
    std::printf("train_mlp: logical devices %s\n", run.devices().c_str());
    std::fflush(stdout);
  };
  if (cfg.mode == "single") {
    auto const run = train_mlp_cuda::make_single(start.model);
    announce(*run);
    result r = train_on_gpu(cfg, data, start, *run, -1);
    r.devices = 1;
    print_single_profile(cfg, r);
    return r;
  }
  if (cfg.mode == "dp") {
    auto const run = train_mlp_cuda::make_dp(start.model, cfg.devices);
    announce(*run);
    result r = train_on_gpu(cfg, data, start, *run, -1);
    r.devices = cfg.devices;
    print_gpu_profile(cfg, *run);
    return r;
  }
  if (cfg.comm == "nccl") {  // this process is one rank
    dparallel::distributed_group const& group = *nccl_group;
    auto const run = train_mlp_cuda::make_ddp(start.model, group, train_mlp_cuda::gpu_of(group));
    result r = train_on_gpu(cfg, data, start, *run, group.rank());
    r.devices = group.size();
    if (group.rank() == 0) print_gpu_profile(cfg, *run);
    return r;
  }
  // Thread ranks, one GPU each. A rank that fails aborts its group, so the others fail at once
  // instead of at the timeout; the first failure is reported.
  std::vector<dparallel::process_group> groups = train_mlp_cuda::make_nccl_groups(cfg.devices);
  result out;
  std::mutex m;
  std::exception_ptr first;
  std::vector<std::thread> ranks;
  for (int r = 0; r < cfg.devices; ++r) {
    ranks.emplace_back([&, r] {
      dparallel::process_group const& group = groups[static_cast<std::size_t>(r)];
      try {
        auto const run = train_mlp_cuda::make_ddp(start.model, group, r);
        result mine = train_on_gpu(cfg, data, start, *run, r);
        if (r == 0) {
          out = mine;
          print_gpu_profile(cfg, *run);
        }
      } catch (std::exception const& e) {
        {
          std::lock_guard lock(m);
          if (!first) first = std::current_exception();
        }
        group.abort("rank " + std::to_string(r) + " failed: " + e.what());
      }
    });
  }
  for (auto& t : ranks) t.join();
  if (first) std::rethrow_exception(first);
  out.devices = cfg.devices;
  return out;
}
#endif

struct mode {
  std::string_view name;
  result (*run)(config const&, training_data const&, start_point const&);
  std::string_view help;
};
constexpr std::array modes{
    mode{"single", &run_single, "one device runs every batch"},
    mode{"dp", &run_dp, "DataParallel over --devices logical devices (host threads, or GPUs / lanes of one GPU)"},
    mode{"ddp", &run_ddp,
         "DistributedDataParallel over --devices thread ranks, or MPI / NCCL processes (--comm mpi / nccl)"},
};

mode const* find_mode(std::string_view name) {
  for (auto const& m : modes)
    if (m.name == name) return &m;
  return nullptr;
}

// ------------------------------------------------------------------------------------------------
// Command line

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: train_mlp [options]\n"
               "Trains the 784-512-ReLU-10 MLP on Fashion-MNIST with SGD and reports test accuracy and throughput.\n"
               "\n"
               "  --mode M       ");
  for (std::size_t i = 0; i < modes.size(); ++i)
    std::fprintf(out, "%s%.*s", i == 0 ? "" : "|", static_cast<int>(modes[i].name.size()), modes[i].name.data());
  std::fprintf(out, " (default: single)\n");
  for (auto const& m : modes)
    std::fprintf(out, "                   %.*s: %.*s\n", static_cast<int>(m.name.size()), m.name.data(),
                 static_cast<int>(m.help.size()), m.help.data());
  std::fprintf(out,
               "  --backend K    host, cuda or auto (default: auto: cuda when a GPU is visible, else host;\n"
               "                 it prints which). cuda %s\n"
               "  --devices N    dp: logical devices, ddp: thread ranks (default: the hardware threads, %u\n"
               "                 here, one core each; cuda: the GPUs; dp on fewer GPUs puts lanes on GPU 0,\n"
               "                 ddp on cuda needs N GPUs); single: 1; ddp --comm mpi|nccl: the processes\n"
               "  --comm C       ddp only: thread (ranks are threads, default), mpi (ranks are MPI processes:\n"
               "                 mpirun -np N train_mlp --mode ddp --comm mpi) or nccl (ranks are processes,\n"
               "                 one GPU each, under mpirun or torchrun-style MASTER_ADDR/MASTER_PORT)\n"
               "                 mpi: %s; nccl: %s\n"
               "  --epochs E     passes over the 60000 training images (default: 5)\n"
               "  --batch B      global batch size, split across the devices in dp (default: 128)\n"
               "  --lr LR        SGD learning rate (default: 0.1)\n"
               "  --seed S       seeds the initialisation and the per-epoch shuffles (default: 1; --init\n"
               "                 replaces the initialisation, --resume brings the checkpoint's seed)\n"
               "  --sampler-replicas R  order the samples as DDP with R ranks reads them: global batch j is\n"
               "                 the concatenation of the R ranks' batch j (default: 1; ddp: --devices)\n"
               "  --data DIR     folder of the gzip'ed IDX files (default: %s)\n"
               "  --train-samples N  train on the first N training images only (quick runs; default: all)\n"
               "  --steps K      stop after K optimizer steps in total, counting those before --resume\n"
               "                 (default: no limit; --epochs still ends the run)\n"
               "  --workers N    N loader threads make each rank's batches ahead of training (default: 0,\n"
               "                 made on the training thread); the batches, hence the results, are the same\n"
               "  --profile      at the end, print where the mean step's time went (scatter, replicate,\n"
               "                 compute, reduce, gather, data wait; ddp: rank 0's); single: the data wait\n"
               "Files (safetensors; every process reads --init and --resume, rank 0 alone writes):\n"
               "  --init FILE    start from the model in FILE (a state dict as --save writes it) instead of\n"
               "                 the seeded initialisation; every name and shape must match\n"
               "  --save FILE    at the end, save the trained model to FILE as a state dict (tensors w1, b1,\n"
               "                 w2, b2; dp: the master model, ddp: rank 0's replica)\n"
               "  --save-checkpoint FILE  at the end (after the last epoch or at --steps), save the training\n"
               "                 state to FILE: model, epoch, step, sampler position, seed\n"
               "  --resume FILE  continue the run a --save-checkpoint FILE stopped, in any mode: its model,\n"
               "                 seed and position; --batch, --sampler-replicas and --train-samples must be\n"
               "                 those it was written with, --epochs and --steps count from the run's start\n"
               "Output and help:\n"
               "  --json         end with one line holding a JSON object of the results\n"
               "  --help         this text\n",
#if DPARALLEL_EXAMPLE_CUDA
               "is available in this build",
#else
               "is not available: this build found no CUDA",
#endif
               std::max(1u, std::thread::hardware_concurrency()),
#if DPARALLEL_EXAMPLE_MPI
               "available in this build",
#else
               "not available: this build found no MPI",
#endif
#if DPARALLEL_EXAMPLE_NCCL
               "available in this build",
#else
               "not available: this build found no NCCL",
#endif
               fashion_mnist::default_dir);
}

template <class Int>
Int parse_int(std::string_view option, std::string_view text, Int min, Int max) {
  Int v{};
  auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range ||
      (ec == std::errc{} && end == text.data() + text.size() && (v < min || v > max)))
    throw usage_error(std::string(option) + ": expected an integer from " + std::to_string(min) + " to " +
                      std::to_string(max) + ", found '" + std::string(text) + "'");
  if (ec != std::errc{} || end != text.data() + text.size())
    throw usage_error(std::string(option) + ": expected an integer, found '" + std::string(text) + "'");
  return v;
}

double parse_positive(std::string_view option, std::string_view text) {
  std::string const s(text);
  char* end = nullptr;
  double const v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || !(v > 0))
    throw usage_error(std::string(option) + ": expected a positive number, found '" + s + "'");
  return v;
}

/// Resolves --backend auto: CUDA when this build has it and a GPU is visible (and the ranks are not
/// MPI processes, whose engine reduces host memory), else the host. Returns why auto chose what it
/// chose (empty for an explicit --backend); sets cfg.gpus. Throws std::runtime_error (exit status
/// 1, not a usage error: the command is right, the machine lacks a GPU) for --backend cuda or
/// --comm nccl without a GPU.
std::string resolve_backend(config& cfg) {
  std::string why;
#if DPARALLEL_EXAMPLE_CUDA
  if (cfg.backend == "host") return why;
  cfg.gpus = train_mlp_cuda::device_count();
  std::string const none = cfg.gpus == 0 ? train_mlp_cuda::no_device_reason() : std::string();
  if (cfg.backend == "auto") {
    if (cfg.comm == "mpi") {
      cfg.backend = "host";
      why = "--comm mpi reduces host memory";
    } else if (cfg.gpus > 0) {
      cfg.backend = "cuda";
      why = std::to_string(cfg.gpus) + (cfg.gpus == 1 ? " GPU is" : " GPUs are") + " visible";
    } else {
      cfg.backend = "host";
      why = "no CUDA device: " + none;
    }
  }
  if (cfg.comm == "nccl" && cfg.gpus == 0)
    throw std::runtime_error("--comm nccl: NCCL runs on GPUs, and there is none (" + none +
                             "); on the host use --comm thread or mpi");
  if (cfg.backend == "cuda" && cfg.gpus == 0)
    throw std::runtime_error("--backend cuda: no CUDA device to run on (" + none +
                             "); use --backend host, or --backend auto (the host when there is no GPU)");
#else
  if (cfg.backend == "auto") {
    cfg.backend = "host";
    why = "this build of train_mlp has no CUDA";
  }
#endif
  return why;
}

config parse_command_line(int argc, char** argv) {
  config cfg;
  bool devices_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    std::string_view value;
    bool has_value = false;
    if (auto const eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto flag = [&] {
      if (has_value) throw usage_error(std::string(arg) + " takes no value");
    };
    auto next = [&]() -> std::string_view {
      if (has_value) return value;
      if (i + 1 >= argc) throw usage_error(std::string(arg) + ": expected a value after it");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      flag();
      cfg.help = true;
    } else if (arg == "--json") {
      flag();
      cfg.json = true;
    } else if (arg == "--mode") {
      cfg.mode = std::string(next());
      if (find_mode(cfg.mode) == nullptr) {
        std::string known;
        for (auto const& m : modes) known += (known.empty() ? "" : ", ") + std::string(m.name);
        throw usage_error("--mode: expected one of " + known + ", found '" + cfg.mode + "'");
      }
    } else if (arg == "--devices") {
      cfg.devices = parse_int<int>(arg, next(), 1, 1024);
      devices_given = true;
    } else if (arg == "--epochs") {
      cfg.epochs = parse_int<int>(arg, next(), 1, 100000);
    } else if (arg == "--batch") {
      cfg.global_batch = parse_int<std::size_t>(arg, next(), 1, 60000);
    } else if (arg == "--lr") {
      cfg.lr = parse_positive(arg, next());
    } else if (arg == "--seed") {
      cfg.seed = parse_int<std::uint64_t>(arg, next(), 0, UINT64_MAX);
      cfg.seed_given = true;
    } else if (arg == "--sampler-replicas") {
      cfg.sampler_replicas = parse_int<int>(arg, next(), 1, 1024);
    } else if (arg == "--backend") {
      cfg.backend = std::string(next());
      if (cfg.backend != "host" && cfg.backend != "cuda" && cfg.backend != "auto")
        throw usage_error("--backend: expected host, cuda or auto, found '" + cfg.backend + "'");
#if !DPARALLEL_EXAMPLE_CUDA
      if (cfg.backend == "cuda")
        throw usage_error("--backend cuda: this build of train_mlp has no CUDA (CMake found no CUDA toolkit; install "
                          "it, e.g. under /usr/local/cuda, then reconfigure)");
#endif
    } else if (arg == "--comm") {
      cfg.comm = std::string(next());
      if (cfg.comm != "thread" && cfg.comm != "mpi" && cfg.comm != "nccl")
        throw usage_error("--comm: expected thread, mpi or nccl, found '" + cfg.comm + "'");
#if !DPARALLEL_EXAMPLE_MPI
      if (cfg.comm == "mpi")
        throw usage_error("--comm mpi: this build of train_mlp has no MPI (CMake found none; Debian: apt-get install "
                          "libopenmpi-dev openmpi-bin, then reconfigure)");
#endif
#if !DPARALLEL_EXAMPLE_NCCL
      if (cfg.comm == "nccl")
        throw usage_error("--comm nccl: this build of train_mlp has no NCCL (CMake found no CUDA toolkit or no NCCL; "
                          "set NCCL_ROOT, then reconfigure)");
#endif
    } else if (arg == "--data") {
      cfg.data = std::string(next());
      if (cfg.data.empty()) throw usage_error("--data: expected a folder, found an empty string");
    } else if (arg == "--train-samples") {
      cfg.train_samples = parse_int<std::size_t>(arg, next(), 1, std::numeric_limits<std::uint32_t>::max());
    } else if (arg == "--workers") {
      cfg.workers = parse_int<std::size_t>(arg, next(), 0, 256);
    } else if (arg == "--profile") {
      flag();
      cfg.profile = true;
    } else if (arg == "--steps") {
      cfg.steps = parse_int<std::uint64_t>(arg, next(), 0, std::numeric_limits<std::uint64_t>::max() - 1);
    } else if (arg == "--init" || arg == "--resume" || arg == "--save" || arg == "--save-checkpoint") {
      std::string& file = arg == "--init" ? cfg.init
                          : arg == "--resume" ? cfg.resume
                          : arg == "--save"   ? cfg.save
                                              : cfg.save_checkpoint;
      file = std::string(next());
      if (file.empty()) throw usage_error(std::string(arg) + ": expected a file name, found an empty string");
    } else {
      throw usage_error("unknown option '" + std::string(argv[i]) + "'");
    }
  }
  if (!cfg.init.empty() && !cfg.resume.empty())
    throw usage_error("--init " + cfg.init + " --resume " + cfg.resume +
                      ": a checkpoint holds the model already; pass one of them");
  if (!cfg.save.empty() && cfg.save == cfg.save_checkpoint)
    throw usage_error("--save and --save-checkpoint: expected two files, found " + cfg.save + " twice");
  if (cfg.comm == "mpi" && cfg.mode != "ddp")
    throw usage_error("--comm mpi: only --mode ddp runs over MPI processes, found --mode " + cfg.mode);
  if (cfg.comm == "nccl" && cfg.mode != "ddp")
    throw usage_error("--comm nccl: only --mode ddp runs over NCCL processes, found --mode " + cfg.mode);
  if (cfg.comm == "mpi" && cfg.backend == "cuda")
    throw usage_error("--comm mpi --backend cuda: the MPI engine reduces host memory; on GPUs use --comm nccl "
                      "(under mpirun, MPI carries NCCL's unique id)");
  if (cfg.comm == "nccl" && cfg.backend == "host")
    throw usage_error("--comm nccl --backend host: NCCL reduces GPU memory; on the host use --comm thread or mpi");
  if (!cfg.help) cfg.backend_reason = resolve_backend(cfg);  // throws std::runtime_error (exit 1) without a GPU
  // The world size, hence devices and sampler replicas, come from the launch: see main.
  if (cfg.comm == "mpi" || cfg.comm == "nccl") return cfg;
  if (cfg.mode == "single") {
    if (devices_given && cfg.devices != 1)
      throw usage_error("--devices " + std::to_string(cfg.devices) +
                        ": --mode single runs on one device; use --mode dp for several");
    cfg.devices = 1;
  } else if (!devices_given) {
    cfg.devices = cfg.backend == "cuda" ? std::max(1, cfg.gpus)
                                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  if (cfg.mode == "ddp") {
    if (cfg.sampler_replicas != 0 && cfg.sampler_replicas != cfg.devices)
      throw usage_error("--sampler-replicas " + std::to_string(cfg.sampler_replicas) +
                        ": --mode ddp reads the data as its " + std::to_string(cfg.devices) + " ranks do");
    cfg.sampler_replicas = cfg.devices;
  } else if (cfg.sampler_replicas == 0) {
    cfg.sampler_replicas = 1;
  }
  if (cfg.global_batch % static_cast<std::size_t>(cfg.sampler_replicas) != 0)
    throw usage_error("--batch " + std::to_string(cfg.global_batch) + ": expected a multiple of the " +
                      std::to_string(cfg.sampler_replicas) + " sampler replicas (ranks), which share it equally");
  return cfg;
}

#if DPARALLEL_EXAMPLE_MPI || DPARALLEL_EXAMPLE_NCCL
/// --comm mpi or nccl: the ranks are the processes of the launch. Checks --devices and
/// --sampler-replicas against the world size and the batch's divisibility, as parse_command_line
/// does for thread ranks.
void apply_world(config& cfg, int world) {
  if (cfg.devices != 0 && cfg.devices != world)
    throw usage_error("--devices " + std::to_string(cfg.devices) + ": under --comm " + cfg.comm +
                      " the ranks are the " + std::to_string(world) +
                      " processes of the launch (mpirun -np, torchrun --nproc-per-node); leave --devices out");
  if (cfg.sampler_replicas != 0 && cfg.sampler_replicas != world)
    throw usage_error("--sampler-replicas " + std::to_string(cfg.sampler_replicas) +
                      ": --mode ddp reads the data as its " + std::to_string(world) + " ranks do");
  cfg.devices = world;
  cfg.sampler_replicas = world;
  if (cfg.global_batch % static_cast<std::size_t>(world) != 0)
    throw usage_error("--batch " + std::to_string(cfg.global_batch) + ": expected a multiple of the " +
                      std::to_string(world) + " sampler replicas (ranks), which share it equally");
}
#endif

// ------------------------------------------------------------------------------------------------
// Output

/// The shortest text that reads back as `v` (JSON null when not finite).
std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  char s[64];
  auto const [end, ec] = std::to_chars(s, s + sizeof s, v);
  return ec == std::errc{} ? std::string(s, end) : "null";
}
/// `v` with 17 significant digits (JSON null when not finite).
std::string exact(double v) {
  if (!std::isfinite(v)) return "null";
  char s[64];
  std::snprintf(s, sizeof s, "%.17g", v);
  return s;
}

std::string to_json(config const& cfg, result const& r, training_data const& data) {
  return "{\"mode\":\"" + cfg.mode + "\",\"backend\":\"" + cfg.backend + "\"" +
         (cfg.mode == "ddp" ? ",\"comm\":\"" + cfg.comm + "\"" : std::string()) +
         ",\"devices\":" + std::to_string(r.devices) +
         ",\"epochs\":" + std::to_string(cfg.epochs) + ",\"global_batch\":" + std::to_string(cfg.global_batch) +
         ",\"lr\":" + number(cfg.lr) + ",\"seed\":" + std::to_string(cfg.seed) +
         ",\"sampler_replicas\":" + std::to_string(cfg.sampler_replicas) +
         ",\"train_samples\":" + std::to_string(data.train.size()) +
         ",\"test_samples\":" + std::to_string(data.test.size()) + ",\"test_accuracy\":" + number(r.test_accuracy) +
         ",\"train_loss\":" + number(r.train_loss) + ",\"samples_per_s\":" + number(r.samples_per_s) +
         ",\"train_seconds\":" + number(r.train_seconds) + ",\"param_sum\":" + exact(r.params.sum) +
         ",\"param_l2\":" + exact(r.params.l2) + ",\"early_steps\":" + std::to_string(r.early_steps) +
         ",\"early_param_sum\":" + exact(r.early.sum) + ",\"early_param_l2\":" + exact(r.early.l2) +
         ",\"start_step\":" + std::to_string(r.start_step) + ",\"steps\":" + std::to_string(r.steps) + "}";
}

}  // namespace

int main(int argc, char** argv) {
  config cfg;
  try {
    cfg = parse_command_line(argc, argv);
  } catch (usage_error const& e) {
    std::fprintf(stderr, "train_mlp: %s\nRun train_mlp --help for the options.\n", e.what());
    return 2;
  } catch (std::exception const& e) {  // a right command on a machine that cannot run it (no GPU)
    std::fprintf(stderr, "train_mlp: error: %s\n", e.what());
    return 1;
  }
  if (cfg.help) {
    print_usage(stdout);
    return 0;
  }

  // One device is one core: OpenBLAS must not start threads of its own under dparallel's.
  openblas_set_num_threads(1);

#if DPARALLEL_EXAMPLE_MPI
  // --comm mpi: this process is one rank of the MPI job; the world size is the number of ranks.
  // --comm nccl under mpirun (no MASTER_ADDR): the MPI group carries NCCL's unique id.
  std::optional<dparallel::distributed_group> world;
  if (cfg.comm == "mpi" || (cfg.comm == "nccl" && std::getenv("MASTER_ADDR") == nullptr)) {
    try {
      world = dparallel::mpi::init_process_group();
      mpi_group = &*world;
      process_rank = world->rank();
      if (cfg.comm == "mpi") apply_world(cfg, world->size());
    } catch (usage_error const& e) {
      if (process_rank <= 0) std::fprintf(stderr, "train_mlp: %s\nRun train_mlp --help for the options.\n", e.what());
      return 2;
    } catch (std::exception const& e) {
      std::fprintf(stderr, "train_mlp: error: %s\n", e.what());
      return 1;
    }
  }
#endif
#if DPARALLEL_EXAMPLE_NCCL
  // --comm nccl: this process is one rank of an NCCL group over the launch's processes (rank 0's
  // unique id through MPI as above, else through the TCP rendezvous at MASTER_ADDR:MASTER_PORT).
  std::optional<dparallel::distributed_group> nccl_world;
  if (cfg.comm == "nccl") {
    try {
#if DPARALLEL_EXAMPLE_MPI
      dparallel::process_group const bootstrap = world ? dparallel::process_group(*world) : dparallel::process_group{};
#else
      dparallel::process_group const bootstrap;  // none: the TCP rendezvous (env://)
#endif
      nccl_world = train_mlp_cuda::init_nccl_process_group(bootstrap);
      nccl_group = &*nccl_world;
      process_rank = nccl_world->rank();
      apply_world(cfg, nccl_world->size());
    } catch (usage_error const& e) {
      if (process_rank <= 0) std::fprintf(stderr, "train_mlp: %s\nRun train_mlp --help for the options.\n", e.what());
      return 2;
    } catch (std::exception const& e) {
      std::fprintf(stderr, "train_mlp: error: %s\n", e.what());
      return 1;
    }
  }
#endif
  bool const prints = process_rank <= 0;  // with process ranks, rank 0 alone reports
  std::string const who = process_rank < 0 ? std::string() : "rank " + std::to_string(process_rank) + ": ";

  try {
    check_outputs_writable(cfg);
    start_point const start = load_start(cfg);  // before the data: a bad file fails fast
    cfg.seed = start.progress.seed;              // --resume: the checkpoint's
    training_data const data{
        fashion_mnist::load(cfg.data, "train",
                            cfg.train_samples == 0 ? std::numeric_limits<std::size_t>::max() : cfg.train_samples),
        fashion_mnist::load(cfg.data, "t10k")};
    if (cfg.train_samples > data.train.size())
      throw usage_error("--train-samples " + std::to_string(cfg.train_samples) + ": expected at most the " +
                        std::to_string(data.train.size()) + " images of the training set");
    check_resume(cfg, start, data);
    if (prints) {
      if (!cfg.backend_reason.empty())
        std::printf("train_mlp: backend auto chose %s (%s)\n", cfg.backend.c_str(), cfg.backend_reason.c_str());
      if (process_rank < 0)
        std::printf("train_mlp: mode %s on %d %s device%s, %zu training / %zu test images from %s\n",
                    cfg.mode.c_str(), cfg.devices, cfg.backend.c_str(), cfg.devices == 1 ? "" : "s",
                    data.train.size(), data.test.size(), cfg.data.c_str());
      else
        std::printf("train_mlp: mode %s over %d %s processes, %zu training / %zu test images from %s\n",
                    cfg.mode.c_str(), cfg.devices, cfg.comm == "nccl" ? "NCCL" : "MPI", data.train.size(),
                    data.test.size(), cfg.data.c_str());
      std::printf("train_mlp: %d epoch%s, global batch %zu, lr %s, seed %llu\n", cfg.epochs,
                  cfg.epochs == 1 ? "" : "s", cfg.global_batch, number(cfg.lr).c_str(),
                  static_cast<unsigned long long>(cfg.seed));
      if (!cfg.init.empty()) std::printf("train_mlp: starting from the model in %s\n", cfg.init.c_str());
      if (start.resumed)
        std::printf("train_mlp: resuming %s at epoch %llu, step %llu\n", cfg.resume.c_str(),
                    static_cast<unsigned long long>(start.progress.epoch),
                    static_cast<unsigned long long>(start.progress.step));
      std::fflush(stdout);
    }

#if DPARALLEL_EXAMPLE_CUDA
    result const r = cfg.backend == "cuda" ? run_cuda(cfg, data, start) : find_mode(cfg.mode)->run(cfg, data, start);
#else
    result const r = find_mode(cfg.mode)->run(cfg, data, start);
#endif

    if (prints) {
      std::printf("train_mlp: test_accuracy %.4f  train_loss %.4f  samples/s %.0f  param_sum %s  param_l2 %s\n",
                  r.test_accuracy, r.train_loss, r.samples_per_s, exact(r.params.sum).c_str(),
                  exact(r.params.l2).c_str());
      if (cfg.json) std::printf("%s\n", to_json(cfg, r, data).c_str());
      std::fflush(stdout);
    }
  } catch (std::exception const& e) {
    std::fflush(stdout);
    // A device_error's text names the device, a comm_error's the rank at fault.
    std::fprintf(stderr, "train_mlp: %serror: %s\n", who.c_str(), e.what());
    return 1;
  }
  return 0;
}

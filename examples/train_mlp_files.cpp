// train_mlp's files: --init and --resume read before training, --save and --save-checkpoint
// checked before training and written after it (rank 0 alone).
#include "train_mlp.hpp"

#include <dparallel/io/state_dict.hpp>

#include <cerrno>
#include <filesystem>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>

#include <unistd.h>  // getpid

namespace example {

/// Reads --init or --resume (every process does, before any wrapper or rank exists): the
/// seeded model, or the state dict of --init (strict: every name and shape must match), or the
/// model and progress of the checkpoint of --resume. Errors name the option and the file.
start_point load_start(config const& cfg) {
  start_point s{mlp(cfg.seed)};
  s.model.split = model_blocking(cfg);  // every mode copies the model: its replicas inherit it
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
    dparallel::checkpoint ckpt(s.model);  // the model; train() loads it again with the optimizer's state
    try {
      ckpt.load(cfg.resume, {.strict = cfg.optimizer == "sgd"});  // sgd (with or without weight decay) has none
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
/// sampler position depends on, which save_outputs records), so that resuming continues it exactly;
/// the sampler replicas may differ at an epoch's end (the position is 0 for any replica count).
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
    // At an epoch's end no replica has read anything of the next epoch: any replica count (world
    // size) continues it, e.g. a --zero 1 run saved on N ranks and resumed on M.
    bool const at_epoch_start = start.progress.sampler.index == 0;
    if (it->second != std::to_string(s.value) && !(at_epoch_start && std::string_view(s.key) == "sampler_replicas"))
      throw std::runtime_error("--resume " + cfg.resume + ": the checkpoint was written by a run with " + s.option +
                               " " + it->second + ", found " + s.option + " " + std::to_string(s.value) +
                               "; resume with the settings it was written with (its sampler position counts "
                               "their batches)");
  }
}

/// Writes --save and --save-checkpoint (rank 0 only): the model `m`, and the training state
/// `progress` with the settings that give its sampler position a meaning.
void save_outputs(config const& cfg, training_data const& data, dparallel::training_progress const& progress, mlp& m,
                  std::function<void(dparallel::checkpoint&)> const& add_optimizer_state) {
  if (!cfg.save.empty()) {
    dparallel::save_state_dict(cfg.save, m, {{"steps", std::to_string(progress.step)}});
    std::printf("train_mlp: saved the model after %llu steps to %s\n",
                static_cast<unsigned long long>(progress.step), cfg.save.c_str());
  }
  if (!cfg.save_checkpoint.empty()) {
    dparallel::checkpoint ckpt(m);
    if (add_optimizer_state) add_optimizer_state(ckpt);  // momentum, adam, adamw: their state
    ckpt.progress() = progress;
    ckpt.progress().extra = {{"global_batch", std::to_string(cfg.global_batch)},
                             {"sampler_replicas", std::to_string(cfg.sampler_replicas)},
                             {"train_samples", std::to_string(data.train.size())},
                             {"mode", cfg.mode}};
    for (char const* key : {"zero.set", "zero.step"})  // --zero 1: the optimizer save this checkpoint goes with
      if (auto const it = progress.extra.find(key); it != progress.extra.end()) ckpt.progress().extra.insert(*it);
    ckpt.save(cfg.save_checkpoint);
    std::printf("train_mlp: saved a checkpoint (epoch %llu, step %llu) to %s\n",
                static_cast<unsigned long long>(progress.epoch), static_cast<unsigned long long>(progress.step),
                cfg.save_checkpoint.c_str());
  }
  std::fflush(stdout);
}

}  // namespace example

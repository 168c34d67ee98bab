#pragma once
// checkpoint: the whole training state in one safetensors file, for exact resume. Resuming from
// a checkpoint taken after k steps gives bitwise the same parameters as never stopping, provided
// everything that shapes the run is in it: the model (parameters and buffers), the optimizer's
// tensors (momentum, Adam moments, ...), and the position of the data stream.
//
//   std::vector<std::vector<float>> momentum = ...;        // the user's optimizer state
//   dparallel::checkpoint ckpt(ddp);                       // a model or a DP/DDP wrapper
//   for (std::size_t i = 0; i < momentum.size(); ++i)
//     ckpt.add("momentum." + std::to_string(i), dparallel::view(momentum[i]));
//
//   // saving (in DDP on rank 0 only):
//   ckpt.progress() = {.epoch = epoch, .step = step, .sampler = {epoch, index_in_epoch}, .seed = seed};
//   if (rank == 0) ckpt.save("run.ckpt.safetensors");
//
//   // resuming (a fresh process, everything rebuilt the same way; in DDP on every rank):
//   ckpt.load("run.ckpt.safetensors");                     // fills the model, momentum and progress()
//   dparallel::distributed_sampler sampler(n, rank, {.shuffle = true, .seed = ckpt.progress().seed,
//                                                     .order = ckpt.progress().sampler.order});
//   sampler.set_epoch(ckpt.progress().sampler.epoch);
//   // ... continue from sampler.indices()[ckpt.progress().sampler.index] on
//
// File layout: the model's tensors are named "model.<name>" (the names of state_dict()), the
// registered tensors "optimizer.<name>"; the scalars are decimal strings in __metadata__
// ("dparallel.checkpoint" = "1", "epoch", "step", "sampler.epoch", "sampler.index", "seed", and
// "user.<key>" for progress().extra), and "sampler.order" names the shuffle order ("torch" or
// "splitmix64"; a file without it was written before dparallel had a second order: splitmix64).
// The file is a plain safetensors file: Python reads it with safetensors.safe_open or the
// standard library.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/data/distributed_sampler.hpp>
#include <dparallel/core/detail/printable.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// The scalars of a training run that a checkpoint keeps besides the tensors.
struct training_progress {
  std::uint64_t epoch = 0;      ///< the epoch in progress
  std::uint64_t step = 0;       ///< optimizer steps done so far (drives the learning-rate schedule)
  sampler_position sampler{};   ///< where the data stream stands
  std::uint64_t seed = 0;       ///< the run's seed (sampler shuffling, dropout, ...)
  safetensors_metadata extra{};  ///< any other strings the run needs (stored as "user.<key>")
  friend bool operator==(training_progress const&, training_progress const&) = default;
};

namespace detail {
inline std::uint64_t parse_u64(safetensors_metadata const& meta, std::string const& key, std::string const& where) {
  auto const it = meta.find(key);
  if (it == meta.end())
    throw error("dparallel: " + where + " is not a complete dparallel checkpoint: its __metadata__ has no '" + key +
                "'");
  std::string const& s = it->second;
  std::uint64_t r = 0;
  bool ok = !s.empty() && s.size() <= 20;
  for (char c : s) {
    if (!ok) break;
    if (c < '0' || c > '9') {
      ok = false;
      break;
    }
    auto const d = static_cast<std::uint64_t>(c - '0');
    ok = r <= (std::numeric_limits<std::uint64_t>::max() - d) / 10;
    r = r * 10 + d;
  }
  if (!ok)
    throw error("dparallel: " + where + ": expected the checkpoint's __metadata__ '" + key +
                "' to be an unsigned decimal integer below 2^64, found " + in_quotes(s));
  return r;
}

/// The name "sampler.order" stores for `o`.
constexpr std::string_view shuffle_order_name(shuffle_order o) noexcept { return name_of(o); }

/// "sampler.order" of `meta`; splitmix64 when absent (a file from before the key, when that was
/// dparallel's only order).
inline shuffle_order parse_shuffle_order(safetensors_metadata const& meta, std::string const& where) {
  auto const it = meta.find("sampler.order");
  if (it == meta.end()) return shuffle_order::splitmix64;
  for (shuffle_order o : {shuffle_order::torch, shuffle_order::splitmix64})
    if (it->second == shuffle_order_name(o)) return o;
  throw error("dparallel: " + where +
              ": expected the checkpoint's __metadata__ 'sampler.order' to be 'torch' or 'splitmix64', found " +
              in_quotes(it->second));
}
}  // namespace detail

/// The training state of one run: a model (or wrapper), the tensors the user registers (the
/// optimizer's), and training_progress. The model and the registered tensors are referenced, not
/// copied: they must outlive the checkpoint object, and the registered views must stay valid.
class checkpoint {
 public:
  /// Name of the format marker in __metadata__ and its value.
  static constexpr std::string_view format_key = "dparallel.checkpoint";
  /// The checkpoint format this code writes, stored in the file's metadata.
  static constexpr std::string_view format_version = "1";

  /// A checkpoint of `model_or_wrapper` (a model, or a DP/DDP wrapper whose module() is saved).
  template <class X>
    requires model<std::remove_cvref_t<decltype(detail::unwrap_model(std::declval<X&>()))>>
  explicit checkpoint(X& model_or_wrapper) : model_([&model_or_wrapper] { return state_dict(model_or_wrapper); }) {
    (void)state_dict(model_or_wrapper);  // validate the names now rather than at the first save
  }

  /// Registers an optimizer tensor under `name` (stored as "optimizer.<name>").
  checkpoint& add(std::string name, tensor_ref tensor, std::optional<std::vector<std::uint64_t>> shape = std::nullopt) {
    for (auto const& t : optimizer_)
      detail::require(t.name != name, "checkpoint::add: a tensor named '" + name + "' is already registered");
    optimizer_.push_back({std::move(name), tensor, std::move(shape)});
    return *this;
  }
  /// Registers every tensor of `tensors` as "<prefix>.0", "<prefix>.1", ...
  template <tensor_range R>
  checkpoint& add_all(std::string const& prefix, R&& tensors) {
    std::size_t i = 0;
    for (auto&& t : tensors) add(prefix + "." + std::to_string(i++), tensor_ref(t));
    return *this;
  }

  /// The training position saved with the checkpoint (epoch, step, sampler, seed); set it before save().
  [[nodiscard]] training_progress& progress() noexcept { return progress_; }
  /// The training position saved with, or loaded from, the checkpoint.
  [[nodiscard]] training_progress const& progress() const noexcept { return progress_; }

  /// The tensors a save writes, with their names in the file.
  [[nodiscard]] std::vector<named_tensor> tensors() const {
    std::vector<named_tensor> out = model_();
    for (auto& t : out) t.name = "model." + t.name;
    for (auto const& t : optimizer_) out.push_back({"optimizer." + t.name, t.data, t.shape});
    return out;
  }

  /// Writes the training state to `path` atomically (in DDP, call it on rank 0 only).
  void save(std::filesystem::path const& path) const {
    safetensors_metadata meta;
    for (auto const& [k, v] : progress_.extra) meta.emplace("user." + k, v);
    meta[std::string(format_key)] = std::string(format_version);
    meta["epoch"] = std::to_string(progress_.epoch);
    meta["step"] = std::to_string(progress_.step);
    meta["sampler.epoch"] = std::to_string(progress_.sampler.epoch);
    meta["sampler.index"] = std::to_string(progress_.sampler.index);
    meta["sampler.order"] = std::string(detail::shuffle_order_name(progress_.sampler.order));
    meta["seed"] = std::to_string(progress_.seed);
    save_safetensors(path, tensors(), meta);
  }

  /// Restores the model, the registered tensors and progress() from `path` (in DDP, on every
  /// rank). Strict by default: the file must hold exactly the model's and the registered tensors.
  /// Everything is checked before anything changes: on error, model, tensors and progress() are
  /// as they were (the tensors are staged and the file checked unchanged first: see state_dict.hpp).
  load_result load(std::filesystem::path const& path, load_options opts = {}) {
    safetensors_reader const file(path);
    std::string const where = detail::in_quotes(path.string());
    auto const& meta = file.metadata();
    auto const marker = meta.find(std::string(format_key));
    if (marker == meta.end())
      throw error("dparallel: " + where + " is not a dparallel checkpoint (its __metadata__ has no '" +
                  std::string(format_key) + "'); a state dict is loaded with load_state_dict");
    if (marker->second != format_version)
      throw error("dparallel: " + where + " is a dparallel checkpoint of version " + detail::in_quotes(marker->second) +
                  "; this version of dparallel reads version '" + std::string(format_version) + "'");
    training_progress p;
    p.epoch = detail::parse_u64(meta, "epoch", where);
    p.step = detail::parse_u64(meta, "step", where);
    p.sampler.epoch = detail::parse_u64(meta, "sampler.epoch", where);
    p.sampler.index = detail::parse_u64(meta, "sampler.index", where);
    p.sampler.order = detail::parse_shuffle_order(meta, where);
    p.seed = detail::parse_u64(meta, "seed", where);
    for (auto const& [k, v] : meta)
      if (k.starts_with("user.")) p.extra.emplace(k.substr(5), v);
    auto result = detail::load_named(file, tensors(), opts, {}, "training state");
    progress_ = std::move(p);
    return result;
  }

 private:
  std::function<std::vector<named_tensor>()> model_;
  std::vector<named_tensor> optimizer_;
  training_progress progress_;
};

DPARALLEL_NAMESPACE_END

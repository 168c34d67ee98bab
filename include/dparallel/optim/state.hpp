#pragma once
// An optimizer's state as named tensors: state dicts, files of their own and checkpoints.
//
//   auto tensors = dparallel::optim::state_dict(opt, model);   // "fc1.weight.exp_avg", ..., "adam.step"
//   dparallel::optim::save_state("opt.safetensors", opt, model);  // atomic; names "optim.<name>"
//   dparallel::optim::load_state("opt.safetensors", opt, model);  // validated; all or nothing
//
//   dparallel::checkpoint ckpt(ddp);                            // the whole training state in one file
//   dparallel::optim::add_to(ckpt, opt, ddp);                   // as "optimizer.<name>"
//
// Names. Slot k of parameter "fc1.weight" (the model's parameter names: see io/state_dict.hpp) is
// "fc1.weight.<slot name>" ("momentum_buffer", "exp_avg", "exp_avg_sq"), f32, shaped as the
// parameter; the step count is "<rule name>.step", i64 of shape [1]. The rule's name in the step
// tensor makes the state of one optimizer type fail to load into another (Adam into AdamW: the
// file lacks "adamw.step" and has "adam.step" instead), even when their slots agree. Slots the rule
// keeps no storage for (plain SGD's momentum buffer) are not saved, as PyTorch saves none. The F32
// master copy of a 16-bit parameter (optimizer_options::master_weights) is "<parameter name>.master",
// f32, shaped as the parameter.
//
// Loading checks names, dtypes and shapes of everything before changing anything, reads through a
// staging buffer and checks that the file did not change meanwhile (io/state_dict.hpp): an error
// names the file and the tensors, and leaves the optimizer (slots and step count) as it was.
// Files of their own also record the rule in their metadata ("dparallel.optimizer"), checked first.
// The state must be in host memory (an optimizer of the host backend) to be saved or loaded.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/core/detail/printable.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/optim/optimizer.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// The metadata key naming the rule in a file written by save_state.
inline constexpr std::string_view optimizer_metadata_key = "dparallel.optimizer";
/// The prefix of the tensor names in a file written by save_state.
inline constexpr std::string_view state_file_prefix = "optim.";
/// The metadata key of a sharded ZeRO save's manifest (optim/zero_checkpoint.hpp): the world size
/// of the shard set it names. Such a file holds no tensor: load_zero_state reads it.
inline constexpr std::string_view zero_manifest_key = "dparallel.zero.manifest";

/// The state of `opt` (built for `model_or_wrapper`) as named tensors: every kept slot of every
/// parameter, named "<parameter name>.<slot name>" and shaped as the parameter (and its master
/// copy "<parameter name>.master" when it has one), then the step
/// count "<rule name>.step". The tensors are views of the optimizer's memory.
template <class R, class B, class X>
std::vector<named_tensor> state_dict(optimizer<R, B>& opt, X& model_or_wrapper) {
  opt.check(model_or_wrapper);
  auto const model_tensors = dparallel::state_dict(model_or_wrapper);  // parameters first, then buffers
  std::vector<named_tensor> out;
  for (std::size_t i = 0; i < opt.parameter_count(); ++i) {
    for (std::size_t k = 0; k < opt.slots_kept(); ++k)
      out.push_back({model_tensors[i].name + "." + std::string(R::slot_names[k]), opt.slot(i, k),
                     model_tensors[i].shape});
    if (opt.has_master(i))
      out.push_back({model_tensors[i].name + "." + std::string(master_slot_name), opt.master(i), model_tensors[i].shape});
  }
  out.push_back({std::string(detail::rule_name<R>()) + ".step", opt.step_tensor(), std::vector<std::uint64_t>{1}});
  return out;
}

/// Writes the state of `opt` to `path` (safetensors, atomically), names prefixed with "optim.", the
/// rule's name in the metadata. In DDP every rank holds the same state: save on rank 0.
template <class R, class B, class X>
void save_state(std::filesystem::path const& path, optimizer<R, B>& opt, X& model_or_wrapper) {
  auto tensors = state_dict(opt, model_or_wrapper);
  for (auto& t : tensors) t.name = std::string(state_file_prefix) + t.name;
  save_safetensors(path, tensors,
                   {{"format", "pt"}, {std::string(optimizer_metadata_key), std::string(detail::rule_name<R>())}});
}

/// Restores the state of `opt` (built for `model_or_wrapper`) from a file written by save_state,
/// strictly: the file must hold this rule's state for this model, every tensor of it. On error
/// (another optimizer, another model, a missing or mismatched tensor, a damaged file) it throws
/// dparallel::error naming the file and the tensors, and `opt` is unchanged.
template <class R, class B, class X>
void load_state(std::filesystem::path const& path, optimizer<R, B>& opt, X& model_or_wrapper) {
  auto const targets = state_dict(opt, model_or_wrapper);
  safetensors_reader const file(path);
  std::string const want(detail::rule_name<R>());
  auto const it = file.metadata().find(std::string(optimizer_metadata_key));
  if (file.metadata().contains(std::string(zero_manifest_key)))
    throw error("dparallel: " + dparallel::detail::in_quotes(path.string()) +
                " is the manifest of a sharded ZeRO-1 save (its state is in the shard files it names); load it "
                "with optim::load_zero_state on a zero_redundancy_optimizer, or save with zero_save_mode::gathered "
                "to resume on one device or plain DDP");
  if (it == file.metadata().end())
    throw error("dparallel: " + dparallel::detail::in_quotes(path.string()) +
                " holds no optimizer state (its __metadata__ has no '" + std::string(optimizer_metadata_key) +
                "'); expected a file written by optim::save_state for optimizer '" + want + "'");
  if (it->second != want)
    throw error("dparallel: " + dparallel::detail::in_quotes(path.string()) + " holds the state of optimizer " +
                dparallel::detail::in_quotes(it->second) + ", expected '" + want +
                "'; build the optimizer the file was saved from, or start this one afresh");
  dparallel::detail::load_named(file, targets, {.strict = true},
                                {.strip_module = false, .prefix = std::string(state_file_prefix)},
                                "optimizer '" + want + "'");
}

/// Registers the state of `opt` with `ckpt` (as "optimizer.<name>"): the checkpoint then saves and
/// loads it with the model, validated and all or nothing (io/checkpoint.hpp). The tensors are
/// views of the optimizer's memory: `opt` must outlive `ckpt`.
template <class R, class B, class X>
void add_to(checkpoint& ckpt, optimizer<R, B>& opt, X& model_or_wrapper) {
  for (auto& t : state_dict(opt, model_or_wrapper)) ckpt.add(std::move(t.name), t.data, std::move(t.shape));
}

namespace detail {
template <class>
inline constexpr bool not_an_optimizer = false;
}  // namespace detail

/// Any other optimizer type: a compile-time error that names the way to save it. A ZeRO-1
/// optimizer (zero_redundancy_optimizer) holds only this rank's shard of the state, which a
/// checkpoint of whole tensors cannot hold.
template <class Opt, class X>
void add_to(checkpoint&, Opt&, X&) {
  static_assert(detail::not_an_optimizer<Opt>,
                "dparallel: optim::add_to takes an optim::optimizer; a zero_redundancy_optimizer (ZeRO-1) keeps only "
                "this rank's shard of the state: save it with optim::save_zero_state(path, opt, mode) and load it "
                "with optim::load_zero_state(path, opt) (<dparallel/optim/zero_checkpoint.hpp>), beside the "
                "checkpoint");
}

}  // namespace optim

DPARALLEL_NAMESPACE_END

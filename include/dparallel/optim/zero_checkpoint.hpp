#pragma once
// ZeRO-1 optimizer state in files that reshard: saved from N ranks, loaded on M ranks, on plain
// DDP with optim::optimizer, or on one device.
//
//   dparallel::optim::zero_redundancy_optimizer opt(w, dparallel::optim::adamw());   // N ranks
//   ... train ...
//   auto id = dparallel::optim::save_zero_state("opt.safetensors", opt, dparallel::optim::zero_save_mode::sharded);
//   //   every rank writes its own shard: opt.<set>.rank0-of-N.safetensors, ..., in parallel; then
//   //   opt.safetensors, a small manifest naming the set, is replaced (the save's commit)
//   auto id = dparallel::optim::save_zero_state("opt.safetensors", opt, dparallel::optim::zero_save_mode::gathered);
//   //   rank 0 writes the whole state to opt.<set>.safetensors and commits it as opt.safetensors,
//   //   the file optim::save_state would write
//   id.record(ckpt.progress());   // then save the training checkpoint (rank 0): it names this save
//
//   // resuming on M ranks (every rank; any M): exactly the save the checkpoint names
//   dparallel::optim::load_zero_state("opt.safetensors", opt, *dparallel::optim::zero_state_id::recorded(ckpt.progress()));
//   dparallel::optim::load_zero_state("opt.safetensors", opt);   // or: the last committed save
//   // on one device or plain DDP: optim::load_state("opt.safetensors", unsharded_opt, model) (gathered saves)
//
// Crash consistency (Note [ZeRO save sets] in optim/detail/zero_sets.hpp): a save never
// overwrites a file of an earlier save, and commits by one atomic rename once all its files are
// written. After a kill at any moment, the committed save and the save the last checkpoint names
// both load whole, and a save's files never mix with another's. A directory holds the files of at
// most three saves (the newest, the one before, and the one the optimizer resumed from).
//
// Why it reshards exactly: the update rules are elementwise (optim/rule.hpp), so element j of a
// state slot belongs to element j of one parameter whichever rank holds it. Both modes store the
// state by parameter, never by bucket or rank: the gathered file holds "optim.<parameter>.<slot>"
// shaped as the parameter and "optim.<rule>.step" (exactly optim::save_state's file), a shard file
// holds this rank's contiguous piece of each parameter under the same name, 1-D, with its element
// range in the metadata ("dparallel.zero.range.<parameter>" = "<begin> <end> <numel>"). Loading
// cuts each rank's new shard out of those pieces, so the next update is the one an uninterrupted
// run would make: the same bits.
//
// Both calls are collective (every rank of the wrapper's group calls them): an error on any rank
// is raised on every rank, and a load changes no rank's state unless every rank read everything.
// Reads are validated (names, dtypes, shapes, ranges that tile every parameter exactly, one step
// count, the file unchanged while read) before anything changes; writes are atomic per file.

#include <dparallel/config.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/core/detail/printable.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/optim/detail/zero_sets.hpp>
#include <dparallel/optim/detail/zero_shards.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/state.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// How save_zero_state writes a ZeRO-1 optimizer's state.
enum class zero_save_mode {
  /// Every rank writes its own shard file (zero_shard_path), in parallel: no rank holds more than
  /// its shard. Loaded by load_zero_state on any number of ranks.
  sharded,
  /// The state is gathered and rank 0 writes it to one file, named as optim::save_state names an
  /// unsharded optimizer's state: optim::load_state reads it on one device or under DDP.
  gathered,
};

/// Saves the state of `opt` (every kept slot, and the step count) for resuming on any number of
/// ranks, and returns the save's identity (record it in the training checkpoint written after it).
/// `mode` sharded writes zero_shard_path(<set>, rank, N) on every rank, in parallel, then rank 0
/// replaces `path` with a manifest naming the set; gathered writes the set's file on rank 0 and
/// commits it as `path` (optim::save_state's file: optim::load_state reads it). Then rank 0
/// removes the files of older saves to `path` but the last two (Note [ZeRO save sets]).
/// Collective: every rank of the wrapper's group calls it with the same arguments; an error on
/// any rank (a file that cannot be written, a first step not yet taken) is raised on every rank,
/// and the previous save stays the committed one.
template <update_rule R, class W>
zero_state_id save_zero_state(std::filesystem::path const& path, zero_redundancy_optimizer<R, W>& opt, zero_save_mode mode) {
  using access = detail::zero_state_access;
  opt.wait_gathers();  // zero_options::overlap_gather: no gather left in flight under the collectives below
  auto& w = access::wrapper(opt);
  auto& group = w.group();
  int const rank = group.rank(), world = group.size();
  auto const l = detail::layout_of(opt);
  std::size_t const np = l.sizes.size();
  std::string const pre(state_file_prefix);
  dparallel::detail::require(access::allocated(opt), [&] {
    return "save_zero_state on rank " + std::to_string(rank) +
           ": expected an optimizer that has taken a step (its state is laid out at the first step), found none; "
           "save after opt.step(), or save nothing yet";
  });
  // Rank 0 names the set; every rank writes under that name.
  std::vector<std::int64_t> name(1, rank == 0 ? static_cast<std::int64_t>(detail::new_set_number()) : 0);
  group.broadcast(view(name), 0).wait();
  zero_state_id id{detail::set_name(static_cast<std::uint64_t>(name[0])), opt.steps()};
  auto const base = detail::set_base(path, id.set);
  auto const& r = w.reducer();
  auto step = static_cast<std::int64_t>(opt.steps());
  named_tensor const step_tensor{pre + l.rule + ".step", tensor_ref(&step, 1, dtype::i64, host_memory),
                                 std::vector<std::uint64_t>{1}};
  safetensors_metadata meta{{"format", "pt"}, {std::string(optimizer_metadata_key), l.rule}, {std::string(zero_set_key), id.set}};
  auto const slot_name = [&](std::size_t i, std::size_t k) { return pre + l.names[i] + "." + std::string(l.slot_name(k)); };
  // Rank 0, once the set is whole on disk: the commit, then the sets no longer needed.
  auto const commit = [&](auto&& replace) {
    if (rank != 0) return;
    // The set the optimizer was loaded from, when it was: a fresh job's first save keeps only
    // the sets a commit names ("" is the unnamed files of a save without sets, and is kept only
    // when the previous commit is one).
    std::set<std::string> keep{id.set};
    if (!access::state_set(opt).empty()) keep.insert(access::state_set(opt));
    try {
      if (auto const before = detail::read_commit(path)) keep.insert(before->set);
    } catch (error const&) {  // a damaged commit is replaced: it named no set that loads
    }
    replace();
    detail::zero_save_probe("committed");
    detail::remove_sets_except(path, keep);
  };
  if (mode == zero_save_mode::sharded) {
    detail::on_every_rank(group, "save_zero_state", [&] {
      std::vector<named_tensor> tensors;
      for (auto const& q : detail::zero_pieces(r, l.sizes)) {
        std::size_t const n = q.end - q.begin;
        meta[std::string(zero_range_key) + l.names[q.param]] =
            std::to_string(q.begin) + " " + std::to_string(q.end) + " " + std::to_string(l.sizes[q.param]);
        for (std::size_t k = 0; k < l.kept(q.param); ++k)
          tensors.push_back({slot_name(q.param, k),
                             tensor_ref(access::slot(opt, k, q.bucket) + q.at, n, dtype::f32, host_memory),
                             std::vector<std::uint64_t>{n}});
      }
      meta["dparallel.zero.rank"] = std::to_string(rank);
      meta["dparallel.zero.world_size"] = std::to_string(world);
      tensors.push_back(step_tensor);
      save_safetensors(zero_shard_path(base, rank, world), tensors, meta);
      detail::zero_save_probe("shard written");
    });
    detail::on_every_rank(group, "save_zero_state",
                          [&] { commit([&] { detail::commit_manifest(path, id.set, world, l.rule); }); });
    access::state_set(opt) = id.set;
    return id;
  }
  // Gathered: each bucket's slot shards are all-gathered, rank 0 cuts the parameters out.
  std::vector<std::vector<float>> full(rank == 0 ? l.slot_tables() : 0);
  for (std::size_t i = 0; i < full.size(); ++i)
    if (i / np < l.kept(i % np)) full[i].resize(l.sizes[i % np]);  // the master table: 16-bit parameters only
  std::vector<float> whole;
  for (std::size_t b = 0; b < r.buckets().size(); ++b) {
    std::size_t const m = r.shard_elements(b);
    if (m == 0) continue;  // every rank has the same plan
    whole.resize(m * static_cast<std::size_t>(world));
    auto const& spec = r.buckets()[b];
    std::size_t const kept = l.slots + (dparallel::detail::is_half(spec.dtype) ? 1 : 0);  // and the master shard
    for (std::size_t k = 0; k < kept; ++k) {
      group.all_gather(view(whole), tensor_ref(access::slot(opt, k, b), m, dtype::f32, host_memory)).wait();
      if (rank != 0) continue;
      for (std::size_t j = 0; j < spec.params.size(); ++j) {
        std::size_t const p = spec.params[j];
        std::copy_n(whole.data() + spec.offsets[j], l.sizes[p], full[k * np + p].data());
      }
    }
  }
  detail::on_every_rank(group, "save_zero_state", [&] {
    if (rank != 0) return;
    std::vector<named_tensor> tensors;
    for (std::size_t i = 0; i < np; ++i)
      for (std::size_t k = 0; k < l.kept(i); ++k) tensors.push_back({slot_name(i, k), view(full[k * np + i]), l.shapes[i]});
    tensors.push_back(step_tensor);
    save_safetensors(base, tensors, meta);
    detail::zero_save_probe("set written");
    commit([&] { detail::commit_gathered(path, base); });
  });
  access::state_set(opt) = id.set;
  return id;
}

/// The files of the save committed at `path` (the manifest or gathered file first, then the shard
/// files): what to copy to move the optimizer state elsewhere. Empty when nothing was saved there.
inline std::vector<std::filesystem::path> zero_state_files(std::filesystem::path const& path) {
  auto const c = detail::read_commit(path);
  if (!c) return {};
  std::vector<std::filesystem::path> out{path};
  if (c->world > 0)
    for (int r = 0; r < c->world; ++r) out.push_back(zero_shard_path(detail::set_base(path, c->set), r, c->world));
  return out;
}

namespace detail {
/// Stages the save `id` names, or the committed save when `id` is empty; `set` receives its name.
inline zero_staged stage_save(std::filesystem::path const& path, zero_layout const& l, std::string const& rank,
                              std::optional<zero_state_id> const& id, std::string& set) {
  auto const c = read_commit(path);
  auto const where = "load_zero_state on rank " + rank + ": ";
  set = id ? id->set : c ? c->set : std::string();
  if (!id || (c && c->set == id->set)) {
    if (!c) return stage_shards(path, l, rank);  // a save older than sets: its shard files beside `path`
    if (c->world > 0) return stage_shards(set_base(path, c->set), l, rank, c->set);
    return stage_gathered(path, l, rank);
  }
  auto const base = set_base(path, id->set);
  if (std::filesystem::exists(base)) return stage_gathered(base, l, rank);
  if (shard_sets(base).empty())
    throw error("dparallel: " + where + "the checkpoint names ZeRO save " + in_quotes(id->set) + " (step " +
                std::to_string(id->step) + "), but no file of it is beside " + in_quotes(path.string()) +
                (c ? " (which holds save " + in_quotes(c->set) + ")" : std::string(" (nothing was saved there)")) +
                "; nothing was loaded: copy that save's files with the checkpoint (optim::zero_state_files)");
  return stage_shards(base, l, rank, id->set);
}
}  // namespace detail

/// Restores the state of `opt` from what save_zero_state (either mode, any world size) or
/// optim::save_state wrote to `path`: the save `id` names (as a training checkpoint recorded it),
/// else the committed one. Each rank reads and validates the whole state into host memory (its
/// new shard is known only once the bucket plan is final, at the first step), then keeps its
/// shard: at once when the optimizer has stepped, else when the first step lays the state out.
/// Collective: when any rank fails (a missing shard file, a file of another save, another
/// optimizer or model, a damaged file, a step count other than `id`'s) every rank throws, naming
/// the file, tensor or rank, and no rank's state or step count changed.
template <update_rule R, class W>
void load_zero_state(std::filesystem::path const& path, zero_redundancy_optimizer<R, W>& opt,
                     std::optional<zero_state_id> const& id = std::nullopt) {
  using access = detail::zero_state_access;
  opt.wait_gathers();
  auto& group = access::wrapper(opt).group();
  std::string const rank = std::to_string(group.rank());
  auto const l = detail::layout_of(opt);
  auto st = std::make_shared<detail::zero_staged>();
  std::string set;
  detail::on_every_rank(group, "load_zero_state", [&] {
    *st = detail::stage_save(path, l, rank, id, set);
    if (st->step < 0)
      throw error("dparallel: load_zero_state on rank " + rank + ": " + dparallel::detail::in_quotes(path.string()) +
                  " says " + std::to_string(st->step) + " steps were taken; expected a count >= 0");
    if (id && static_cast<std::uint64_t>(st->step) != id->step)
      throw error("dparallel: load_zero_state on rank " + rank + ": ZeRO save " + dparallel::detail::in_quotes(id->set) +
                  " holds step " + std::to_string(st->step) + ", the checkpoint expects step " + std::to_string(id->step) +
                  "; nothing was loaded");
  });
  access::state_set(opt) = set;
  access::restore(opt, static_cast<std::uint64_t>(st->step), [&opt, st, l] {
    std::size_t const np = l.sizes.size();
    for (auto const& q : detail::zero_pieces(access::wrapper(opt).reducer(), l.sizes))
      for (std::size_t k = 0; k < l.kept(q.param); ++k)
        std::copy_n(st->values[k * np + q.param].data() + q.begin, q.end - q.begin, access::slot(opt, k, q.bucket) + q.at);
  });
}

}  // namespace optim

DPARALLEL_NAMESPACE_END


#pragma once
// ZeRO-1 optimizer state in files that reshard: saved from N ranks, loaded on M ranks, on plain
// DDP with optim::optimizer, or on one device.
//
//   dparallel::zero_redundancy_optimizer opt(w, dparallel::optim::adamw());   // N ranks
//   ... train ...
//   dparallel::optim::save_zero_state("opt.safetensors", opt, dparallel::optim::zero_save_mode::sharded);
//   //   every rank writes its own shard: opt.rank0-of-N.safetensors, ..., in parallel
//   dparallel::optim::save_zero_state("opt.safetensors", opt, dparallel::optim::zero_save_mode::gathered);
//   //   rank 0 writes the whole state to opt.safetensors, as optim::save_state names it
//
//   // resuming on M ranks (every rank; any M): the gathered file when it exists, else the shard set
//   dparallel::optim::load_zero_state("opt.safetensors", opt);
//   // on one device or plain DDP: optim::load_state("opt.safetensors", unsharded_opt, model)
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
#include <dparallel/io/detail/printable.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/optim/detail/zero_shards.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/state.hpp>
#include <dparallel/policy/zero_redundancy_optimizer.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
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
/// ranks: `mode` sharded writes zero_shard_path(path, rank, N) on every rank, in parallel;
/// gathered writes `path` on rank 0 (optim::save_state's file: optim::load_state reads it). Then
/// rank 0 removes what earlier saves in the other mode or at other world sizes left under the same
/// `path`, so that load_zero_state finds this save's files only. Collective: every rank
/// of the wrapper's group calls it with the same arguments; an error on any rank (a file that
/// cannot be written, a first step not yet taken) is raised on every rank. Each file is written
/// atomically.
template <update_rule R, class W>
void save_zero_state(std::filesystem::path const& path, zero_redundancy_optimizer<R, W>& opt, zero_save_mode mode) {
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
  auto const& r = w.reducer();
  auto step = static_cast<std::int64_t>(opt.steps());
  named_tensor const step_tensor{pre + l.rule + ".step", tensor_ref(&step, 1, dtype::i64, host_memory),
                                 std::vector<std::uint64_t>{1}};
  safetensors_metadata meta{{"format", "pt"}, {std::string(optimizer_metadata_key), l.rule}};
  auto const slot_name = [&](std::size_t i, std::size_t k) { return pre + l.names[i] + "." + std::string(l.slot_name(k)); };
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
      save_safetensors(zero_shard_path(path, rank, world), tensors, meta);
    });
    if (rank == 0) detail::remove_other_saves(path, world);
    return;
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
    save_safetensors(path, tensors, meta);
    detail::remove_other_saves(path, 0);
  });
}

/// Restores the state of `opt` from what save_zero_state (either mode, any world size) or
/// optim::save_state wrote to `path`: the gathered file when `path` exists, else the one shard
/// set beside it. Each rank reads and validates the whole state into host memory (its new shard is
/// known only once the bucket plan is final, at the first step), then keeps its shard: at once
/// when the optimizer has stepped, else when the first step lays the state out. Collective: when
/// any rank fails (a missing shard file, another optimizer or model, a damaged file) every rank
/// throws, naming the file, tensor or rank, and no rank's state or step count changed.
template <update_rule R, class W>
void load_zero_state(std::filesystem::path const& path, zero_redundancy_optimizer<R, W>& opt) {
  using access = detail::zero_state_access;
  opt.wait_gathers();
  auto& group = access::wrapper(opt).group();
  std::string const rank = std::to_string(group.rank());
  auto const l = detail::layout_of(opt);
  auto st = std::make_shared<detail::zero_staged>();
  detail::on_every_rank(group, "load_zero_state", [&] {
    *st = std::filesystem::is_regular_file(path) ? detail::stage_gathered(path, l, rank)
                                                 : detail::stage_shards(path, l, rank);
    if (st->step < 0)
      throw error("dparallel: load_zero_state on rank " + rank + ": " + dparallel::detail::in_quotes(path.string()) +
                  " says " + std::to_string(st->step) + " steps were taken; expected a count >= 0");
  });
  access::restore(opt, static_cast<std::uint64_t>(st->step), [&opt, st, l] {
    std::size_t const np = l.sizes.size();
    for (auto const& q : detail::zero_pieces(access::wrapper(opt).reducer(), l.sizes))
      for (std::size_t k = 0; k < l.kept(q.param); ++k)
        std::copy_n(st->values[k * np + q.param].data() + q.begin, q.end - q.begin, access::slot(opt, k, q.bucket) + q.at);
  });
}

}  // namespace optim

DPARALLEL_NAMESPACE_END


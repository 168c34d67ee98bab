#pragma once
// Internals of optim/zero_checkpoint.hpp: where a ZeRO-1 rank's state lies in its parameters, and
// the staging of a saved state (a gathered file or a shard set) before it is installed.

#include <dparallel/config.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/core/detail/printable.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/optim/element.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/detail/zero_sets.hpp>
#include <dparallel/optim/state.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// The metadata key of a shard file holding the element range of a parameter's piece
/// ("<key><parameter name>" = "<begin> <end> <numel>").
inline constexpr std::string_view zero_range_key = "dparallel.zero.range.";

/// The shard file of rank `rank` of `world` for the state saved to `path`:
/// "dir/opt.safetensors" -> "dir/opt.rank<rank>-of-<world>.safetensors".
inline std::filesystem::path zero_shard_path(std::filesystem::path const& path, int rank, int world) {
  auto out = path;
  out.replace_filename(path.stem().string() + ".rank" + std::to_string(rank) + "-of-" + std::to_string(world) +
                       path.extension().string());
  return out;
}

namespace detail {

using dparallel::detail::in_quotes;

/// The private state of a zero_redundancy_optimizer, for saving and restoring it.
struct zero_state_access {
  /// The wrapper the optimizer updates.
  template <class Z>
  static auto& wrapper(Z& z) noexcept { return *z.w_; }
  /// Whether the state has been laid out (after the first step).
  template <class Z>
  static bool allocated(Z const& z) noexcept { return z.allocated_; }
  /// Slot k's storage for bucket b; k = the slots the rule keeps: the bucket's F32 master shard
  /// (zero_options::master_weights; null for an F32 bucket).
  template <class Z>
  static float* slot(Z const& z, std::size_t k, std::size_t b) {
    if (k == z.active_) return b < z.masters_.size() && z.masters_[b] ? z.master_data(b) : nullptr;
    return z.slot_data(k * z.bucket_count_ + b);
  }
  /// Sets the step count and the state: at once when it is laid out, else at its allocation.
  template <class Z, class F>
  static void restore(Z& z, std::uint64_t steps, F fill) {
    z.steps_ = steps;
    if (z.allocated_) fill();
    else z.restore_ = std::move(fill);
  }
  /// The save set the optimizer last loaded or saved ("" when none; Note [ZeRO save sets]).
  template <class Z>
  static std::string& state_set(Z& z) noexcept { return z.state_set_; }
};

/// A piece of a parameter in a rank's shard: its elements [begin, end) at element `at` of the
/// shard of bucket `bucket`.
struct zero_piece {
  std::size_t param, bucket, begin, end, at;
};

/// The pieces of every parameter in this rank's shards (at most one per parameter: a parameter
/// lies in one bucket, contiguously, and a shard is contiguous).
template <class Reducer>
std::vector<zero_piece> zero_pieces(Reducer const& r, std::vector<std::size_t> const& sizes) {
  std::vector<zero_piece> out;
  for (std::size_t b = 0; b < r.buckets().size(); ++b) {
    auto const& spec = r.buckets()[b];
    std::size_t const lo = r.shard_offset(b), hi = lo + r.shard_valid(b);
    for (std::size_t k = 0; k < spec.params.size(); ++k) {
      std::size_t const first = spec.offsets[k], p = spec.params[k];
      std::size_t const a = std::max(first, lo), z = std::min(first + sizes[p], hi);
      if (a < z) out.push_back({p, b, a - first, z - first, a - lo});
    }
  }
  return out;
}

/// What the files say about the model: per parameter its name, shape, size and whether it has an
/// F32 master copy (a 16-bit parameter). Slot k < slots is the rule's slot k; slot `slots` is the
/// master copy, "<parameter name>.master" as optim::state_dict names it.
struct zero_layout {
  std::vector<std::string> names;
  std::vector<std::optional<std::vector<std::uint64_t>>> shapes;
  std::vector<std::size_t> sizes;
  std::vector<char> master;  // per parameter
  std::size_t slots = 0;  // slots the rule keeps
  std::vector<std::string_view> slot_names;
  std::string rule;
  /// The slots parameter i has in the files: the rule's kept slots, and its master copy.
  [[nodiscard]] std::size_t kept(std::size_t i) const { return slots + (master[i] ? 1 : 0); }
  /// The name of slot k (k = slots: the master copy).
  [[nodiscard]] std::string_view slot_name(std::size_t k) const { return k < slots ? slot_names[k] : master_slot_name; }
  /// Room for every slot of every parameter, slot k of parameter i at k * P + i.
  [[nodiscard]] std::size_t slot_tables() const { return (slots + 1) * sizes.size(); }
};

template <class Z>
zero_layout layout_of(Z& z) {
  auto& m = zero_state_access::wrapper(z).module();
  auto const all = dparallel::state_dict(m);  // parameters first
  zero_layout l;
  for (std::size_t i = 0; i < parameter_refs(m).size(); ++i) {
    l.names.push_back(all[i].name);
    l.shapes.push_back(all[i].shape);
    l.sizes.push_back(all[i].data.size());
    l.master.push_back(dparallel::detail::is_half(all[i].data.dtype()) ? 1 : 0);
  }
  l.slots = active_slots(z.rule());
  using R = typename Z::rule_type;
  for (std::size_t k = 0; k < R::slot_count; ++k) l.slot_names.push_back(R::slot_names[k]);
  l.rule = std::string(rule_name<typename Z::rule_type>());
  return l;
}

/// Runs `fn` on every rank of `group`; if it threw on any rank, throws on every rank (its own
/// error where it failed, else one naming the first rank that failed).
template <class Group, class F>
void on_every_rank(Group& group, std::string const& what, F&& fn) {
  std::exception_ptr err;
  try {
    fn();
  } catch (...) {
    err = std::current_exception();
  }
  std::vector<std::int64_t> mine{err ? 1 : 0};
  std::vector<std::int64_t> all(static_cast<std::size_t>(group.size()));
  group.all_gather(view(all), view(mine)).wait();
  if (err) std::rethrow_exception(err);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r] != 0)
      throw error("dparallel: " + what + " failed on rank " + std::to_string(r) + " (its own error says why); rank " +
                  std::to_string(group.rank()) + " changed nothing and wrote nothing more");
}

/// Parses "<begin> <end> <numel>".
inline bool parse_range(std::string const& s, std::uint64_t (&v)[3]) {
  std::istringstream in(s);
  char extra = 0;
  return static_cast<bool>(in >> v[0] >> v[1] >> v[2]) && !(in >> extra) && v[0] <= v[1] && v[1] <= v[2];
}

/// Throws unless `file` holds the state of optimizer `rule`.
inline void require_rule(safetensors_reader const& file, std::string const& rule, std::string const& rank) {
  auto const it = file.metadata().find(std::string(optimizer_metadata_key));
  std::string const where = in_quotes(file.path().string());
  if (it == file.metadata().end())
    throw error("dparallel: load_zero_state on rank " + rank + ": " + where +
                " holds no optimizer state (its __metadata__ has no '" + std::string(optimizer_metadata_key) +
                "'); expected a file written by save_zero_state or optim::save_state for optimizer '" + rule + "'");
  if (it->second != rule)
    throw error("dparallel: load_zero_state on rank " + rank + ": " + where + " holds the state of optimizer " +
                in_quotes(it->second) + ", expected '" + rule +
                "'; build the optimizer the file was saved from, or start this one afresh");
}

/// The whole state, staged on the host: slot k of parameter i at values[k * P + i].
struct zero_staged {
  std::vector<std::vector<float>> values;
  std::int64_t step = 0;
};

/// The state in the gathered file `path` (optim::save_state's names), validated and staged.
inline zero_staged stage_gathered(std::filesystem::path const& path, zero_layout const& l, std::string const& rank) {
  safetensors_reader const file(path);
  require_rule(file, l.rule, rank);
  std::size_t const np = l.sizes.size();
  zero_staged st;
  st.values.resize(l.slot_tables());
  std::vector<named_tensor> targets;
  for (std::size_t i = 0; i < np; ++i)
    for (std::size_t k = 0; k < l.kept(i); ++k) {
      auto& v = st.values[k * np + i];
      v.assign(l.sizes[i], 0.0f);
      targets.push_back({l.names[i] + "." + std::string(l.slot_name(k)), view(v), l.shapes[i]});
    }
  targets.push_back({l.rule + ".step", tensor_ref(&st.step, 1, dtype::i64, host_memory), std::vector<std::uint64_t>{1}});
  dparallel::detail::load_named(file, targets, {.strict = true},
                                {.strip_module = false, .prefix = std::string(state_file_prefix)},
                                "optimizer '" + l.rule + "' on rank " + rank);
  return st;
}

/// The shard files beside `path` (zero_shard_path's names), by the world size that wrote them.
inline std::map<int, std::vector<std::filesystem::path>> shard_sets(std::filesystem::path const& path) {
  auto const dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  std::string const head = path.stem().string() + ".rank", tail = path.extension().string();
  std::map<int, std::vector<std::filesystem::path>> sets;
  std::error_code ec;
  auto const digits = [](std::string const& s) {
    return !s.empty() && s.size() <= 6 && s.find_first_not_of("0123456789") == std::string::npos;
  };
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string const n = it->path().filename().string();
    if (!n.starts_with(head) || !n.ends_with(tail) || n.size() <= head.size() + tail.size()) continue;
    std::string const mid = n.substr(head.size(), n.size() - head.size() - tail.size());  // "<r>-of-<N>"
    auto const dash = mid.find("-of-");
    if (dash == std::string::npos || !digits(mid.substr(0, dash)) || !digits(mid.substr(dash + 4))) continue;
    sets[std::stoi(mid.substr(dash + 4))].push_back(it->path());
  }
  return sets;
}

/// The world size of the one shard set saved to `path`; throws when there is none or several.
inline int shard_world(std::filesystem::path const& path, std::string const& rank) {
  auto const sets = shard_sets(path);
  if (sets.empty())
    throw error("dparallel: load_zero_state on rank " + rank + ": found no ZeRO save at " + in_quotes(path.string()) +
                " (no such file, and no shard files of a save beside it); expected the path given to save_zero_state");
  if (sets.size() > 1) {
    std::string list;
    for (auto const& s : sets) list += (list.empty() ? "" : ", ") + std::to_string(s.first);
    throw error("dparallel: load_zero_state on rank " + rank + ": found shard sets of several world sizes (" + list +
                ") for " + in_quotes(path.string()) + "; expected one: remove the stale set");
  }
  return sets.begin()->first;
}

/// A piece read from a shard file.
struct file_piece {
  std::size_t file, slot;
  tensor_info const* info;
  std::uint64_t begin, end;
};

/// The state in the shard set saved to `path` by any number of ranks, validated and staged; with
/// `set` given, every file must belong to that save set (Note [ZeRO save sets]).
inline zero_staged stage_shards(std::filesystem::path const& path, zero_layout const& l, std::string const& rank,
                                std::string_view set = {}) {
  int const world = shard_world(path, rank);
  std::string const pre(state_file_prefix), step_name = l.rule + ".step";
  std::size_t const np = l.sizes.size();
  std::map<std::string, std::pair<std::size_t, std::size_t>, std::less<>> slot_of;  // name -> (parameter, slot)
  for (std::size_t i = 0; i < np; ++i)
    for (std::size_t k = 0; k < l.kept(i); ++k) slot_of[l.names[i] + "." + std::string(l.slot_name(k))] = {i, k};
  std::vector<safetensors_reader> files;
  std::vector<std::vector<file_piece>> pieces(np);
  std::optional<std::int64_t> step;
  std::string step_file;
  for (int r = 0; r < world; ++r) {
    auto const p = zero_shard_path(path, r, world);
    if (!std::filesystem::exists(p))
      throw error("dparallel: load_zero_state on rank " + rank + ": the shard set of " + std::to_string(world) +
                  " ranks for " + in_quotes(path.string()) + " misses rank " + std::to_string(r) + "'s file " +
                  in_quotes(p.string()) + "; nothing was loaded: copy every shard file of the save");
    files.emplace_back(p);
    auto const& f = files.back();
    std::string const where = in_quotes(p.string());
    auto fail = [&](std::string const& what) {
      return error("dparallel: load_zero_state on rank " + rank + ": " + where + ": " + what + "; nothing was loaded");
    };
    require_rule(f, l.rule, rank);
    if (!set.empty()) {
      auto const s = f.metadata().find(std::string(zero_set_key));
      if (s == f.metadata().end() || s->second != set)
        throw fail("it belongs to save " + in_quotes(s == f.metadata().end() ? std::string() : s->second) +
                   ", expected save " + in_quotes(set) + " (shard files of different saves)");
    }
    if (!f.unsupported().empty()) throw fail("tensor " + in_quotes(f.unsupported()[0].name) + " has a dtype dparallel does not handle");
    for (auto const& t : f.tensors()) {
      std::string_view key = t.name;
      if (!key.starts_with(pre)) throw fail("unexpected tensor " + in_quotes(t.name) + " (expected names starting 'optim.')");
      key.remove_prefix(pre.size());
      if (key == step_name) {
        if (t.type != dtype::i64 || t.elements() != 1) throw fail("tensor " + in_quotes(t.name) + " is not one I64");
        std::int64_t s = 0;
        f.read(t, tensor_ref(&s, 1, dtype::i64, host_memory));
        if (step && *step != s)
          throw fail("its step count " + std::to_string(s) + " differs from " + std::to_string(*step) + " in " +
                     step_file + " (shard files of different saves)");
        step = s;
        step_file = where;
        continue;
      }
      auto const it = slot_of.find(key);
      if (it == slot_of.end())
        throw fail("unexpected tensor " + in_quotes(t.name) + ": optimizer '" + l.rule +
                   "' of this model has no such state (a checkpoint of another model or optimizer?)");
      auto const [i, k] = it->second;
      auto const m = f.metadata().find(std::string(zero_range_key) + l.names[i]);
      std::uint64_t v[3] = {0, 0, 0};
      if (m == f.metadata().end() || !parse_range(m->second, v))
        throw fail("tensor " + in_quotes(t.name) + " has no valid element range '" + std::string(zero_range_key) +
                   l.names[i] + "' in the __metadata__");
      if (t.type != dtype::f32 || t.shape.size() != 1 || t.elements() != v[1] - v[0] || v[2] != l.sizes[i])
        throw fail("tensor " + in_quotes(t.name) + " (" + std::string(name_of(t.type)) + " " +
                   dparallel::detail::shape_string(t.shape) + ", elements " + std::to_string(v[0]) + " to " +
                   std::to_string(v[1]) + " of " + std::to_string(v[2]) + ") does not fit the model's parameter of " +
                   std::to_string(l.sizes[i]) + " elements (a checkpoint of another model?)");
      pieces[i].push_back({files.size() - 1, k, &t, v[0], v[1]});
    }
    if (!step) throw fail("it has no tensor " + in_quotes(pre + step_name));
  }
  zero_staged st;
  st.values.resize(l.slot_tables());
  st.step = *step;
  for (std::size_t i = 0; i < np; ++i) {
    std::sort(pieces[i].begin(), pieces[i].end(), [](auto const& a, auto const& b) {
      return a.slot != b.slot ? a.slot < b.slot : a.begin < b.begin;
    });
    for (std::size_t k = 0, at = 0; k < l.kept(i); ++k) {
      std::uint64_t covered = 0;  // every element of the parameter exactly once, in order
      for (; at < pieces[i].size() && pieces[i][at].slot == k; ++at) {
        if (pieces[i][at].begin != covered) break;
        covered = pieces[i][at].end;
      }
      if (covered != l.sizes[i] || (at < pieces[i].size() && pieces[i][at].slot == k))
        throw error("dparallel: load_zero_state on rank " + rank + ": the shard set of " + std::to_string(world) +
                    " ranks for " + in_quotes(path.string()) + " covers tensor " +
                    in_quotes(pre + l.names[i] + "." + std::string(l.slot_name(k))) + " only to element " +
                    std::to_string(covered) + " of " + std::to_string(l.sizes[i]) +
                    " contiguously (a gap or overlap: shard files of different saves?); nothing was loaded");
      st.values[k * np + i].assign(l.sizes[i], 0.0f);
    }
    for (auto const& q : pieces[i]) {
      auto& v = st.values[q.slot * np + i];
      files[q.file].read(*q.info, tensor_ref(view(v)).subview(static_cast<std::size_t>(q.begin), static_cast<std::size_t>(q.end - q.begin)));
    }
  }
  for (auto const& f : files) f.verify_unchanged();
  return st;
}

}  // namespace detail

}  // namespace optim

DPARALLEL_NAMESPACE_END

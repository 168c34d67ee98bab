#pragma once
// Internals of optim/zero_checkpoint.hpp: the files of one ZeRO save ("a set") and its commit.
//
// Note [ZeRO save sets]
// A save to `path` ("dir/opt.safetensors") is several files written by several processes, and a
// kill may stop it anywhere. So a save never overwrites a file of an earlier save: it writes its
// files under a fresh set name S (16 hex digits), "dir/opt.<S>.rank<r>-of-<N>.safetensors" from
// every rank, or "dir/opt.<S>.safetensors" from rank 0, each file naming S in its metadata. Only
// when every file of the set is complete and synced does rank 0 replace `path`, atomically, with a
// small manifest naming S and N (sharded) or with the gathered file itself (a hard link to it, so
// that optim::load_state reads `path` as before). That rename is the commit: a kill before it
// leaves `path` naming the previous save, whose files are untouched; a kill after it leaves the
// new set whole. Then rank 0 removes the files (and dead writers' temporaries) of every other set
// except two: the one `path` named before this save, and the one this optimizer last loaded or
// saved. A training checkpoint written after the save records the new save's identity
// (zero_state_id); a kill between the commit and that checkpoint leaves the previous checkpoint
// naming the previous set, which is still there. So after a kill at any moment, the checkpoint on
// disk resumes with exactly the optimizer state it was written with, and nothing else loads.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/detail/atomic_file.hpp>
#include <dparallel/core/detail/printable.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/optim/state.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <fstream>
#include <span>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// The metadata key naming the set a ZeRO save's file belongs to (Note [ZeRO save sets]).
inline constexpr std::string_view zero_set_key = "dparallel.zero.set";

/// What one save_zero_state wrote: the name of its set of files and the step count it holds.
/// Record it in the training checkpoint written after the save, and give it to load_zero_state
/// when resuming from that checkpoint: the optimizer state then is exactly the one saved with it,
/// also after a kill between the two saves.
struct zero_state_id {
  std::string set;         ///< 16 hex digits, in the names and the metadata of the save's files
  std::uint64_t step = 0;  ///< the optimizer's step count in that state

  /// Writes the identity into a checkpoint's progress ("zero.set", "zero.step" of progress().extra).
  void record(training_progress& p) const {
    p.extra["zero.set"] = set;
    p.extra["zero.step"] = std::to_string(step);
  }
  /// The identity recorded in `p`, or nothing when `p` has none (a checkpoint without ZeRO state).
  static std::optional<zero_state_id> recorded(training_progress const& p) {
    auto const s = p.extra.find("zero.set");
    if (s == p.extra.end()) return std::nullopt;
    auto const n = p.extra.find("zero.step");
    zero_state_id id{s->second, 0};
    if (n == p.extra.end() || n->second.empty() || n->second.size() > 19 ||
        n->second.find_first_not_of("0123456789") != std::string::npos)
      throw error("dparallel: the checkpoint records ZeRO state " + dparallel::detail::in_quotes(s->second) +
                  " without a valid 'zero.step'; expected the decimal step count zero_state_id::record writes");
    id.step = std::stoull(n->second);
    return id;
  }
  friend bool operator==(zero_state_id const&, zero_state_id const&) = default;
};

namespace detail {

using dparallel::detail::in_quotes;

/// A fresh set number from the random device, the clock and the address space (two saves, even
/// of two jobs in one directory, do not pick the same one).
inline std::uint64_t new_set_number() {
  std::random_device rd;
  std::uint64_t x = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  x ^= static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
  return x ^ reinterpret_cast<std::uintptr_t>(&x);
}

/// A set's name: its number as 16 lowercase hex digits.
inline std::string set_name(std::uint64_t x) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, x >>= 4) out[static_cast<std::size_t>(i)] = "0123456789abcdef"[x & 15];
  return out;
}

/// A test seam: called at the points of a save where a kill leaves a distinct state on disk
/// ("shard written", "set written", "committed"); nothing unless a test installs a function.
inline std::atomic<void (*)(char const*)> zero_save_probe_fn{nullptr};
inline void zero_save_probe(char const* point) {
  if (auto* f = zero_save_probe_fn.load()) f(point);
}

inline bool is_set_name(std::string_view s) {
  return s.size() == 16 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

/// The name every file of set `set` starts from: "dir/opt.safetensors" -> "dir/opt.<set>.safetensors"
/// (the gathered file of the set; its shard files are zero_shard_path of it).
inline std::filesystem::path set_base(std::filesystem::path const& path, std::string const& set) {
  auto out = path;
  out.replace_filename(path.stem().string() + "." + set + path.extension().string());
  return out;
}

/// The set a file named `name` beside `path` belongs to: its set name ("opt.<set>.safetensors",
/// "opt.<set>.rank<r>-of-<N>.safetensors", and temporaries of those), "" for the shard names of
/// saves older than sets ("opt.rank<r>-of-<N>.safetensors"), nothing for any other file.
inline std::optional<std::string> set_of_file(std::filesystem::path const& path, std::string_view name) {
  if (name.starts_with('.') && name.find(".tmp-") != std::string_view::npos) name.remove_prefix(1);  // a temporary
  std::string const head = path.stem().string() + ".";
  if (!name.starts_with(head)) return std::nullopt;
  name.remove_prefix(head.size());
  if (name.starts_with("rank")) return std::string();
  if (name.size() > 16 && is_set_name(name.substr(0, 16)) && name[16] == '.') return std::string(name.substr(0, 16));
  return std::nullopt;
}

/// What `path` commits: the set it names and, for a shard set, its world size (0: `path` is a
/// gathered file; set "" when it was written by optim::save_state or before saves had sets).
struct zero_commit {
  std::string set;
  int world = 0;
};

/// Reads what `path` commits; nothing when it does not exist.
inline std::optional<zero_commit> read_commit(std::filesystem::path const& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  safetensors_reader const file(path);
  zero_commit c;
  if (auto const s = file.metadata().find(std::string(zero_set_key)); s != file.metadata().end()) c.set = s->second;
  if (auto const w = file.metadata().find(std::string(zero_manifest_key)); w != file.metadata().end()) {
    if (w->second.empty() || w->second.size() > 6 || w->second.find_first_not_of("0123456789") != std::string::npos ||
        !is_set_name(c.set))
      throw error("dparallel: " + in_quotes(path.string()) + " is a damaged ZeRO manifest (world size " +
                  in_quotes(w->second) + ", set " + in_quotes(c.set) + "); expected what save_zero_state writes");
    c.world = std::stoi(w->second);
  }
  return c;
}

/// Commits a sharded save: `path` becomes a manifest naming shard set `set` of `world` ranks.
inline void commit_manifest(std::filesystem::path const& path, std::string const& set, int world, std::string const& rule) {
  save_safetensors(path, std::span<named_tensor const>{},
                   {{"format", "pt"},
                    {std::string(zero_set_key), set},
                    {std::string(zero_manifest_key), std::to_string(world)},
                    {"dparallel.zero.rule", rule}});
}

/// Commits a gathered save: `path` becomes the set's gathered file `file` (a second name of it,
/// or a copy where the file system has no hard links), replaced atomically.
inline void commit_gathered(std::filesystem::path const& path, std::filesystem::path const& file) {
  std::filesystem::path const tmp = dparallel::detail::temporary_sibling(path);
  std::error_code ec;
  std::filesystem::create_hard_link(file, tmp, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    dparallel::detail::write_file_atomically(path, [&](dparallel::detail::file_sink& out) {
      std::ifstream in(file, std::ios::binary);
      char buf[1 << 16];
      while (in.read(buf, sizeof buf) || in.gcount() > 0) out.write(buf, static_cast<std::size_t>(in.gcount()));
      if (in.bad()) throw error("dparallel: could not read " + in_quotes(file.string()) + " to commit it as " + in_quotes(path.string()));
    });
    return;
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw error("dparallel: could not commit the ZeRO save " + in_quotes(file.string()) + " as " + in_quotes(path.string()) +
                ": " + ec.message() + "; the previous save is unchanged");
  }
  dparallel::detail::sync_directory_of(path);
}

/// After a commit: removes every file beside `path` that belongs to a set not in `keep`, and the
/// temporaries of those sets left by writers that no longer exist. Best effort: a file that cannot
/// be removed stays (it is never loaded: loads go through the commit or a recorded identity).
inline void remove_sets_except(std::filesystem::path const& path, std::set<std::string> const& keep) {
  auto const dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  std::error_code ec;
  std::set<std::string> temporaries;  // the targets of temporaries of dropped sets
  std::vector<std::filesystem::path> drop;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string const name = it->path().filename().string();
    auto const set = set_of_file(path, name);
    if (!set || keep.contains(*set)) continue;
    if (auto const t = name.find(".tmp-"); name.starts_with('.') && t != std::string::npos)
      temporaries.insert(name.substr(1, t - 1));
    else
      drop.push_back(it->path());
  }
  for (auto const& f : drop) std::filesystem::remove(f, ec);
  for (auto const& target : temporaries) dparallel::detail::remove_stale_temporaries(dir / target);
}

}  // namespace detail

}  // namespace optim

DPARALLEL_NAMESPACE_END

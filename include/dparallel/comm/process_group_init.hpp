#pragma once
// init_process_group: who am I in a job that a launcher started? Reads the rank, the world size
// and the node-local rank and size of this process from, in this order:
//   1. explicit arguments (init_options);
//   2. the torchrun-style variables RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
//   3. Open MPI's OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (mpirun);
//   4. Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE + SLURM_NODEID (srun);
//   5. an engine's own knowledge, when it has one (MPI knows its rank and size).
// MASTER_ADDR and MASTER_PORT (the TCP rendezvous of comm/rendezvous.hpp) come from the arguments
// or the environment. The first launcher whose variables are present supplies rank and world size
// together; an explicit argument overrides its one value. A missing partner variable, a value that
// is not an integer, a rank outside [0, world size), a malformed port: each is an invalid_argument
// that names the variable, the launcher it belongs to and the value found.
//
// This header includes no MPI, NCCL or CUDA header: it resolves the launch and wraps a
// process_group; an engine makes the group (dparallel::mpi::init_process_group in comm/mpi.hpp,
// or any callable given to the generic init_process_group below).

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/desync.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/detail/printable.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Arguments of init_process_group. Every value left empty is read from the launcher's environment.
struct init_options {
  /// This process's rank.
  std::optional<int> rank{};
  /// Number of processes in the job.
  std::optional<int> world_size{};
  /// Rank among the processes of this node.
  std::optional<int> local_rank{};
  /// Number of processes on this node.
  std::optional<int> local_world_size{};
  /// The rendezvous address and port (used by engines that bootstrap over TCP, e.g. NCCL without MPI).
  std::optional<std::string> master_addr{};
  /// The rendezvous port.
  std::optional<int> master_port{};
  /// How long any collective of the group waits for its peers before failing with timeout_error.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  /// Compare every collective's fingerprint across ranks before running it (debug; costs one
  /// small all_gather per collective). The variable DPARALLEL_DESYNC_DETECTION=1 turns it on too.
  bool desync_detection = false;
};

/// Where this process stands in the job, and where each value came from.
struct launch_info {
  /// This process's rank.
  int rank = 0;
  /// Number of processes in the job.
  int world_size = 1;
  /// Rank among the processes of this node.
  int local_rank = 0;
  /// Number of processes on this node.
  int local_world_size = 1;
  std::string master_addr;  ///< empty when not given
  int master_port = 0;      ///< 0 when not given
  std::string source;        ///< where rank and world size came from, e.g. "Open MPI (OMPI_COMM_WORLD_RANK=1, ...)"
  std::string local_source;  ///< where the local rank and size came from
};

/// What an engine knows by itself (MPI: its rank and size in MPI_COMM_WORLD). Used when no
/// launcher variable is set; when `authoritative`, a launcher's values must agree with it.
struct launch_fallback {
  /// The engine's rank.
  int rank = 0;
  /// The engine's world size.
  int world_size = 1;
  /// The node-local rank, when the engine knows it.
  std::optional<int> local_rank;
  /// The node-local size, when the engine knows it.
  std::optional<int> local_world_size;
  /// Names the engine in messages (e.g. "MPI_COMM_WORLD").
  std::string source;
  /// Whether the launcher's values must agree with the engine's.
  bool authoritative = true;
};

/// Looks up an environment variable; empty when it is not set.
using environment = std::function<std::optional<std::string>(std::string const&)>;

/// The process environment (std::getenv).
inline environment process_environment() {
  return [](std::string const& name) -> std::optional<std::string> {
    if (char const* v = std::getenv(name.c_str())) return std::string(v);  // NOLINT(concurrency-mt-unsafe)
    return std::nullopt;
  };
}

namespace detail {

/// One launcher's variables.
struct launcher_vars {
  char const* name;
  char const* rank;
  char const* world_size;
  char const* local_rank;
  char const* local_world_size;  // null: computed (Slurm)
};

inline constexpr launcher_vars launchers[] = {
    {"torchrun-style environment", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"Open MPI (mpirun)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"Slurm (srun)", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
};

[[noreturn]] inline void launch_fail(std::string const& what) {
  throw invalid_argument("dparallel: init_process_group: " + what);
}

/// Parses a whole decimal integer in [lo, hi]; `what` names it in the error ("RANK (torchrun-style environment)").
inline int parse_launch_int(std::string const& text, std::string const& what, long long lo, long long hi,
                            std::string const& hint = {}) {
  bool ok = !text.empty();
  long long v = 0;
  for (std::size_t i = 0; ok && i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') ok = false;
    else if (v <= hi) v = v * 10 + (text[i] - '0');  // stops growing once out of range: no overflow
  }
  if (!ok) launch_fail("expected " + what + " to be a non-negative integer, found " + in_quotes(text) + hint);
  if (v < lo || v > hi)
    launch_fail("expected " + what + " to be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], found " +
                printable(text) + " (out of range)" + hint);
  return static_cast<int>(v);
}

/// Slurm's SLURM_TASKS_PER_NODE ("2(x3),1": 2 tasks on each of 3 nodes, then 1) at node `node`.
inline int slurm_tasks_on_node(std::string const& spec, int node) {
  auto const bad = [&](std::string const& why) -> int {
    launch_fail("expected SLURM_TASKS_PER_NODE (Slurm (srun)) in Slurm's format, e.g. '2(x3),1', found '" + spec +
                "' (" + why + "); pass local_world_size explicitly");
  };
  int index = 0;
  std::size_t pos = 0;
  while (pos <= spec.size()) {
    std::size_t const end = std::min(spec.find(',', pos), spec.size());
    std::string const item = spec.substr(pos, end - pos);
    std::size_t const paren = item.find('(');
    std::string const count_text = item.substr(0, paren);
    int repeat = 1;
    if (paren != std::string::npos) {
      if (item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 || item.back() != ')') return bad("a bad repeat");
      std::string const rep = item.substr(paren + 2, item.size() - paren - 3);
      if (rep.empty() || rep.find_first_not_of("0123456789") != std::string::npos || rep.size() > 9)
        return bad("a bad repeat");
      repeat = std::stoi(rep);
    }
    if (count_text.empty() || count_text.find_first_not_of("0123456789") != std::string::npos ||
        count_text.size() > 9)
      return bad("a bad task count");
    int const count = std::stoi(count_text);
    if (node < index + repeat) return count;
    index += repeat;
    if (end == spec.size()) break;
    pos = end + 1;
  }
  return bad("it lists " + std::to_string(index) + " nodes, fewer than SLURM_NODEID + 1 = " + std::to_string(node + 1));
}

}  // namespace detail

/// Resolves this process's place in the job (see the top of this file for the order).
/// `fallback`: what the engine knows by itself (used when nothing else is set; checked against the
/// launcher's values when authoritative). Throws invalid_argument naming the variable at fault.
inline launch_info resolve_launch(init_options const& opts = {}, environment const& env = process_environment(),
                                  std::optional<launch_fallback> const& fallback = std::nullopt) {
  using detail::launch_fail;
  auto const get = [&](char const* name) -> std::optional<std::string> { return env ? env(name) : std::nullopt; };

  // The first launcher whose rank or world-size variable is set.
  detail::launcher_vars const* from = nullptr;
  for (auto const& l : detail::launchers) {
    if (get(l.rank) || get(l.world_size)) {
      from = &l;
      break;
    }
  }
  std::optional<int> env_rank, env_world;
  std::string env_text;
  if (from != nullptr) {
    auto const r = get(from->rank);
    auto const w = get(from->world_size);
    if (!r || !w) {
      char const* missing = r ? from->world_size : from->rank;
      char const* present = r ? from->rank : from->world_size;
      launch_fail("found " + std::string(present) + "=" + *(r ? r : w) + " (" + from->name + ") but no " + missing +
                  "; a launcher sets both. Set " + missing + ", or pass rank and world_size explicitly");
    }
    std::string const where = std::string(" (") + from->name + ")";
    env_world = detail::parse_launch_int(*w, std::string(from->world_size) + where, 1, 1 << 24);
    env_rank = detail::parse_launch_int(*r, std::string(from->rank) + where, 0, (1 << 24) - 1);
    env_text = std::string(from->name) + ": " + from->rank + "=" + *r + ", " + from->world_size + "=" + *w;
  }

  launch_info info;
  // World size and rank: explicit > launcher > engine.
  std::string world_from, rank_from;
  if (opts.world_size) {
    if (*opts.world_size < 1)
      launch_fail("expected world_size >= 1, found " + std::to_string(*opts.world_size) + " (argument)");
    info.world_size = *opts.world_size;
    world_from = "world_size=" + std::to_string(info.world_size) + " (argument)";
  } else if (env_world) {
    info.world_size = *env_world;
    world_from = std::string(from->world_size) + "=" + std::to_string(info.world_size) + " (" + from->name + ")";
  } else if (fallback) {
    info.world_size = fallback->world_size;
    world_from = "world size " + std::to_string(info.world_size) + " (" + fallback->source + ")";
  } else {
    launch_fail("found no world size: expected the argument world_size, or WORLD_SIZE (torchrun-style), "
                "OMPI_COMM_WORLD_SIZE (mpirun) or SLURM_NTASKS (srun) in the environment; launch the program "
                "with torchrun, mpirun or srun, or pass rank and world_size");
  }
  if (opts.rank) {
    info.rank = *opts.rank;
    rank_from = "rank=" + std::to_string(info.rank) + " (argument)";
  } else if (env_rank) {
    info.rank = *env_rank;
    rank_from = std::string(from->rank) + "=" + std::to_string(info.rank) + " (" + from->name + ")";
  } else if (fallback) {
    info.rank = fallback->rank;
    rank_from = "rank " + std::to_string(info.rank) + " (" + fallback->source + ")";
  } else {
    launch_fail("found a world size (" + world_from + ") but no rank: expected the argument rank, or RANK, "
                "OMPI_COMM_WORLD_RANK or SLURM_PROCID in the environment");
  }
  if (info.rank < 0 || info.rank >= info.world_size)
    launch_fail("expected the rank to be in [0, world size), found " + rank_from + " with " + world_from +
                "; every rank needs a distinct RANK below WORLD_SIZE");
  info.source = opts.rank && opts.world_size ? std::string("arguments")
                : from != nullptr            ? env_text + (opts.rank || opts.world_size ? " (overridden by arguments)" : "")
                : fallback                   ? fallback->source
                                             : std::string("arguments");

  // Local rank and size: explicit > the same launcher > engine > assume one node.
  std::optional<int> local_rank = opts.local_rank, local_size = opts.local_world_size;
  std::string local_from;
  if (from != nullptr && (!local_rank || !local_size)) {
    std::string const where = std::string(" (") + from->name + ")";
    auto const lr = get(from->local_rank);
    if (!local_rank && lr) local_rank = detail::parse_launch_int(*lr, std::string(from->local_rank) + where, 0, 1 << 24);
    if (!local_size) {
      if (from->local_world_size != nullptr) {
        if (auto const ls = get(from->local_world_size))
          local_size = detail::parse_launch_int(*ls, std::string(from->local_world_size) + where, 1, 1 << 24);
      } else if (auto const tasks = get("SLURM_TASKS_PER_NODE")) {
        auto const node = get("SLURM_NODEID");
        if (!node)
          launch_fail("found SLURM_TASKS_PER_NODE=" + *tasks +
                      " (Slurm (srun)) but no SLURM_NODEID to pick this node's count; pass local_world_size");
        int const id = detail::parse_launch_int(*node, "SLURM_NODEID (Slurm (srun))", 0, 1 << 24);
        local_size = detail::slurm_tasks_on_node(*tasks, id);
      }
    }
    if (lr || local_size) local_from = from->name;
  }
  if ((!local_rank || !local_size) && fallback && fallback->local_rank && fallback->local_world_size) {
    if (!local_rank) local_rank = fallback->local_rank;
    if (!local_size) local_size = fallback->local_world_size;
    local_from = local_from.empty() ? fallback->source : local_from + " and " + fallback->source;
  }
  if (!local_rank && !local_size) {
    local_rank = info.rank;
    local_size = info.world_size;
    local_from = "assumed: every rank on one node (no local rank given)";
  }
  if (!local_size) {
    launch_fail("found the local rank " + std::to_string(*local_rank) +
                " but no local world size: expected the argument local_world_size, or LOCAL_WORLD_SIZE "
                "(torchrun-style), OMPI_COMM_WORLD_LOCAL_SIZE (mpirun) or SLURM_TASKS_PER_NODE (srun)");
  }
  if (!local_rank) {
    launch_fail("found the local world size " + std::to_string(*local_size) +
                " but no local rank: expected the argument local_rank, or LOCAL_RANK (torchrun-style), "
                "OMPI_COMM_WORLD_LOCAL_RANK (mpirun) or SLURM_LOCALID (srun)");
  }
  if (local_from.empty()) local_from = "arguments";
  if (*local_size < 1 || *local_size > info.world_size)
    launch_fail("expected the local world size to be in [1, world size " + std::to_string(info.world_size) +
                "], found " + std::to_string(*local_size) + " (" + local_from + ")");
  if (*local_rank < 0 || *local_rank >= *local_size)
    launch_fail("expected the local rank to be in [0, local world size " + std::to_string(*local_size) +
                "), found " + std::to_string(*local_rank) + " (" + local_from + ")");
  info.local_rank = *local_rank;
  info.local_world_size = *local_size;
  info.local_source = local_from;

  // Rendezvous address and port (optional; checked when present).
  if (opts.master_addr) {
    if (opts.master_addr->empty()) launch_fail("expected a non-empty master_addr argument, found an empty string");
    info.master_addr = *opts.master_addr;
  } else if (auto const a = get("MASTER_ADDR")) {
    if (a->empty()) launch_fail("expected MASTER_ADDR to name rank 0's host, found an empty string");
    info.master_addr = *a;
  }
  if (opts.master_port) {
    if (*opts.master_port < 1 || *opts.master_port > 65535)
      launch_fail("expected master_port in [1, 65535], found " + std::to_string(*opts.master_port) + " (argument)");
    info.master_port = *opts.master_port;
  } else if (auto const p = get("MASTER_PORT")) {
    info.master_port = detail::parse_launch_int(*p, "MASTER_PORT", 1, 65535, "; MASTER_PORT is rank 0's TCP port");
  }

  // An engine that knows the truth (MPI) must agree with what the launcher said.
  if (fallback && fallback->authoritative && (info.rank != fallback->rank || info.world_size != fallback->world_size)) {
    launch_fail("inconsistent launch: " + fallback->source + " says rank " + std::to_string(fallback->rank) + " of " +
                std::to_string(fallback->world_size) + ", but " + rank_from + " and " + world_from +
                "; launch with one launcher, or pass arguments that match it");
  }
  return info;
}

/// A process group that also knows where it runs: rank() and size() as any process_group, plus
/// world_size(), local_rank(), local_world_size() and how they were found (launch()). Converts to
/// process_group (pass it to distributed_data_parallel), and works as a sampler's rank source.
class distributed_group : public process_group {
 public:
  distributed_group() = default;
  /// The group `group` with the launch it was made from.
  distributed_group(process_group group, launch_info info) : process_group(std::move(group)), info_(std::move(info)) {}

  /// Number of processes in the job.
  [[nodiscard]] int world_size() const noexcept { return info_.world_size; }
  /// Rank among the processes of this node.
  [[nodiscard]] int local_rank() const noexcept { return info_.local_rank; }
  /// Number of processes on this node.
  [[nodiscard]] int local_world_size() const noexcept { return info_.local_world_size; }
  /// Where this process stands in the job, and where each value came from.
  [[nodiscard]] launch_info const& launch() const noexcept { return info_; }

 private:
  launch_info info_;
};

namespace detail {
/// Whether DPARALLEL_DESYNC_DETECTION asks for desync detection ("1", "true", "on", "yes").
inline bool desync_from_environment(environment const& env) {
  if (!env) return false;
  auto const v = env("DPARALLEL_DESYNC_DETECTION");
  if (!v) return false;
  std::string s;
  for (char c : *v) s += static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (s == "1" || s == "true" || s == "on" || s == "yes") return true;
  if (s.empty() || s == "0" || s == "false" || s == "off" || s == "no") return false;
  launch_fail("expected DPARALLEL_DESYNC_DETECTION to be 1 or 0, found '" + *v + "'");
}

/// Checks that `group` is the rank the launch says, applies the timeout and desync detection.
inline distributed_group finish_init(process_group group, launch_info info, init_options const& opts,
                                     environment const& env) {
  if (!group.valid()) launch_fail("the engine returned an empty process_group");
  if (group.rank() != info.rank || group.size() != info.world_size)
    launch_fail("the engine made rank " + std::to_string(group.rank()) + " of " + std::to_string(group.size()) +
                ", but the launch says rank " + std::to_string(info.rank) + " of " + std::to_string(info.world_size) +
                " (" + info.source + ")");
  group.set_timeout(opts.timeout);
  if (opts.desync_detection || desync_from_environment(env)) group = with_desync_detection(std::move(group));
  return distributed_group(std::move(group), std::move(info));
}
}  // namespace detail

/// The generic form: resolves the launch, then `engine(launch_info const&, init_options const&)`
/// makes this rank's process_group (e.g. an MPI or NCCL communicator). The group must be rank
/// info.rank of info.world_size. Engines with their own notion of rank (MPI) provide their own
/// init_process_group (dparallel::mpi::init_process_group) that also checks the launcher against it.
template <class Engine>
  requires std::is_invocable_r_v<process_group, Engine&, launch_info const&, init_options const&>
distributed_group init_process_group(Engine&& engine, init_options const& opts = {},
                                     environment const& env = process_environment()) {
  detail::require(opts.timeout.count() > 0, "init_process_group: expected a positive timeout, found " +
                                                std::to_string(opts.timeout.count()) + " ms");
  launch_info info = resolve_launch(opts, env);
  process_group group = engine(std::as_const(info), opts);
  return detail::finish_init(std::move(group), std::move(info), opts, env);
}

DPARALLEL_NAMESPACE_END

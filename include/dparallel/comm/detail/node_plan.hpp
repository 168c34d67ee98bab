#pragma once
// Node identity for hierarchical process groups (comm/hierarchical.hpp): which node each rank of a
// parent group is on, found from one exchange of one 64-bit key per rank over the parent, and the
// checks that turn an unusable layout (nodes of different sizes) into the same invalid_argument on
// every rank (every rank checks the same gathered keys: never a hang, never a verdict on some ranks
// only).

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/subgroup_plan.hpp>
#include <dparallel/core/error.hpp>

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// The key of this machine: a hash (FNV-1a) of its host name, so the ranks of one machine (thread
/// ranks, shared-memory processes, MPI processes launched on one host) share it.
inline std::int64_t host_node_key() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return 0;
  std::uint64_t h = 1469598103934665603ULL;
  for (char const* c = buf; *c != '\0'; ++c) {
    h ^= static_cast<unsigned char>(*c);
    h *= 1099511628211ULL;
  }
  return static_cast<std::int64_t>(h & 0x7fff'ffff'ffff'ffffULL);
}

/// DPARALLEL_RANKS_PER_NODE as a positive number; 0 when unset or empty. Throws on other text.
inline int ranks_per_node_from_env() {
  char const* v = std::getenv("DPARALLEL_RANKS_PER_NODE");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  long const n = std::strtol(v, &end, 10);
  if (*end != '\0' || n <= 0 || n > 1'000'000)
    throw invalid_argument(std::string("dparallel: make_hierarchical: expected DPARALLEL_RANKS_PER_NODE to be a "
                                       "positive integer, found '") + v + "'; unset it to find nodes by host name");
  return static_cast<int>(n);
}

/// Where one rank is in the hierarchy, the same on every rank but `node` and `local_rank`.
struct node_plan {
  std::vector<std::vector<int>> nodes;  // every node's parent ranks, ascending; nodes by their first rank
  int node = 0;                         // this rank's node (index in `nodes`)
  int local_rank = 0;                   // this rank's place in its node
};

/// The plan from every rank's key (keys[j]: parent rank j's). Nodes are ordered by their smallest
/// parent rank; every node must have as many ranks as the first (else invalid_argument, alike on
/// every rank).
inline node_plan plan_nodes(std::vector<std::int64_t> const& keys, int me) {
  std::map<std::int64_t, int> index;  // key -> node index, in order of first appearance
  node_plan p;
  for (std::size_t j = 0; j < keys.size(); ++j) {
    auto [it, fresh] = index.try_emplace(keys[j], static_cast<int>(p.nodes.size()));
    if (fresh) p.nodes.emplace_back();
    p.nodes[static_cast<std::size_t>(it->second)].push_back(static_cast<int>(j));
  }
  for (std::size_t k = 1; k < p.nodes.size(); ++k) {
    if (p.nodes[k].size() != p.nodes[0].size())
      throw invalid_argument(
          "dparallel: make_hierarchical on rank " + std::to_string(me) +
          ": expected every node to have the same number of ranks, found node 0 with " +
          std::to_string(p.nodes[0].size()) + " (parent ranks " + rank_list_text(p.nodes[0]) + ") and node " +
          std::to_string(k) + " with " + std::to_string(p.nodes[k].size()) + " (parent ranks " +
          rank_list_text(p.nodes[k]) +
          "); launch as many ranks on every node, or set hierarchical_options (node_id, ranks_per_node) or "
          "DPARALLEL_RANKS_PER_NODE so that every node gets the same number");
  }
  auto const& mine = p.nodes[static_cast<std::size_t>(index.at(keys[static_cast<std::size_t>(me)]))];
  p.node = index.at(keys[static_cast<std::size_t>(me)]);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (mine[i] == me) p.local_rank = static_cast<int>(i);
  }
  return p;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

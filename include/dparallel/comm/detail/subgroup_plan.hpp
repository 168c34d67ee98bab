#pragma once
// Subgroups of a process group (process_group::split, process_group::new_group): the exchange by
// which every rank of the parent learns every rank's request, the checks that turn mismatched
// requests into the same error on every rank (never a hang), and the plan every engine builds its
// subgroups from: every group's members (parent ranks, in group order) and this rank's place.
//
// The exchange is one all_gather of request_words 64-bit words per rank over the parent (a
// collective of the parent like any other: every rank must call split / new_group at the same
// point of its sequence of collectives). Every rank then checks the same gathered words, so
// either every rank throws the same invalid_argument or none does, and the parent stays healthy.

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// What every engine needs to build the subgroups of one split: the same on every parent rank
/// but `mine`, `group_rank` and `parent_rank`.
struct subgroup_plan {
  std::vector<std::vector<int>> groups;  // every group's parent ranks, in group-rank order; by first member
  int mine = -1;                         // index of this rank's group in `groups`; -1: in none
  int group_rank = -1;                   // this rank's rank in its group; -1: in none
  int parent_rank = 0;
  int parent_size = 0;

  /// This rank's group's parent ranks (empty when in none).
  [[nodiscard]] std::vector<int> const& members() const {
    static std::vector<int> const none;
    return mine < 0 ? none : groups[static_cast<std::size_t>(mine)];
  }
};

/// The words one rank contributes: {magic, kind, a, b, count}. split: a = color, b = key;
/// new_group: a = hash of the list, b = its first rank (or -1), count = its length.
inline constexpr std::size_t subgroup_request_words = 5;
inline constexpr std::int64_t subgroup_magic = 0x4450'5347;  // "DPSG"
inline constexpr std::int64_t subgroup_kind_split = 1;
inline constexpr std::int64_t subgroup_kind_new_group = 2;

/// A hash of a rank list (FNV-1a over the ranks), to compare lists across ranks in one word.
inline std::int64_t rank_list_hash(std::vector<int> const& ranks) {
  std::uint64_t h = 1469598103934665603ULL;
  for (int r : ranks) {
    h ^= static_cast<std::uint64_t>(static_cast<std::uint32_t>(r));
    h *= 1099511628211ULL;
  }
  return static_cast<std::int64_t>(h);
}

/// "[2, 0, 1]".
inline std::string rank_list_text(std::vector<int> const& ranks) {
  std::string s = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return s + "]";
}

[[noreturn]] inline void subgroup_fail(int me, std::string const& what) {
  throw invalid_argument("dparallel: process_group subgroup on rank " + std::to_string(me) + ": " + what);
}

/// Every rank called split, or every rank new_group (each rank checks the same words: the same
/// verdict everywhere).
inline void check_same_kind(std::vector<std::int64_t> const& all, int me, int n) {
  auto const kind = [&](int j) { return all[static_cast<std::size_t>(j) * subgroup_request_words + 1]; };
  auto const name = [](std::int64_t k) { return k == subgroup_kind_split ? "split" : "new_group"; };
  for (int j = 1; j < n; ++j) {
    if (kind(j) != kind(0))
      subgroup_fail(me, "rank " + std::to_string(j) + " called " + name(kind(j)) + " where rank 0 called " +
                            name(kind(0)) + "; every rank of the parent must call the same one, at the same point "
                            "of its collectives");
  }
}

/// The plan of split(color, key) from every rank's gathered words (all[j*words ...] is rank j's).
/// `no_group` is the color of the ranks in no group.
inline subgroup_plan plan_split(std::vector<std::int64_t> const& all, int me, int n, int no_group) {
  auto const w = [&](int j, std::size_t k) { return all[static_cast<std::size_t>(j) * subgroup_request_words + k]; };
  check_same_kind(all, me, n);
  for (int j = 0; j < n; ++j) {
    if (w(j, 2) < 0 && w(j, 2) != no_group)
      subgroup_fail(me, "rank " + std::to_string(j) + " passed color " + std::to_string(w(j, 2)) +
                            "; expected a color >= 0, or process_group::no_group for a rank in no subgroup");
  }
  std::map<std::int64_t, std::vector<std::pair<std::int64_t, int>>> by_color;  // color -> (key, parent rank)
  for (int j = 0; j < n; ++j) {
    if (w(j, 2) != no_group) by_color[w(j, 2)].emplace_back(w(j, 3), j);
  }
  subgroup_plan plan;
  plan.parent_rank = me;
  plan.parent_size = n;
  for (auto& [color, list] : by_color) {
    std::stable_sort(list.begin(), list.end());  // by key, then parent rank
    std::vector<int> g;
    for (auto const& [key, j] : list) g.push_back(j);
    plan.groups.push_back(std::move(g));
  }
  std::sort(plan.groups.begin(), plan.groups.end(),
            [](auto const& a, auto const& b) { return *std::min_element(a.begin(), a.end()) < *std::min_element(b.begin(), b.end()); });
  for (std::size_t g = 0; g < plan.groups.size(); ++g) {
    auto const& m = plan.groups[g];
    if (auto it = std::find(m.begin(), m.end(), me); it != m.end()) {
      plan.mine = static_cast<int>(g);
      plan.group_rank = static_cast<int>(it - m.begin());
    }
  }
  return plan;
}

/// The plan of new_group(ranks): the same list on every rank (checked), valid parent ranks, no
/// duplicates; group rank i is ranks[i].
inline subgroup_plan plan_new_group(std::vector<std::int64_t> const& all, std::vector<int> const& ranks, int me,
                                    int n) {
  auto const w = [&](int j, std::size_t k) { return all[static_cast<std::size_t>(j) * subgroup_request_words + k]; };
  check_same_kind(all, me, n);
  for (int j = 1; j < n; ++j) {
    if (w(j, 2) != w(0, 2) || w(j, 4) != w(0, 4))
      subgroup_fail(me, "rank " + std::to_string(j) + " passed another rank list to new_group than rank 0 (" +
                            std::to_string(w(j, 4)) + " ranks starting with " + std::to_string(w(j, 3)) + ", against " +
                            std::to_string(w(0, 4)) + " starting with " + std::to_string(w(0, 3)) +
                            "; this rank's list is " + rank_list_text(ranks) +
                            "); every rank of the parent must pass the same list");
  }
  if (ranks.empty()) subgroup_fail(me, "new_group expects at least one rank, found an empty list");
  std::vector<int> seen(static_cast<std::size_t>(n), 0);
  for (int r : ranks) {
    if (r < 0 || r >= n)
      subgroup_fail(me, "new_group expects parent ranks in [0, " + std::to_string(n) + "), found " +
                            std::to_string(r) + " in " + rank_list_text(ranks));
    if (seen[static_cast<std::size_t>(r)]++ != 0)
      subgroup_fail(me, "new_group expects distinct ranks, found " + std::to_string(r) + " twice in " +
                            rank_list_text(ranks));
  }
  subgroup_plan plan;
  plan.parent_rank = me;
  plan.parent_size = n;
  plan.groups.push_back(ranks);
  if (auto it = std::find(ranks.begin(), ranks.end(), me); it != ranks.end()) {
    plan.mine = 0;
    plan.group_rank = static_cast<int>(it - ranks.begin());
  }
  return plan;
}

/// What a rank passes to a split by color and key (ncclCommSplit; MPI_Comm_split the same way):
/// the ranks passing one color form a group ordered by key, ties by parent rank, and a rank
/// passing `no_color` (NCCL_SPLIT_NOCOLOR, MPI_UNDEFINED) takes part and gets no group.
struct split_arguments {
  int color = 0;
  int key = 0;
};

/// The color and key that make such a split build exactly `plan`'s groups, in the plan's order
/// (new_group's order included): color = the index of the rank's group, key = its group rank.
inline split_arguments split_arguments_of(subgroup_plan const& plan, int no_color) {
  if (plan.mine < 0) return {no_color, 0};
  return {plan.mine, plan.group_rank};
}

/// The failure of a subgroup, as its members report it: the reason names group ranks, followed
/// by where they are in the parent ("rank 1 of this subgroup is parent rank 3; ...").
inline comm_failure subgroup_failure(comm_failure f, std::vector<int> const& parent_ranks) {
  if (parent_ranks.empty()) return f;
  std::string note = " [in a subgroup: the rank at fault, group rank " + std::to_string(f.rank);
  if (f.rank >= 0 && static_cast<std::size_t>(f.rank) < parent_ranks.size())
    note += ", is parent rank " + std::to_string(parent_ranks[static_cast<std::size_t>(f.rank)]);
  note += "; group ranks 0.." + std::to_string(parent_ranks.size() - 1) + " are parent ranks " +
          rank_list_text(parent_ranks) + "]";
  f.reason += note;
  return f;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

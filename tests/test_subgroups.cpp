// Subgroups of thread-rank process groups (process_group::split / new_group): the contracts of
// tests/subgroup_checks.hpp, failures confined to a subgroup and named in both numberings, and
// DDP over a subgroup bitwise equal to DDP over a group of that size.
#include "subgroup_checks.hpp"

#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

TEST_CASE("subgroups: split and new_group equal the serial references; bad requests fail alike", "[host][comm]") {
  for (int n : {3, 4, 5}) {
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    dp::spawn(n, [&](dp::rank_context& ctx) {
      errors[static_cast<std::size_t>(ctx.rank())] = subgroup_checks::check_all(ctx.group());
    });
    for (int r = 0; r < n; ++r) {
      INFO("world " << n << ", rank " << r);
      CHECK(errors[static_cast<std::size_t>(r)] == "");
    }
  }
}

TEST_CASE("subgroups: of a desync-checked group, and of a subgroup", "[host][comm]") {
  std::vector<std::string> errors(4);
  dp::spawn(4, [&](dp::rank_context& ctx) {
    auto const checked = dp::with_desync_detection(ctx.group());
    int const p = ctx.rank();
    auto const g = checked.split(p / 2, 0);  // {0, 1}, {2, 3}
    std::string e = subgroup_checks::check_collectives(g, {p / 2 * 2, p / 2 * 2 + 1}, p, 7);
    auto const single = g.split(g.rank(), 0);  // a group of one, of a subgroup
    if (e.empty()) e = subgroup_checks::check_collectives(single, {p}, p, 8);
    errors[static_cast<std::size_t>(p)] = e;
  });
  for (auto const& e : errors) CHECK(e == "");
}

TEST_CASE("subgroups: a failure inside a subgroup fails its members only, naming both numberings", "[host][comm]") {
  std::vector<std::string> what(4);
  std::vector<int> at_fault(4, -1);
  std::vector<std::string> other(4);
  dp::spawn(4, [&](dp::rank_context& ctx) {
    int const p = ctx.rank();
    auto g = ctx.group().split(p < 2 ? 0 : 1, -p);  // {1, 0} and {3, 2}
    std::vector<float> x(64, 1.0f);
    if (p == 3) {
      g.abort("stop");  // group rank 0 of {3, 2}
    } else if (p == 2) {
      try {
        g.all_reduce(dp::view(x)).wait();
      } catch (dp::comm_error const& e) {
        what[2] = e.what();
        at_fault[2] = e.rank();
      }
    } else {
      g.all_reduce(dp::view(x)).wait();  // the other subgroup is not affected
      other[static_cast<std::size_t>(p)] = x == std::vector<float>(64, 2.0f) ? "ok" : "wrong sum";
    }
    // A timeout inside a subgroup: parent rank 1 (group rank 0) never calls.
    auto h = ctx.group().new_group({1, 2, 0});
    if (h.valid()) h.set_timeout(300ms);
    if (p == 0 || p == 2) {
      try {
        h.barrier().wait();
      } catch (dp::timeout_error const& e) {
        if (p == 0) {
          what[0] = e.what();
          at_fault[0] = e.rank();
        }
      }
    }
    ctx.group().barrier().wait();  // parent rank 1 keeps its subgroup open until the others gave up
  });
  INFO(what[2]);
  CHECK(at_fault[2] == 0);
  CHECK(what[2].find("rank 0 aborted the process group: stop") != std::string::npos);
  CHECK(what[2].find("group rank 0, is parent rank 3; group ranks 0..1 are parent ranks [3, 2]") != std::string::npos);
  CHECK(other[0] == "ok");
  CHECK(other[1] == "ok");
  INFO(what[0]);
  CHECK(at_fault[0] == 0);
  CHECK(what[0].find("rank 0 did not call collective #1") != std::string::npos);
  CHECK(what[0].find("is parent rank 1; group ranks 0..2 are parent ranks [1, 2, 0]") != std::string::npos);
}

TEST_CASE("subgroups: DDP over a subgroup equals DDP over a group of that size, bit for bit", "[host][ddp]") {
  auto const train = subgroup_checks::ddp_after_steps;
  std::vector<std::vector<double>> want(2), got(4);
  dp::spawn(2, [&](dp::rank_context& ctx) { want[static_cast<std::size_t>(ctx.rank())] = train(ctx.group()); });
  dp::spawn(4, [&](dp::rank_context& ctx) {
    // {3, 1} and {2, 0}: two DDP jobs at once, on disjoint subgroups.
    auto const g = ctx.group().split(ctx.rank() % 2, -ctx.rank());
    got[static_cast<std::size_t>(ctx.rank())] = train(g);
  });
  CHECK(got[3] == want[0]);
  CHECK(got[1] == want[1]);
  CHECK(got[2] == want[0]);
  CHECK(got[0] == want[1]);
}

namespace {

// A split by color and key as ncclCommSplit and MPI_Comm_split define it: the ranks passing one
// color (not `no_color`) form a group ordered by key, ties by parent rank. Every rank's group
// (parent ranks in group order), empty for a rank passing no_color.
std::vector<std::vector<int>> split_by_color_and_key(std::vector<dp::detail::split_arguments> const& args, int no_color) {
  std::vector<std::vector<int>> out(args.size());
  for (std::size_t j = 0; j < args.size(); ++j) {
    if (args[j].color == no_color) continue;
    std::vector<std::pair<int, int>> same;  // (key, parent rank)
    for (std::size_t i = 0; i < args.size(); ++i)
      if (args[i].color == args[j].color) same.emplace_back(args[i].key, static_cast<int>(i));
    std::sort(same.begin(), same.end());
    for (auto const& kj : same) out[j].push_back(kj.second);
  }
  return out;
}

// Every rank's request words, as process_group::split / new_group exchange them.
std::vector<std::int64_t> requests(std::vector<std::array<std::int64_t, 4>> const& per_rank) {
  std::vector<std::int64_t> all;
  for (auto const& r : per_rank) all.insert(all.end(), {dp::detail::subgroup_magic, r[0], r[1], r[2], r[3]});
  return all;
}

}  // namespace

TEST_CASE("subgroups: the color and key an engine's split is given rebuild the plan under NCCL's split rule",
          "[host][comm]") {
  // ncclCommSplit (and MPI_Comm_split) groups by color and orders by key, ties by parent rank;
  // split_arguments_of must make that rule give exactly the plan's groups and group ranks, for
  // split (colors with gaps, no_group, equal and negative keys) and new_group (any order).
  int const no_color = -1;  // NCCL_SPLIT_NOCOLOR
  std::uint64_t seed = 12345;
  auto const next = [&](int m) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((seed >> 33) % static_cast<std::uint64_t>(m));
  };
  for (int trial = 0; trial < 300; ++trial) {
    int const n = 1 + next(9);
    bool const listed = trial % 3 == 2;
    std::vector<std::array<std::int64_t, 4>> per_rank(static_cast<std::size_t>(n));
    std::vector<int> list;
    if (listed) {
      for (int j = 0; j < n; ++j)
        if (next(3) != 0) list.push_back(j);
      if (list.empty()) list.push_back(next(n));
      for (std::size_t i = list.size(); i > 1; --i) std::swap(list[i - 1], list[static_cast<std::size_t>(next(static_cast<int>(i)))]);
      for (auto& r : per_rank)
        r = {dp::detail::subgroup_kind_new_group, dp::detail::rank_list_hash(list), list.front(),
             static_cast<std::int64_t>(list.size())};
    } else {
      for (auto& r : per_rank) {
        int const color = next(5) == 0 ? dp::process_group::no_group : 3 * next(3);
        r = {dp::detail::subgroup_kind_split, color, next(4) - 2, 0};
      }
    }
    auto const all = requests(per_rank);
    std::vector<dp::detail::subgroup_plan> plans;
    std::vector<dp::detail::split_arguments> args;
    for (int j = 0; j < n; ++j) {
      plans.push_back(listed ? dp::detail::plan_new_group(all, list, j, n)
                             : dp::detail::plan_split(all, j, n, dp::process_group::no_group));
      args.push_back(dp::detail::split_arguments_of(plans.back(), no_color));
    }
    auto const got = split_by_color_and_key(args, no_color);
    for (int j = 0; j < n; ++j) {
      auto const& plan = plans[static_cast<std::size_t>(j)];
      auto const& g = got[static_cast<std::size_t>(j)];
      INFO("trial " << trial << ", " << n << " ranks, rank " << j << (listed ? ", new_group" : ", split"));
      CHECK(g == plan.members());
      auto const at = std::find(g.begin(), g.end(), j);
      CHECK((at == g.end() ? -1 : static_cast<int>(at - g.begin())) == plan.group_rank);
    }
  }
}

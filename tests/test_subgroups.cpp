// Subgroups of thread-rank process groups (process_group::split / new_group): the contracts of
// tests/subgroup_checks.hpp, failures confined to a subgroup and named in both numberings, and
// DDP over a subgroup bitwise equal to DDP over a group of that size.
#include "subgroup_checks.hpp"

#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <mutex>
#include <string>
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

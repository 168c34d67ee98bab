// Subgroups of shared-memory process groups (forked processes): the contracts of
// tests/subgroup_checks.hpp, a failure inside a subgroup named in both numberings while the
// other subgroup goes on, DDP over a subgroup bitwise equal to DDP over thread ranks of that
// size, and no segment left in /dev/shm.
#include "fork_ranks.hpp"
#include "subgroup_checks.hpp"

#include <dparallel/comm/shm.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <sstream>
#include <string>
#include <vector>

using namespace std::chrono_literals;

namespace {

/// subgroup_checks::ddp_after_steps as text (hex floats: every bit).
std::string ddp_params(dpl::process_group const& g) {
  std::ostringstream out;
  out << std::hexfloat;
  for (double v : subgroup_checks::ddp_after_steps(g)) out << v << ',';
  return out.str();
}

}  // namespace

TEST_CASE("shm subgroups: split and new_group equal the serial references; bad requests fail alike", "[shm]") {
  for (int n : {3, 4}) {
    std::vector<pid_t> pids;
    auto const got = run_ranks(
        n,
        [&](int rank, dpl::shm::bootstrap_fn const& share) {
          return subgroup_checks::check_all(dpl::shm::make_group(rank, n, share, 60s));
        },
        &pids);
    for (int r = 0; r < n; ++r) {
      INFO(n << " processes, rank " << r);
      CHECK(got[static_cast<std::size_t>(r)].text == "");
      CHECK(got[static_cast<std::size_t>(r)].exit_code == 0);
    }
    require_no_segments_of(pids);
  }
}

TEST_CASE("shm subgroups: DDP over a subgroup equals DDP over thread ranks; a failure stays inside", "[shm][ddp]") {
  std::vector<std::string> want(2);
  dpl::spawn(2, [&](dpl::rank_context& ctx) { want[static_cast<std::size_t>(ctx.rank())] = ddp_params(ctx.group()); });
  std::vector<pid_t> pids;
  auto const got = run_ranks(
      4,
      [&](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
        auto const parent = dpl::shm::make_group(rank, 4, share, 60s);
        auto const g = parent.split(rank % 2, -rank);  // {2, 0} and {3, 1}, training at once
        std::string s = ddp_params(g) + "|";
        auto const h = parent.new_group({3, 2});
        if (rank == 3) h.abort("injected");
        if (h.valid()) {
          try {
            h.barrier().wait();
            s += "no failure";
          } catch (dpl::comm_error const& e) {
            s += std::to_string(e.rank()) + ": " + e.what();
          }
        }
        parent.barrier().wait();  // the parent is healthy
        return s;
      },
      &pids);
  for (int r = 0; r < 4; ++r) {
    auto const& text = got[static_cast<std::size_t>(r)].text;
    INFO("rank " << r << ": " << text);
    CHECK(text.substr(0, text.find('|')) == want[r < 2 ? 1 : 0]);
    if (r >= 2) {
      CHECK(text.find("|0: ") != std::string::npos);
      CHECK(text.find("rank 0 aborted the process group: injected") != std::string::npos);
      CHECK(text.find("group rank 0, is parent rank 3; group ranks 0..1 are parent ranks [3, 2]") != std::string::npos);
    } else {
      CHECK(text.back() == '|');
    }
  }
  require_no_segments_of(pids);
}

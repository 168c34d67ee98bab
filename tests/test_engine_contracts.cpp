// The engine contract (engine_contracts.hpp) on thread ranks (the host communicator, 1 to 4
// ranks) and on shared-memory processes (forked, 2 and 3 ranks). MPI processes run the same
// cases in tests/mpi/test_mpi_contracts.cpp.
//
// Catch2 assertions are not thread-safe: the cases return reports, checked here after the rank
// threads (or processes) have ended.

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/comm/shm.hpp>

#include <catch2/catch.hpp>

#include "engine_contracts.hpp"
#include "fork_ranks.hpp"
#include "host_comm_checks.hpp"
#include "rank_threads.hpp"

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

namespace dp = dparallel;
namespace ec = test::contracts;
using namespace std::chrono_literals;

namespace {

ec::engine_info const thread_ranks{.integer_sums = false, .lists = true, .stops_cleanly = true};
ec::engine_info const shared_memory{.integer_sums = true, .lists = true, .stops_cleanly = true};

/// Runs `c` on every rank of a fresh `n`-rank thread group; checks every rank's report.
void on_threads(int n, ec::contract_case const& c) {
  auto groups = dp::host::make_group(n, 30s);
  std::vector<std::string> reports(static_cast<std::size_t>(n));
  auto const errors = test::on_ranks(groups, [&](int r, dp::process_group& g) {
    reports[static_cast<std::size_t>(r)] = c.body(g, thread_ranks);
  });
  for (std::size_t r = 0; r < reports.size(); ++r) {
    INFO(c.name << ": thread rank " << r << " of " << n);
    CHECK(test::inspect(errors[r]).what == "");
    CHECK(reports[r] == "");
  }
}

/// Runs `c` on every rank of a fresh `n`-process shared-memory group; checks every rank's report.
void on_processes(int n, ec::contract_case const& c) {
  std::vector<pid_t> pids;
  auto const got = run_ranks(
      n,
      [&](int rank, dp::shm::bootstrap_fn const& share) {
        auto g = dp::shm::make_group(rank, n, share, 30s);
        return c.body(g, shared_memory);
      },
      &pids);
  for (std::size_t r = 0; r < got.size(); ++r) {
    INFO(c.name << ": process rank " << r << " of " << n);
    CHECK(got[r].exit_code == 0);
    CHECK(got[r].text == "");
  }
  require_no_segments_of(pids);
}

}  // namespace

TEST_CASE("engine contract: thread ranks, collectives per dtype", "[engines][host]") {
  for (auto const& c : ec::collective_cases())
    for (int n = 1; n <= 4; ++n) on_threads(n, c);
}

TEST_CASE("engine contract: thread ranks, argument errors, desync and a rank that stops", "[engines][host]") {
  for (auto const& c : ec::failure_cases())
    for (int n = 1; n <= 3; ++n) on_threads(n, c);
}

TEST_CASE("engine contract: shared-memory processes, collectives per dtype", "[engines][shm]") {
  for (auto const& c : ec::collective_cases())
    for (int n : {2, 3}) on_processes(n, c);
}

TEST_CASE("engine contract: shared-memory processes, argument errors, desync and a rank that stops",
          "[engines][shm]") {
  for (auto const& c : ec::failure_cases())
    for (int n : {2, 3}) on_processes(n, c);
}

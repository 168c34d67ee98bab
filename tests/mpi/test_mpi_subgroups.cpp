// Subgroups of MPI process groups (mpirun -np 3 / 4 test_mpi_subgroups): the contracts of
// tests/subgroup_checks.hpp over the MPI path (options::shared_memory = false: MPI_Comm_split)
// and over the shared-memory switch; a failure inside a subgroup named in both numberings while
// the other subgroup goes on; DDP over a subgroup bitwise equal to DDP over thread ranks.
// Hierarchical groups over MPI ("[hierarchical]", mpirun -np 4): 2 nodes x 2 ranks on one machine
// through DPARALLEL_RANKS_PER_NODE, against tests/hierarchical_checks.hpp's references.
#include "../hierarchical_checks.hpp"
#include "../subgroup_checks.hpp"

#include <dparallel/comm/hierarchical.hpp>

#include <dparallel/comm/mpi.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

namespace dpl = dparallel;
using namespace std::chrono_literals;

TEST_CASE("mpi subgroups: split and new_group equal the serial references; bad requests fail alike", "[subgroups]") {
  for (bool shm : {false, true}) {
    auto const parent = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.shared_memory = shm});
    INFO("shared_memory = " << shm << ", rank " << parent.rank());
    CHECK(subgroup_checks::check_all(parent) == "");
  }
}

TEST_CASE("mpi subgroups: DDP over a subgroup equals DDP over thread ranks; a failure stays inside", "[subgroups]") {
  for (bool shm : {false, true}) {
    auto const parent = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.shared_memory = shm});
    int const p = parent.rank();
    int const n = parent.size();
    // {0, 1} (reversed) and the rest.
    auto const g = parent.split(p < 2 ? 0 : 1, p < 2 ? -p : p);
    std::vector<std::vector<double>> want(static_cast<std::size_t>(g.size()));
    dpl::spawn(g.size(), [&](dpl::rank_context& ctx) { want[static_cast<std::size_t>(ctx.rank())] = subgroup_checks::ddp_after_steps(ctx.group()); });
    INFO("shared_memory = " << shm << ", rank " << p);
    CHECK(subgroup_checks::ddp_after_steps(g) == want[static_cast<std::size_t>(g.rank())]);
    // A failure inside a subgroup: here over shared memory (an MPI-path group that fails with a
    // collective in flight ends the job with MPI_Abort at exit: mpi_fault's `subgroup` scenario).
    if (shm) {
      auto const h = parent.new_group({n - 1, 0});
      if (p == n - 1) h.abort("injected");
      if (h.valid()) {
        std::string what;
        int at_fault = -1;
        try {
          h.barrier().wait();
        } catch (dpl::comm_error const& e) {
          what = e.what();
          at_fault = e.rank();
        }
        INFO(what);
        CHECK(at_fault == 0);
        CHECK(what.find("injected") != std::string::npos);
        CHECK(what.find("group rank 0, is parent rank " + std::to_string(n - 1) + "; group ranks 0..1 are parent ranks [" +
                        std::to_string(n - 1) + ", 0]") != std::string::npos);
      }
    }
    parent.barrier().wait();
  }
}

TEST_CASE("mpi hierarchical: 2 nodes x 2 ranks (DPARALLEL_RANKS_PER_NODE) equal the documented-order reference",
          "[hierarchical]") {
  for (bool shm : {false, true}) {
    auto const parent = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.shared_memory = shm});
    REQUIRE(parent.size() % 2 == 0);
    ::setenv("DPARALLEL_RANKS_PER_NODE", "2", 1);  // every process sets it: the override of the node identity
    auto const h = dpl::make_hierarchical(parent);
    ::unsetenv("DPARALLEL_RANKS_PER_NODE");
    auto const nodes = hierarchical_checks::consecutive(parent.size(), 2);
    INFO("shared_memory = " << shm << ", rank " << parent.rank());
    CHECK(hierarchical_checks::check_all_reduce(h, nodes, parent.rank()) == "");
    CHECK(hierarchical_checks::check_ddp(h, parent, nodes) == "");
    parent.barrier().wait();
  }
}

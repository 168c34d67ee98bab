// The engine contract (../engine_contracts.hpp) on MPI processes (mpirun -np 2|3): the MPI engine
// itself (options::shared_memory = false keeps make_group from switching to shared memory on
// this node). Every process runs every case, in the same order, each on a fresh group. A rank
// that stops and the engine's own mismatch check are left to mpi_fault (run_mpi_fault.cmake): a
// collective left in flight ends an MPI job at exit.

#include "../engine_contracts.hpp"

#include <dparallel/comm/mpi.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <string>

namespace dpl = dparallel;
namespace ec = test::contracts;
using namespace std::chrono_literals;

namespace {

// A mismatch caught by the engine's own descriptor check on 3 ranks may find a peer with the
// collective in flight, and the job then ends with MPI_Abort at exit (mpi_fault checks the
// mismatch on 2 ranks); with_desync_detection's case runs here.
ec::engine_info const mpi_engine{
    .integer_sums = true, .lists = false, .stops_cleanly = false, .mismatch_ends_cleanly = false};

void on_mpi(ec::contract_case const& c) {
  auto g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.shared_memory = false});
  std::string report;
  try {
    report = c.body(g, mpi_engine);
  } catch (std::exception const& e) {
    report = std::string("threw: ") + e.what();
  }
  INFO(c.name << ": MPI rank " << g.rank() << " of " << g.size());
  CHECK(report == "");
}

}  // namespace

TEST_CASE("engine contract: MPI processes, collectives per dtype", "[contracts]") {
  for (auto const& c : ec::collective_cases()) on_mpi(c);
}

TEST_CASE("engine contract: MPI processes, argument errors and desync", "[contracts]") {
  for (auto const& c : ec::failure_cases()) on_mpi(c);
}

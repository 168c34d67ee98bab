// Catch2's main for tests that run as MPI processes (mpirun -np N test_mpi): every rank runs the
// same test cases in the same order, so their collectives meet. Each rank reports its own
// assertions; mpirun exits non-zero when any rank does.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <dparallel/comm/mpi.hpp>

int main(int argc, char** argv) {
  Catch::Session session;
  if (int const rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  int const failed = session.run();
  dparallel::mpi::finalize();  // explicit, so that a problem at the end shows up here
  return failed == 0 ? 0 : 1;
}

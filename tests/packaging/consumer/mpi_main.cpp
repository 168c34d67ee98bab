// A user's MPI program: links dparallel::mpi, which dparallel as a subproject provides without
// the project looking for MPI itself. Run as one process (MPI's singleton start) or under mpirun:
// every rank contributes rank + 1 and checks the sum.
#include <dparallel/comm/mpi.hpp>

#include <cstdio>
#include <vector>

int main() {
  auto const group = dparallel::mpi::init_process_group();
  std::vector<double> v{static_cast<double>(group.rank() + 1)};
  group.all_reduce(dparallel::view(v)).wait();
  double const n = static_cast<double>(group.size());
  bool const ok = v[0] == n * (n + 1) / 2;
  if (group.rank() == 0) std::printf("dparallel::mpi: %d rank(s), sum %.0f %s\n", group.size(), v[0], ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}

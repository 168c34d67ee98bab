// allreduce_mpi: MPI_Allreduce (sum, F32, in place) over the processes of MPI_COMM_WORLD, timed
// the way `allreduce` times the host communicator, for the comparison column of its table.
// Launched by scripts/bench: mpirun -np 2 allreduce_mpi --csv FILE. Rank 0 prints and writes.

#include "bench_util.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

char const* const usage =
    "usage: mpirun -np N allreduce_mpi [--min BYTES] [--max BYTES] [--seconds S] [--reps R] [--csv FILE]\n";

struct timing {
  double best = 0, median = 0;
  std::int64_t iters = 0;
};

// Calibrated like bench::time_in_lock_step: rank 0 decides the iteration count, every rank runs
// it between two barriers.
timing time_allreduce(std::vector<float>& buf, double target, int reps, int rank) {
  auto run = [&](std::int64_t iters) {
    MPI_Barrier(MPI_COMM_WORLD);
    double const t0 = MPI_Wtime();
    for (std::int64_t i = 0; i < iters; ++i)
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    return MPI_Wtime() - t0;
  };
  run(1);  // warm-up
  std::int64_t iters = 1;
  for (;;) {
    double const t = run(iters);
    std::int64_t decision[2] = {0, iters};  // {done, iterations}
    if (rank == 0) {
      if (t >= target / 4 || iters >= (std::int64_t{1} << 24)) {
        decision[0] = 1;
        decision[1] = std::max<std::int64_t>(1, static_cast<std::int64_t>(static_cast<double>(iters) * target / t));
      } else {
        decision[1] = iters * 2;
      }
    }
    MPI_Bcast(decision, 2, MPI_INT64_T, 0, MPI_COMM_WORLD);
    iters = decision[1];
    if (decision[0] != 0) break;
  }
  std::vector<double> samples;
  for (int k = 0; k < reps; ++k) samples.push_back(run(iters) / static_cast<double>(iters));
  MPI_Bcast(samples.data(), reps, MPI_DOUBLE, 0, MPI_COMM_WORLD);  // rank 0's clock decides
  return {*std::min_element(samples.begin(), samples.end()), bench::median(samples), iters};
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  bench::args a(argc, argv, usage);
  auto const min_bytes = static_cast<std::size_t>(a.num("min", 4096));
  auto const max_bytes = static_cast<std::size_t>(a.num("max", 268435456));
  double const target = a.num("seconds", 0.2);
  int const reps = static_cast<int>(a.num("reps", 5));
  std::string const csv = a.str("csv", "");
  a.done();

  bench::table t({"ranks", "bytes", "seconds_best", "seconds_median", "time_us", "algbw_GBps", "busbw_GBps"});
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    std::vector<float> buf(bytes / sizeof(float), 0.0f);
    timing const tm = time_allreduce(buf, target, reps, rank);
    double const algbw = static_cast<double>(bytes) / tm.best / 1e9;
    t.add({bench::fmt("%d", size), bench::fmt("%zu", bytes), bench::fmt("%.9g", tm.best), bench::fmt("%.9g", tm.median),
           bench::fmt("%.2f", tm.best * 1e6), bench::fmt("%.3f", algbw),
           bench::fmt("%.3f", algbw * 2.0 * (size - 1) / size)});
    if (rank == 0) std::fprintf(stderr, "  MPI %d ranks, %s: %.1f us\n", size, bench::bytes_label(bytes).c_str(), tm.best * 1e6);
  }
  if (rank == 0) {
    std::printf("# MPI_Allreduce (sum, F32, in place) over %d processes; %s\n", size, bench::load_note().c_str());
    t.print();
    t.write_csv(csv);
  }
  MPI_Finalize();
  return 0;
}

// allreduce_mpi: MPI_Allreduce (sum, F32, in place) over the processes of MPI_COMM_WORLD, timed
// the way `allreduce` times the host communicator, for the comparison column of its table; and,
// in the same run (the two take turns, sample by sample), dparallel's all-reduce (avg, F32, in
// place) over the same processes: the group dparallel::mpi::make_group gives, which on one node
// moves the data through shared memory (comm/shm.hpp); and the same all-reduce of a buffer in the
// group's memory (process_group::allocate), which on one node is reduced in place, without
// copies through the segment. Launched by scripts/bench:
// mpirun -np 2 allreduce_mpi --csv FILE. Rank 0 prints and writes.

#include "bench_util.hpp"

#include <dparallel/comm/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
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
std::int64_t calibrate(std::function<double(std::int64_t)> const& run, double target, int rank) {
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
    if (decision[0] != 0) return iters;
  }
}

// `modes` take turns, sample by sample; rank 0's clock decides.
std::vector<timing> time_modes(std::vector<std::function<void()>> const& modes, double target, int reps, int rank) {
  std::vector<std::function<double(std::int64_t)>> runs;
  for (auto const& op : modes) {
    runs.push_back([&op](std::int64_t iters) {
      MPI_Barrier(MPI_COMM_WORLD);
      double const t0 = MPI_Wtime();
      for (std::int64_t i = 0; i < iters; ++i) op();
      MPI_Barrier(MPI_COMM_WORLD);
      return MPI_Wtime() - t0;
    });
  }
  std::vector<std::int64_t> iters;
  for (auto const& run : runs) iters.push_back(calibrate(run, target, rank));
  std::vector<std::vector<double>> samples(runs.size());
  for (int k = 0; k < reps; ++k)
    for (std::size_t m = 0; m < runs.size(); ++m)
      samples[m].push_back(runs[m](iters[m]) / static_cast<double>(iters[m]));
  std::vector<timing> out;
  for (std::size_t m = 0; m < runs.size(); ++m) {
    MPI_Bcast(samples[m].data(), reps, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    out.push_back({*std::min_element(samples[m].begin(), samples[m].end()), bench::median(samples[m]), iters[m]});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);  // dparallel's engine calls MPI from its thread
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

  auto const group = dparallel::mpi::make_group(MPI_COMM_WORLD);
  bench::table t({"ranks", "bytes", "seconds_best", "seconds_median", "time_us", "algbw_GBps", "busbw_GBps",
                  "dparallel_seconds_best", "dparallel_seconds_median", "dparallel_time_us", "dparallel_speedup_over_mpi",
                  "group_memory_seconds_best", "group_memory_seconds_median", "group_memory_time_us",
                  "group_memory_speedup_over_mpi"});
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    std::vector<float> buf(bytes / sizeof(float), 0.0f);
    std::vector<float> ours(bytes / sizeof(float), 0.0f);
    auto const memory = group.allocate(bytes);
    dparallel::tensor_view<float> const in_group(reinterpret_cast<float*>(memory.get()), bytes / sizeof(float));
    auto const tm = time_modes(
        {[&] { MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
         [&] { group.all_reduce(dparallel::view(ours), dparallel::reduce_op::avg).wait(); },
         [&] { group.all_reduce(in_group, dparallel::reduce_op::avg).wait(); }},
        target, reps, rank);
    double const algbw = static_cast<double>(bytes) / tm[0].best / 1e9;
    t.add({bench::fmt("%d", size), bench::fmt("%zu", bytes), bench::fmt("%.9g", tm[0].best),
           bench::fmt("%.9g", tm[0].median), bench::fmt("%.2f", tm[0].best * 1e6), bench::fmt("%.3f", algbw),
           bench::fmt("%.3f", algbw * 2.0 * (size - 1) / size), bench::fmt("%.9g", tm[1].best),
           bench::fmt("%.9g", tm[1].median), bench::fmt("%.2f", tm[1].best * 1e6),
           bench::fmt("%.2f", tm[0].best / tm[1].best), bench::fmt("%.9g", tm[2].best), bench::fmt("%.9g", tm[2].median),
           bench::fmt("%.2f", tm[2].best * 1e6), bench::fmt("%.2f", tm[0].best / tm[2].best)});
    if (rank == 0)
      std::fprintf(stderr, "  %d processes, %s: MPI_Allreduce %.1f us, dparallel %.1f us, in group memory %.1f us\n",
                   size, bench::bytes_label(bytes).c_str(), tm[0].best * 1e6, tm[1].best * 1e6, tm[2].best * 1e6);
  }
  if (rank == 0) {
    std::printf("# MPI_Allreduce (sum, F32, in place) and dparallel::mpi::make_group's all_reduce (avg, F32, in place; "
                "shared memory on one node; of ordinary memory, then of the group's memory) over %d processes, taking "
                "turns; %s\n",
                size, bench::load_note().c_str());
    t.print();
    t.write_csv(csv);
  }
  dparallel::mpi::finalize();  // before MPI_Finalize: the engine's thread and groups end first
  MPI_Finalize();
  return 0;
}

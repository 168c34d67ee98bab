// mpi_check_cost: what the MPI engine's collective check (mpi::options::check_collectives: one
// small all_gather of descriptors before each collective) costs. Two dparallel MPI communicators
// over MPI_COMM_WORLD, one checking, one not, time the same all_reduce (sum, F32, rank order)
// loops in interleaved rounds (the order alternates per round); rank 0 prints best and median
// microseconds per all_reduce and the ratio checked / unchecked.
//   mpirun -np 2 mpi_check_cost [--sizes 4096,4194304] [--rounds 9] [--seconds 0.1]

#include "bench_util.hpp"

#include <dparallel/comm/mpi.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace dpl = dparallel;

namespace {

char const* const usage = "usage: mpirun -np N mpi_check_cost [--sizes B1,B2,...] [--rounds R] [--seconds S]\n";

// Seconds per all_reduce over `iters` calls, by rank 0's clock (every rank runs the same count;
// each all_reduce waits for every rank, so the loops stay in lock step).
double time_loop(dpl::mpi::communicator& c, std::vector<float>& buf, std::int64_t iters) {
  c.barrier().wait();
  auto const t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < iters; ++i) c.all_reduce(dpl::view(buf)).wait();
  c.barrier().wait();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / static_cast<double>(iters);
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv, usage);
  std::string const sizes_arg = a.str("sizes", "4096,4194304");
  int const rounds = static_cast<int>(a.num("rounds", 9));
  double const target = a.num("seconds", 0.1);
  a.done();
  std::vector<std::size_t> sizes;
  std::stringstream ss(sizes_arg);
  for (std::string item; std::getline(ss, item, ',');) sizes.push_back(static_cast<std::size_t>(std::stoull(item)));

  auto const timeout = std::chrono::seconds(120);
  dpl::mpi::communicator checked(MPI_COMM_WORLD, timeout, {.check_collectives = true});
  dpl::mpi::communicator unchecked(MPI_COMM_WORLD, timeout, {.check_collectives = false});
  int const rank = checked.rank();

  bench::table t({"ranks", "bytes", "checked_us_best", "checked_us_median", "unchecked_us_best",
                  "unchecked_us_median", "ratio_best", "ratio_median"});
  for (std::size_t const bytes : sizes) {
    std::vector<float> buf(bytes / sizeof(float), 1.0f);
    // Iterations per loop: from one unchecked warm-up loop, agreed on through rank 0's count.
    double const per = time_loop(unchecked, buf, 20);
    (void)time_loop(checked, buf, 20);
    std::vector<std::int64_t> iters{std::max<std::int64_t>(5, static_cast<std::int64_t>(target / per))};
    unchecked.broadcast(dpl::view(iters), 0).wait();
    std::vector<double> on, off;
    for (int r = 0; r < rounds; ++r) {
      if (r % 2 == 0) {
        on.push_back(time_loop(checked, buf, iters[0]));
        off.push_back(time_loop(unchecked, buf, iters[0]));
      } else {
        off.push_back(time_loop(unchecked, buf, iters[0]));
        on.push_back(time_loop(checked, buf, iters[0]));
      }
    }
    double const on_best = *std::min_element(on.begin(), on.end()), off_best = *std::min_element(off.begin(), off.end());
    double const on_med = bench::median(on), off_med = bench::median(off);
    t.add({bench::fmt("%d", checked.size()), bench::fmt("%zu", bytes), bench::fmt("%.2f", on_best * 1e6),
           bench::fmt("%.2f", on_med * 1e6), bench::fmt("%.2f", off_best * 1e6), bench::fmt("%.2f", off_med * 1e6),
           bench::fmt("%.3f", on_best / off_best), bench::fmt("%.3f", on_med / off_med)});
  }
  if (rank == 0) {
    std::printf("# dparallel MPI all_reduce (sum, F32, rank order), collective check on vs off, %d interleaved "
                "rounds; %s\n",
                rounds, bench::load_note().c_str());
    t.print();
  }
  return 0;
}

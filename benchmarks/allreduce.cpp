// allreduce: the host communicator's all-reduce over thread ranks, against this machine's copy
// bandwidth measured in the same run (and MPI_Allreduce, when allreduce_mpi's CSV is given).
//
// For each rank count n and message size S (bytes of F32 per rank, powers of 4 from 4 KiB):
//  - time: per all_reduce(avg) of S bytes on every rank, in place (best of --reps samples);
//  - algbw = S / time, busbw = algbw * 2(n-1)/n (nccl-tests' definitions);
//  - traffic = 2 n S / time: the memory traffic no all-reduce over shared memory can avoid (every
//    rank's buffer read once and written once), in bytes per second;
//  - copy = the bandwidth of n threads each copying its own S bytes (memcpy), counting the bytes
//    read and the bytes written, in the same run: the physical limit of that traffic here;
//  - traffic / copy: how close the all-reduce comes to that limit (target: >= 0.7 at 64 MiB);
//  - with --mpi FILE: MPI_Allreduce's time for the same n and S (from allreduce_mpi) and our
//    speed-up over it (target: >= 3 at 64 MiB over 2 ranks); and dparallel's all-reduce over
//    n processes (allreduce_mpi measures it in turns with MPI_Allreduce: shared memory on one
//    node), as time, its speed-up over MPI_Allreduce, and its time over the thread ranks' (targets:
//    >= 3x MPI_Allreduce and <= 1.1 x the thread ranks' time at every size >= 64 KiB, and a
//    4 KiB all-reduce in <= 10 us).

#include "bench_util.hpp"
#include "timing.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/core/buffer.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dp = dparallel;

namespace {

char const* const usage =
    "usage: allreduce [--ranks 2[,4...]] [--min BYTES] [--max BYTES] [--seconds S] [--reps R]\n"
    "                 [--csv FILE] [--mpi FILE]\n"
    "  --ranks    thread-rank counts to measure (default 2)\n"
    "  --min/max  message sizes in bytes per rank, powers of 4 between them (default 4096 .. 268435456)\n"
    "  --seconds  length of one timed sample (default 0.2)\n"
    "  --reps     samples per measurement; the best is reported (default 5)\n"
    "  --csv      write the table as CSV\n"
    "  --mpi      CSV written by allreduce_mpi: adds MPI_Allreduce's time and our speed-up over it\n";

/// From allreduce_mpi's CSV: best seconds per MPI_Allreduce and per dparallel process all-reduce.
struct process_times {
  double mpi = 0;
  double ours = 0;  // 0: not in the file
  double group_memory = 0;  // the buffer in the group's memory (process_group::allocate); 0: not in the file
};

/// (ranks, bytes) -> the times allreduce_mpi measured.
std::map<std::pair<int, std::size_t>, process_times> read_mpi(std::string const& path) {
  std::map<std::pair<int, std::size_t>, process_times> out;
  if (path.empty()) return out;
  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "allreduce: cannot read %s; the MPI columns stay empty\n", path.c_str());
    return out;
  }
  std::string line;
  std::getline(f, line);  // header: ranks,bytes,seconds_best,...,dparallel_seconds_best (8th)
  while (std::getline(f, line)) {
    std::stringstream in(line);
    std::vector<std::string> cells;
    for (std::string cell; std::getline(in, cell, ',');) cells.push_back(cell);
    if (cells.size() < 3) continue;
    process_times& p = out[{std::stoi(cells[0]), std::stoull(cells[1])}];
    p.mpi = std::stod(cells[2]);
    if (cells.size() >= 8 && !cells[7].empty()) p.ours = std::stod(cells[7]);
    if (cells.size() >= 12 && !cells[11].empty()) p.group_memory = std::stod(cells[11]);
  }
  return out;
}

struct row {
  int ranks = 0;
  std::size_t bytes = 0;
  bench::op_time ours, copy;
  double mpi = 0;   // seconds; 0 = not measured
  double proc = 0;  // dparallel over processes, seconds; 0 = not measured
  double gm = 0;    // the same, buffers in the group's memory; 0 = not measured
};

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv, usage);
  auto const rank_list = a.list("ranks", {2});
  auto const min_bytes = static_cast<std::size_t>(a.num("min", 4096));
  auto const max_bytes = static_cast<std::size_t>(a.num("max", 268435456));
  double const target = a.num("seconds", 0.2);
  int const reps = static_cast<int>(a.num("reps", 5));
  std::string const csv = a.str("csv", "");
  auto const mpi = read_mpi(a.str("mpi", ""));
  a.done();

  std::printf("# all-reduce (avg, F32, in place) over thread ranks vs %s-thread copy bandwidth; %s\n", "n",
              bench::load_note().c_str());
  std::vector<row> rows;
  for (double rd : rank_list) {
    int const n = static_cast<int>(rd);
    auto groups = dp::host::make_group(n);
    for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      std::size_t const count = bytes / sizeof(float);
      row r;
      r.ranks = n;
      r.bytes = bytes;
      {
        std::vector<dp::buffer<float>> data;
        for (int k = 0; k < n; ++k) data.emplace_back(count);
        r.ours = bench::time_in_lock_step(
            n,
            [&](int k) {
              auto& b = data[static_cast<std::size_t>(k)];
              groups[static_cast<std::size_t>(k)].all_reduce(dp::tensor_ref(b.view()), dp::reduce_op::avg).wait();
            },
            target, reps);
      }
      {
        std::vector<dp::buffer<float>> src, dst;
        for (int k = 0; k < n; ++k) {
          src.emplace_back(count);
          dst.emplace_back(count);
        }
        r.copy = bench::time_in_lock_step(
            n,
            [&](int k) {
              auto const i = static_cast<std::size_t>(k);
              std::memcpy(dst[i].data(), src[i].data(), bytes);
            },
            target, reps);
      }
      if (auto it = mpi.find({n, bytes}); it != mpi.end()) {
        r.mpi = it->second.mpi;
        r.proc = it->second.ours;
        r.gm = it->second.group_memory;
      }
      rows.push_back(r);
      std::fprintf(stderr, "  %d ranks, %s: %.1f us\n", n, bench::bytes_label(bytes).c_str(), r.ours.best * 1e6);
    }
  }

  bench::table t({"ranks", "bytes", "size", "time_us", "median_us", "algbw_GBps", "busbw_GBps", "traffic_GBps",
                  "copy_GBps", "traffic_over_copy", "copy_limit_algbw_GBps", "mpi_time_us", "mpi_algbw_GBps",
                  "speedup_over_mpi", "proc_time_us", "proc_speedup_over_mpi", "proc_over_threads", "gm_time_us",
                  "gm_speedup_over_mpi", "gm_over_threads"});
  for (auto const& r : rows) {
    double const n = r.ranks, s = static_cast<double>(r.bytes);
    double const algbw = s / r.ours.best / 1e9;
    double const busbw = algbw * 2 * (n - 1) / n;
    double const traffic = 2 * n * s / r.ours.best / 1e9;
    double const copy = n * 2 * s / r.copy.best / 1e9;
    t.add({bench::fmt("%d", r.ranks), bench::fmt("%zu", r.bytes), bench::bytes_label(r.bytes),
           bench::fmt("%.2f", r.ours.best * 1e6), bench::fmt("%.2f", r.ours.median * 1e6), bench::fmt("%.3f", algbw),
           bench::fmt("%.3f", busbw), bench::fmt("%.3f", traffic), bench::fmt("%.3f", copy),
           bench::fmt("%.3f", traffic / copy), bench::fmt("%.3f", copy / (2 * n)),
           r.mpi > 0 ? bench::fmt("%.2f", r.mpi * 1e6) : "",
           r.mpi > 0 ? bench::fmt("%.3f", s / r.mpi / 1e9) : "",
           r.mpi > 0 ? bench::fmt("%.2f", r.mpi / r.ours.best) : "",
           r.proc > 0 ? bench::fmt("%.2f", r.proc * 1e6) : "",
           r.proc > 0 && r.mpi > 0 ? bench::fmt("%.2f", r.mpi / r.proc) : "",
           r.proc > 0 ? bench::fmt("%.2f", r.proc / r.ours.best) : "",
           r.gm > 0 ? bench::fmt("%.2f", r.gm * 1e6) : "",
           r.gm > 0 && r.mpi > 0 ? bench::fmt("%.2f", r.mpi / r.gm) : "",
           r.gm > 0 ? bench::fmt("%.2f", r.gm / r.ours.best) : ""});
  }
  t.print();
  t.write_csv(csv);

  // The ratios, and the small-message latency.
  for (double rd : rank_list) {
    int const n = static_cast<int>(rd);
    auto find = [&](std::size_t bytes) -> row const* {
      for (auto const& r : rows)
        if (r.ranks == n && r.bytes == bytes) return &r;
      return nullptr;
    };
    if (auto const* r = find(std::size_t{64} << 20)) {
      double const s = static_cast<double>(r->bytes);
      double const traffic = 2 * n * s / r->ours.best, copy = 2 * n * s / r->copy.best;
      std::printf("%d ranks, 64 MiB: traffic 2nS/t %.2f GB/s = %.2f x the %d-thread copy bandwidth %.2f GB/s "
                  "(target >= 0.7)",
                  n, traffic / 1e9, traffic / copy, n, copy / 1e9);
      if (r->mpi > 0) std::printf("; %.2f x faster than MPI_Allreduce (target >= 3)", r->mpi / r->ours.best);
      std::printf("\n");
    }
    // dparallel over n processes against MPI_Allreduce and against the thread ranks,
    // buffers in ordinary memory (proc) and in the group's memory (gm).
    for (bool gm : {false, true}) {
      double worst_mpi = 0, worst_threads = 0;
      bool any = false;
      for (auto const& r : rows) {
        double const t = gm ? r.gm : r.proc;
        if (r.ranks != n || t <= 0 || r.mpi <= 0 || r.bytes < (std::size_t{64} << 10)) continue;
        double const speedup = r.mpi / t, over = t / r.ours.best;
        worst_mpi = any ? std::min(worst_mpi, speedup) : speedup;
        worst_threads = any ? std::max(worst_threads, over) : over;
        any = true;
      }
      if (any)
        std::printf("%d processes, %s, sizes >= 64 KiB: at worst %.2f x faster than MPI_Allreduce (target >= 3) and "
                    "%.2f x the thread ranks' time (target <= 1.1)\n",
                    n, gm ? "buffers in group memory" : "ordinary buffers", worst_mpi, worst_threads);
    }
    if (auto const* r = find(4096); r != nullptr && r->proc > 0)
      std::printf("%d processes: a 4 KiB all-reduce takes %.1f us (target <= 10)\n", n, r->proc * 1e6);
    auto const* small = find(4096);
    auto const* mid = find(std::size_t{4} << 20);
    if (small != nullptr && mid != nullptr)
      std::printf("%d ranks: a 4 KiB all-reduce takes %.1f us, a 4 MiB one %.1f us (%.0f x longer)\n", n,
                  small->ours.best * 1e6, mid->ours.best * 1e6, mid->ours.best / small->ours.best);
  }
  std::printf("# %s\n", bench::load_note().c_str());
  return 0;
}

// scaling: training throughput of the reference workload (the 784-512-ReLU-10 MLP of
// examples/mlp.hpp on Fashion-MNIST, plain SGD) on one device, with DataParallel over N host
// devices and with DDP over N thread ranks, and the scaling efficiency
//     N-device throughput / (N x one-device throughput).
// One compute thread per device or rank (one device is one core): OpenBLAS runs on one thread
// everywhere, the single mode included.
//
// Each measurement builds the wrapper, runs --warmup steps, then times --steps steps (forward,
// backward, the reduction and the SGD update; the batches are views of the data set, so no
// loader is timed). The modes take turns, --reps rounds, and the best round of each is reported
// (the median beside it): on a shared machine the best round is the one least disturbed.
//
// The model's blocking (examples/mlp.hpp): each device or rank computes its shard in one pass;
// `single` cuts every batch into --devices parts computed the same way and summed pairwise, the
// one-device run whose gradients dp's are to the bit (ddp's too, for 2 ranks). A mode name may end
// in @N: passes of at most N samples instead (single@32, dp@32, ddp@32: the 32-sample blocks the
// model had before; their speed-ups are over single@N). `whole` is one device in one pass over the
// whole batch (the fastest one-device run; not bitwise any parallel one).
//
// Beside the throughput, the process's CPU time over the timed steps gives diagnostics that
// other programs on the machine cannot distort much: cores = CPU time / wall time (how many cores
// the mode actually got: on a busy machine a 2-device mode may get fewer than 2, and then its
// throughput says little), cpu_efficiency = single's CPU time per sample / the mode's (the
// work parallelism adds: copies, reductions, synchronisation; 1 = none), and
// min_cpu_us_per_sample, the least CPU time per sample of any round. The modes `apart` and
// `lockstep` run the ranks' work without the library (independent models, nothing exchanged;
// lockstep adds a barrier per step): what the machine's cores give, against which ddp's speed-up
// separates the library's cost from the machine's.
//
// Built a second time as scaling_mpi (DPARALLEL_BENCH_MPI): under `mpirun -np N` it measures DDP
// over the N MPI processes and writes one CSV that `scaling --mpi FILE` adds to its table.

#include "bench_util.hpp"
#include "blas_info.hpp"
#include "fashion_mnist.hpp"
#include "mlp.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>
#if DPARALLEL_BENCH_MPI
#include <dparallel/comm/mpi.hpp>
#endif

#include <algorithm>
#include <barrier>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dp = dparallel;

namespace {

char const* const usage =
    "usage: scaling [--batches 128,512] [--devices 2] [--steps 200] [--warmup 20] [--reps 3]\n"
    "               [--modes single,dp,ddp] [--data DIR] [--csv FILE] [--mpi FILE]\n"
    "  --modes    single, dp, ddp, ddp_view (ddp with gradient_as_bucket_view), zero (ZeRO-1 over the ddp\n"
    "             ranks), whole, torch; single, dp, ddp, ddp_view and zero may end in @N: passes of N samples; apart (each of --devices threads trains its own model\n"
    "             on its share of each batch, nothing exchanged) and lockstep (the same, meeting at a barrier\n"
    "             each step): the machine's capacity for the ranks' work, without the library;\n"
    "             scaling_mpi: lockstep, ddp, ddp_view over the processes (default all three)\n"
    "  --batches  global batch sizes (default 128,512)\n"
    "  --devices  devices (dp) and thread ranks (ddp) (default 2)\n"
    "  --steps    timed steps per measurement, after --warmup untimed ones (default 200, 20)\n"
    "  --reps     rounds; the best is reported (default 3)\n"
    "  --data     folder of the Fashion-MNIST IDX files (default /usr/share/datasets/fashion-mnist)\n"
    "  --csv      write the table as CSV\n"
    "  --mpi      CSV written by scaling_mpi (mpirun -np N scaling_mpi --csv FILE): adds DDP over MPI\n"
    "  --torch    a command that runs benchmarks/torch_mlp.py (e.g. 'python3 benchmarks/torch_mlp.py'): the\n"
    "             mode `torch` (PyTorch on one thread, same model and data) runs it once per round\n";

/// The training set; batch j of size b is rows [(j mod (n / b)) * b, ... + b): the data set in
/// file order, wrapping around.
struct workload {
  fashion_mnist::dataset train;

  /// Rows [first, first + count) of global batch j (of size b).
  [[nodiscard]] batch part(std::size_t j, std::size_t b, std::size_t first, std::size_t count) const {
    std::size_t const start = (j % (train.size() / b)) * b + first;
    return {dp::tensor_view<float const>(train.images.data() + start * mlp::inputs, count * mlp::inputs, count),
            dp::tensor_view<std::int32_t const>(train.labels.data() + start, count, count)};
  }
};

/// Plain SGD, dparallel::optim::sgd, in every mode: the same arithmetic, so the parallel modes'
/// parameters stay those of the one-device run they match, and the same code (on a DataParallel
/// wrapper the devices' threads share the update of the master: optim/optimizer.hpp).
using sgd_optimizer = dp::optim::optimizer<dp::optim::sgd>;

struct config {
  std::size_t steps = 200, warmup = 20;
  float lr = 0.05f;
  std::uint64_t seed = 1;
};

/// One timed run: samples per second, and CPU seconds (all threads of the process) per sample.
struct measurement {
  double samples_per_s = 0;
  double cpu_per_sample = 0;
};

/// CPU time of the whole process (every thread), in seconds.
double process_cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

/// Times `steps` calls of step(j) after `warmup` untimed ones.
template <class Step>
measurement throughput(config const& c, std::size_t batch_size, Step&& step) {
  for (std::size_t j = 0; j < c.warmup; ++j) step(j);
  double const cpu0 = process_cpu_seconds();
  auto const t0 = bench::clock::now();
  for (std::size_t j = c.warmup; j < c.warmup + c.steps; ++j) step(j);
  double const wall = bench::seconds_since(t0);
  auto const samples = static_cast<double>(c.steps * batch_size);
  return {samples / wall, (process_cpu_seconds() - cpu0) / samples};
}

#if !DPARALLEL_BENCH_MPI
/// One device; each batch in `parts` parts, passes of at most `block` samples (0: a part at once).
measurement run_single(workload const& w, config const& c, std::size_t b, std::size_t parts, std::size_t block) {
  mlp model(c.seed);
  model.split = {.parts = parts, .block = block};
  sgd_optimizer opt(model);
  return throughput(c, b, [&](std::size_t j) {
    model.forward_backward(w.part(j, b, 0, b));
    opt.step(model, c.lr);
  });
}

measurement run_dp(workload const& w, config const& c, std::size_t b, int devices, std::size_t block) {
  mlp model(c.seed);
  model.split.block = block;  // the replicas copy it
  dp::data_parallel<mlp> wrapper(model, dp::host::devices(devices));
  sgd_optimizer opt(wrapper);
  return throughput(c, b, [&](std::size_t j) {
    wrapper.step(w.part(j, b, 0, b), [](mlp& m, batch shard) { return m.forward_backward(shard); });
    opt.step(wrapper, c.lr);
  });
}

/// DDP over `ranks` thread ranks: rank r trains on rows [r b/ranks, (r+1) b/ranks) of each global
/// batch; rank 0's clock runs from a barrier after the warm-up to one after the last step.
/// DDP over `ranks` thread ranks (the example's SGD over each replica), or with `zero` ZeRO-1
/// (ddp_zero1 + zero_redundancy_optimizer with optim::sgd: each rank updates its shard, the
/// parameters all-gathered): the same arithmetic, so the same bits, and the same bytes moved.
/// With `view`, DDP all-reduces the model's gradient buffer in place (options::gradient_as_bucket_view:
/// no copies into bucket storage and back).
measurement run_ddp(workload const& w, config const& c, std::size_t b, int ranks, std::size_t block, bool zero = false,
                    bool view = false) {
  std::size_t const per_rank = b / static_cast<std::size_t>(ranks);
  std::barrier sync(ranks);
  measurement result;
  double cpu0 = 0;
  dp::spawn(ranks, [&](dp::rank_context& rank) {
    mlp model(c.seed);
    model.split.block = block;
    auto const first = static_cast<std::size_t>(rank.rank()) * per_rank;
    auto const run = [&](auto& wrapper, auto update) {
      auto step = [&](std::size_t j) {
        wrapper.step(w.part(j, b, first, per_rank), [](mlp& m, batch shard) { return m.forward_backward(shard); });
        update();
      };
      for (std::size_t j = 0; j < c.warmup; ++j) step(j);
      sync.arrive_and_wait();
      if (rank.rank() == 0) cpu0 = process_cpu_seconds();
      auto const t0 = bench::clock::now();
      for (std::size_t j = c.warmup; j < c.warmup + c.steps; ++j) step(j);
      sync.arrive_and_wait();
      if (rank.rank() == 0) {
        double const wall = bench::seconds_since(t0);
        auto const samples = static_cast<double>(c.steps * per_rank * static_cast<std::size_t>(ranks));
        result = {samples / wall, (process_cpu_seconds() - cpu0) / samples};
      }
    };
    if (zero) {
      dp::parallel<mlp, dp::ddp_zero1> z(model, rank.group());
      dp::optim::zero_redundancy_optimizer opt(z, dp::optim::sgd());
      run(z, [&] { opt.step(c.lr); });
    } else {
      dp::distributed_data_parallel<mlp> ddp(model, rank.group(), {.gradient_as_bucket_view = view});
      sgd_optimizer opt(ddp);
      run(ddp, [&] { opt.step(ddp, c.lr); });
    }
  });
  return result;
}

/// `ranks` threads that each train a model of their own on their share of every batch (rank r:
/// rows [r b/ranks, (r+1) b/ranks), as DDP's ranks) with nothing exchanged: what the machine
/// gives `ranks` copies of a rank's work (`apart`). With `lockstep` the threads also meet at a
/// barrier after every step, as the ranks of any synchronous data-parallel step must (no data
/// moved): the cost of waiting for the slower core each step. DDP's speed-up over these is the
/// share of the machine's parallel capacity left after the library's reduction and hand-overs.
measurement run_apart(workload const& w, config const& c, std::size_t b, int ranks, bool lockstep) {
  std::size_t const per_rank = b / static_cast<std::size_t>(ranks);
  std::barrier sync(ranks);
  measurement result;
  double cpu0 = 0;
  bench::clock::time_point t0;
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      mlp model(c.seed);
      sgd_optimizer opt(model);
      auto const first = static_cast<std::size_t>(r) * per_rank;
      auto const step = [&](std::size_t j) {
        model.forward_backward(w.part(j, b, first, per_rank));
        opt.step(model, c.lr);
        if (lockstep) sync.arrive_and_wait();
      };
      for (std::size_t j = 0; j < c.warmup; ++j) step(j);
      sync.arrive_and_wait();
      if (r == 0) {
        cpu0 = process_cpu_seconds();
        t0 = bench::clock::now();
      }
      for (std::size_t j = c.warmup; j < c.warmup + c.steps; ++j) step(j);
      sync.arrive_and_wait();
      if (r == 0) {
        double const wall = bench::seconds_since(t0);
        auto const samples = static_cast<double>(c.steps * per_rank * static_cast<std::size_t>(ranks));
        result = {samples / wall, (process_cpu_seconds() - cpu0) / samples};
      }
    });
  }
  for (auto& t : threads) t.join();
  return result;
}

/// PyTorch on one thread (benchmarks/torch_mlp.py, started by `command`): its own timing of the
/// same steps; the interpreter's start-up and the data loading are not timed.
measurement run_torch(std::string const& command, std::string const& dir, config const& c, std::size_t b) {
  std::string const cmd = command + " --data '" + dir + "' --batch " + std::to_string(b) + " --steps " +
                          std::to_string(c.steps) + " --warmup " + std::to_string(c.warmup) + " --lr " +
                          bench::fmt("%g", static_cast<double>(c.lr));
  measurement m;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return m;
  char line[256];
  while (std::fgets(line, sizeof line, p) != nullptr)
    (void)std::sscanf(line, "samples_per_s=%lf cpu_per_sample=%lf", &m.samples_per_s, &m.cpu_per_sample);
  if (pclose(p) != 0) {
    std::fprintf(stderr, "scaling: '%s' failed\n", cmd.c_str());
    return measurement{};
  }
  return m;
}

#endif

std::vector<std::string> split(std::string const& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  openblas_set_num_threads(1);  // one core per device or rank, the single mode included
  bench::args a(argc, argv, usage);
  auto const batches = a.list("batches", {128, 512});
  [[maybe_unused]] int const devices = static_cast<int>(a.num("devices", 2));
  config c;
  c.steps = static_cast<std::size_t>(a.num("steps", 200));
  c.warmup = static_cast<std::size_t>(a.num("warmup", 20));
  int const reps = static_cast<int>(a.num("reps", 3));
  std::string const modes_text = a.str("modes", "");
#if DPARALLEL_BENCH_MPI
  auto const modes = split(modes_text.empty() ? "lockstep,ddp,ddp_view" : modes_text);
#else
  auto const modes = split(modes_text.empty() ? "single,dp,ddp" : modes_text);
#endif
  std::string const dir = a.str("data", fashion_mnist::default_dir);
  std::string const csv = a.str("csv", "");
  std::string const mpi_csv = a.str("mpi", "");
  [[maybe_unused]] std::string const torch = a.str("torch", "");
  a.done();
  blas_info::report const blas = blas_info::detect();
  if (auto const w = blas_info::warning(blas); !w.empty()) std::fprintf(stderr, "scaling: %s\n", w.c_str());

  workload w{fashion_mnist::load(dir, "train")};

#if DPARALLEL_BENCH_MPI
  // DDP over the processes of MPI_COMM_WORLD; rank 0 writes ranks,batch,best,median.
  {
    auto const world = dp::mpi::init_process_group();  // initialises MPI; finalised at exit
    dp::process_group const& group = world;
    int const ranks = group.size();
    bench::table t({"ranks", "batch", "samples_per_s_best", "samples_per_s_median", "cpu_per_sample", "mode"});
    // ddp: DDP as in the thread-rank rows; ddp_view: options::gradient_as_bucket_view, with which
    // DDP moves the model's gradients into the group's memory (mlp::bind_gradients), so the
    // all-reduces read and write every rank's gradients in place. The two take turns, round by round.
    // lockstep: each process trains a model of its own on its share, meeting at the group's
    // barrier after each step (nothing reduced): what processes on this machine can give.
    std::vector<std::string> const& kinds = modes;
    for (auto const& kind : kinds)
      if (kind != "lockstep" && kind != "ddp" && kind != "ddp_view") {
        if (group.rank() == 0) std::fprintf(stderr, "scaling_mpi: unknown mode '%s'\n%s", kind.c_str(), usage);
        return 2;
      }
    for (double bd : batches) {
      auto const b = static_cast<std::size_t>(bd);
      std::size_t const per_rank = b / static_cast<std::size_t>(ranks);
      std::map<std::string, std::vector<double>> got, cpu;
      for (int k = 0; k < reps; ++k) {
        for (auto const& kind : kinds) {
          mlp model(c.seed);
          auto const first = static_cast<std::size_t>(group.rank()) * per_rank;
          // Times `step` over the timed steps, after the warm-up and a barrier.
          auto const measure = [&](auto&& step) {
            for (std::size_t j = 0; j < c.warmup; ++j) step(j);
            group.barrier().wait();
            double const cpu0 = process_cpu_seconds();
            auto const t0 = bench::clock::now();
            for (std::size_t j = c.warmup; j < c.warmup + c.steps; ++j) step(j);
            group.barrier().wait();
            double const wall = bench::seconds_since(t0);
            std::vector<double> used{process_cpu_seconds() - cpu0};  // summed over the processes
            group.all_reduce(dp::view(used)).wait();
            auto const samples = static_cast<double>(c.steps * per_rank * static_cast<std::size_t>(ranks));
            got[kind].push_back(samples / wall);
            cpu[kind].push_back(used[0] / samples);
          };
          if (kind == "lockstep") {
            sgd_optimizer opt(model);
            measure([&](std::size_t j) {
              model.forward_backward(w.part(j, b, first, per_rank));
              opt.step(model, c.lr);
              group.barrier().wait();
            });
            continue;
          }
          bool const view = kind == "ddp_view";
          dp::distributed_data_parallel<mlp> ddp(model, group, {.gradient_as_bucket_view = view});
          sgd_optimizer opt(ddp);
          measure([&](std::size_t j) {
            ddp.step(w.part(j, b, first, per_rank), [](mlp& m, batch shard) { return m.forward_backward(shard); });
            opt.step(ddp, c.lr);
          });
        }
      }
      for (auto const& kind : kinds) {
        auto const& g = got[kind];
        auto const best = static_cast<std::size_t>(std::max_element(g.begin(), g.end()) - g.begin());
        t.add({bench::fmt("%d", ranks), bench::fmt("%zu", b), bench::fmt("%.1f", g[best]), bench::fmt("%.1f", bench::median(g)),
               bench::fmt("%.9g", cpu[kind][best]), kind});
      }
    }
    if (group.rank() == 0) {
      std::printf("# DDP over %d MPI processes, reference workload; %s\n", ranks, bench::load_note().c_str());
      t.print();
      t.write_csv(csv);
    }
  }
  dp::mpi::finalize();
  return 0;
#else
  // (batch, mode) -> each round's measurement.
  std::map<std::pair<std::size_t, std::string>, std::vector<measurement>> got;
  for (double bd : batches) {
    auto const b = static_cast<std::size_t>(bd);
    for (int k = 0; k < reps; ++k) {
      for (auto const& m : modes) {
        measurement v;
        auto const at = m.find('@');
        std::string const kind = m.substr(0, at);
        std::size_t const block = at == std::string::npos ? 0 : std::stoul(m.substr(at + 1));
        auto const parts = static_cast<std::size_t>(devices);
        if (kind == "single") v = run_single(w, c, b, parts, block);
        else if (m == "whole") v = run_single(w, c, b, 1, 0);
        else if (kind == "dp") v = run_dp(w, c, b, devices, block);
        else if (kind == "ddp") v = run_ddp(w, c, b, devices, block);
        else if (kind == "zero") v = run_ddp(w, c, b, devices, block, true);
        else if (kind == "ddp_view") v = run_ddp(w, c, b, devices, block, false, true);
        else if (m == "apart" || m == "lockstep") v = run_apart(w, c, b, devices, m == "lockstep");
        else if (m == "torch" && !torch.empty()) v = run_torch(torch, dir, c, b);
        else {
          std::fprintf(stderr, "scaling: unknown mode '%s' (single, dp, ddp; torch with --torch)\n", m.c_str());
          return 2;
        }
        got[{b, m}].push_back(v);
        std::fprintf(stderr, "  batch %zu, %s, round %d: %.0f samples/s\n", b, m.c_str(), k + 1, v.samples_per_s);
      }
    }
  }
  // batch -> DDP over MPI processes: ranks, best and median samples/s, CPU seconds per sample.
  struct mpi_row {
    int ranks = 0;
    double best = 0, median = 0, cpu = 0;
  };
  std::map<std::pair<std::size_t, std::string>, mpi_row> mpi;  // (batch, ddp or ddp_view)
  if (!mpi_csv.empty()) {
    std::ifstream f(mpi_csv);
    std::string line;
    std::getline(f, line);
    while (std::getline(f, line)) {
      auto const cells = split(line);
      if (cells.size() >= 5)
        mpi[{std::stoull(cells[1]), cells.size() >= 6 ? cells[5] : "ddp"}] = {std::stoi(cells[0]), std::stod(cells[2]),
                                                                            std::stod(cells[3]), std::stod(cells[4])};
    }
    if (mpi.empty()) std::fprintf(stderr, "scaling: no DDP-over-MPI rows in %s\n", mpi_csv.c_str());
  }

  std::printf("# reference workload (784-512-ReLU-10 MLP, Fashion-MNIST, SGD), %zu timed steps after %zu; "
              "best of %d rounds; %s\n",
              c.steps, c.warmup, reps, bench::load_note().c_str());
  bench::table t({"batch", "mode", "devices", "samples_per_s", "median_samples_per_s", "speedup", "efficiency", "cores",
                  "cpu_efficiency", "min_cpu_us_per_sample"});
  std::vector<std::string> vs_torch;
  for (double bd : batches) {
    auto const b = static_cast<std::size_t>(bd);
    auto const best = [&](std::string const& m) {
      auto const& v = got[{b, m}];
      auto it = std::max_element(v.begin(), v.end(), [](measurement const& x, measurement const& y) {
        return x.samples_per_s < y.samples_per_s;
      });
      return it == v.end() ? measurement{} : *it;
    };
    auto const med = [&](std::string const& m) {
      std::vector<double> v;
      for (auto const& x : got[{b, m}]) v.push_back(x.samples_per_s);
      return bench::median(v);
    };
    // The reference of a mode: single with the same @N (single when there is none).
    auto const reference = [&](std::string const& m) {
      auto const at = m.find('@');
      std::string const r = at == std::string::npos ? "single" : "single" + m.substr(at);
      return got.count({b, r}) != 0 ? best(r) : best("single");
    };
    auto add = [&](std::string const& m, int n, measurement const& x, double median) {
      measurement const single = reference(m);
      double min_cpu = x.cpu_per_sample;  // the least CPU time per sample of any round
      for (auto const& r : got[{b, m}])
        if (r.cpu_per_sample > 0) min_cpu = std::min(min_cpu, r.cpu_per_sample);
      bool const ref = single.samples_per_s > 0;
      t.add({bench::fmt("%zu", b), m, bench::fmt("%d", n), bench::fmt("%.1f", x.samples_per_s), bench::fmt("%.1f", median),
             ref ? bench::fmt("%.3f", x.samples_per_s / single.samples_per_s) : "",
             ref ? bench::fmt("%.3f", x.samples_per_s / (n * single.samples_per_s)) : "",
             bench::fmt("%.2f", x.cpu_per_sample * x.samples_per_s),
             ref && x.cpu_per_sample > 0 ? bench::fmt("%.3f", single.cpu_per_sample / x.cpu_per_sample) : "",
             bench::fmt("%.2f", min_cpu * 1e6)});
    };
    for (auto const& m : modes)
      add(m, m.starts_with("single") || m == "whole" || m == "torch" ? 1 : devices, best(m), med(m));
    // Against PyTorch on one thread: samples/s, and CPU time per sample (torch's over the mode's:
    // the work per sample, which the machine's load distorts far less).
    if (measurement const th = best("torch"); th.samples_per_s > 0) {
      for (auto const& m : modes)
        if (measurement const x = best(m); (m.starts_with("dp") || m.starts_with("ddp")) && x.samples_per_s > 0)
          vs_torch.push_back(bench::fmt("batch %zu: ", b) + m +
                             bench::fmt(" / torch (1 thread) = %.3f (samples/s), %.3f (CPU time per sample)",
                                        x.samples_per_s / th.samples_per_s,
                                        x.cpu_per_sample > 0 ? th.cpu_per_sample / x.cpu_per_sample : 0.0));
    }
    // ZeRO-1 against DDP at the same world size: the step time ratio (best rounds, and medians).
    for (auto const& m : modes) {
      if (!m.starts_with("zero")) continue;
      std::string const d = "ddp" + m.substr(4);
      if (measurement const z = best(m), x = best(d); z.samples_per_s > 0 && x.samples_per_s > 0)
        vs_torch.push_back(bench::fmt("batch %zu: ", b) + m + " step time / " + d +
                           bench::fmt("'s = %.3f (best rounds), %.3f (medians)", x.samples_per_s / z.samples_per_s,
                                      med(d) / med(m)));
    }
    for (std::string const kind : {"lockstep", "ddp", "ddp_view"})
      if (auto it = mpi.find({b, kind}); it != mpi.end())
        add(kind + "_mpi", it->second.ranks, measurement{it->second.best, it->second.cpu}, it->second.median);
  }
  t.print();
  t.write_csv(csv);
  for (auto const& line : vs_torch) std::printf("# %s\n", line.c_str());
  std::printf("# %s\n# %s\n", bench::load_note().c_str(), blas_info::summary(blas).c_str());
  return 0;
#endif
}

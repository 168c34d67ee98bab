// comm_hooks: what DDP's communication hooks (docs/comm-hooks.md) cost and save, per step, against
// the default average: the bytes each rank hands to its collectives (counted by a communicator
// that forwards to the host engine) and the step time, on thread ranks (default 2) of a model of
// --params parameters (default 24 M, in 24 tensors, one flat gradient buffer) whose step function
// only writes its gradients (a cheap deterministic formula) and marks them ready, so the step is
// the gradient reduction: the copies into the buckets, the compression, the all-reduce and the
// write-back. Built a second time as comm_hooks_mpi (with MPI): the same measurement over the MPI
// processes it runs on (`mpirun -np 2 comm_hooks_mpi`; on one node the engine uses shared memory).
// The hooks take turns (none, fp16, bf16, bf16 with error feedback), --rounds times;
// each turn wraps the rank's model anew and takes one untimed step first. Times are medians and
// bests over the rounds; ratios are against `none` measured in the same rounds. On the host engine the all-reduce is memory copies
// and sums: halving its bytes saves time only where those dominate the conversion work.

#include "bench_util.hpp"

#include <dparallel/dparallel.hpp>
#if DPARALLEL_BENCH_MPI
#include <dparallel/comm/mpi.hpp>

#include <mpi.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace dp = dparallel;

namespace {

char const* const usage =
    "usage: comm_hooks [--params 24000000] [--ranks 2] [--steps 3] [--rounds 5] [--bucket-mb 25] [--csv FILE]\n"
    "       mpirun -np N comm_hooks_mpi [same options but --ranks]\n"
    "  --steps   steps per hook and round; the hooks take turns, --rounds times\n";

/// A communicator that counts the bytes of every reduction it forwards to `inner`.
class counting_comm {
 public:
  explicit counting_comm(dp::process_group inner) : inner_(std::move(inner)) {}
  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  dp::work all_reduce(dp::tensor_ref t, dp::reduce_op op) {
    bytes_ += t.size_bytes();
    return inner_.all_reduce(t, op);
  }
  dp::work reduce(dp::tensor_ref t, int root, dp::reduce_op op) {
    bytes_ += t.size_bytes();
    return inner_.reduce(t, root, op);
  }
  dp::work broadcast(dp::tensor_ref t, int root) { return inner_.broadcast(t, root); }
  dp::work reduce_scatter(dp::tensor_ref out, dp::tensor_ref in, dp::reduce_op op) {
    bytes_ += in.size_bytes();
    return inner_.reduce_scatter(out, in, op);
  }
  dp::work all_gather(dp::tensor_ref out, dp::tensor_ref in) { return inner_.all_gather(out, in); }
  dp::work barrier() { return inner_.barrier(); }
  void abort(std::string why) { inner_.abort(std::move(why)); }
  void drain() { inner_.drain(); }
  /// Bytes reduced since the last call.
  std::size_t take_bytes() { return bytes_.exchange(0); }

 private:
  dp::process_group inner_;
  std::atomic<std::size_t> bytes_{0};
};

/// --params parameters in 24 tensors over one flat buffer each for values and gradients.
struct flat_model {
  std::vector<std::size_t> sizes;
  std::vector<float> w, g;
  explicit flat_model(std::size_t n) : w(n, 0.5f), g(n, 0.0f) {
    for (std::size_t k = 0; k < 24; ++k) sizes.push_back(n * (k + 1) / 24 - n * k / 24);
  }
  [[nodiscard]] std::vector<dp::tensor_view<float>> views(std::vector<float>& v) const {
    std::vector<dp::tensor_view<float>> out;
    std::size_t o = 0;
    for (std::size_t s : sizes) {
      out.emplace_back(v.data() + o, s);
      o += s;
    }
    return out;
  }
  std::vector<dp::tensor_view<float>> parameters() { return views(w); }
  std::vector<dp::tensor_view<float>> gradients() { return views(g); }
};

struct hook_kind {
  char const* name;
  int kind;  // 0 none, 1 fp16, 2 bf16, 3 bf16 + error feedback
};

struct settings {
  std::size_t params;
  int steps, rounds;
  double bucket_mb;
};

std::vector<hook_kind> const hooks{{"none", 0}, {"fp16", 1}, {"bf16", 2}, {"bf16+ef", 3}};

/// One rank's part: every hook in turn, --rounds times. On rank 0 it fills `times` (seconds per
/// step, one per round and hook) and `bytes` (reduced bytes per step and hook).
void run_rank(dp::process_group inner, settings const& cfg, std::vector<std::vector<double>>& times,
              std::vector<std::size_t>& bytes) {
  auto comm = std::make_shared<counting_comm>(std::move(inner));
  dp::process_group const group(comm);
  flat_model model(cfg.params);
  std::vector<float> batch(1, static_cast<float>(group.rank() + 1));
  auto const fn = [](flat_model& m, std::span<const float> b, dp::step_context& ctx) {
    std::size_t end = m.g.size();
    for (std::size_t p = m.sizes.size(); p-- > 0;) {  // backward: last tensor first, each marked ready
      std::size_t const first = end - m.sizes[p];
      for (std::size_t j = first; j < end; ++j) m.g[j] = m.w[j] * 0.001f * b[0] + static_cast<float>(j % 7);
      ctx.grad_ready(p);
      end = first;
    }
  };
  for (int round = -1; round < cfg.rounds; ++round) {  // round -1 warms up
    for (std::size_t h = 0; h < hooks.size(); ++h) {
      // A wrapper per hook and round (one model may have one wrapper at a time), warmed up by
      // one untimed step (its buckets are rebuilt after the first).
      dp::distributed_data_parallel<flat_model> ddp(model, group, dp::options{.bucket_cap_mb = cfg.bucket_mb});
      auto& red = ddp.reducer();
      if (hooks[h].kind == 1) red.register_comm_hook(dp::compress_state{}, dp::fp16_compress);
      if (hooks[h].kind == 2) red.register_comm_hook(dp::compress_state{}, dp::bf16_compress);
      if (hooks[h].kind == 3) red.register_comm_hook(dp::compress_state{.error_feedback = true}, dp::bf16_compress);
      ddp.step(batch, fn);
      group.barrier().wait();
      (void)comm->take_bytes();
      auto const t0 = bench::clock::now();
      for (int s = 0; s < cfg.steps; ++s) ddp.step(batch, fn);
      group.barrier().wait();
      double const t = bench::seconds_since(t0) / cfg.steps;
      std::size_t const b = comm->take_bytes();
      if (group.rank() == 0 && round >= 0) {
        times[h].push_back(t);
        bytes[h] = b / static_cast<std::size_t>(cfg.steps);
      }
    }
  }
}

void report(std::vector<std::vector<double>> const& times, std::vector<std::size_t> const& bytes,
            std::string const& csv) {
  bench::table t({"hook", "bytes_per_step", "bytes_vs_none", "median_s", "best_s", "median_vs_none"});
  double const base = bench::median(times[0]);
  for (std::size_t h = 0; h < hooks.size(); ++h) {
    double const med = bench::median(times[h]);
    double const best = *std::min_element(times[h].begin(), times[h].end());
    t.add({hooks[h].name, std::to_string(bytes[h]),
           bench::fmt("%.3f", static_cast<double>(bytes[h]) / static_cast<double>(bytes[0])), bench::fmt("%.4f", med),
           bench::fmt("%.4f", best), bench::fmt("%.3f", med / base)});
  }
  t.print();
  t.write_csv(csv);
  std::printf("%s\n", bench::load_note().c_str());
}

}  // namespace

int main(int argc, char** argv) {
#if DPARALLEL_BENCH_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);  // the engine calls MPI from its thread
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
#endif
  bench::args a(argc, argv, usage);
  auto const params = static_cast<std::size_t>(a.num("params", 24e6));
#if !DPARALLEL_BENCH_MPI
  int const ranks = static_cast<int>(a.num("ranks", 2));
#endif
  settings const cfg{params, static_cast<int>(a.num("steps", 3)), static_cast<int>(a.num("rounds", 5)),
                     a.num("bucket-mb", 25)};
  std::string const csv = a.str("csv", "");
  a.done();

  std::vector<std::vector<double>> times(hooks.size());  // rank 0's seconds per step, one per round
  std::vector<std::size_t> bytes(hooks.size(), 0);       // rank 0's reduced bytes per step
#if DPARALLEL_BENCH_MPI
  if (rank == 0)
    std::printf("comm_hooks_mpi: %zu parameters (%.1f MB of F32 gradients), %d MPI processes, %s\n", params,
                static_cast<double>(params) * 4 / 1e6, ranks, bench::load_note().c_str());
  run_rank(dp::mpi::make_group(MPI_COMM_WORLD), cfg, times, bytes);
  if (rank == 0) report(times, bytes, csv);
  dp::mpi::finalize();  // before MPI_Finalize: the engine's thread and groups end first
  MPI_Finalize();
#else
  std::printf("comm_hooks: %zu parameters (%.1f MB of F32 gradients), %d thread ranks, %s\n", params,
              static_cast<double>(params) * 4 / 1e6, ranks, bench::load_note().c_str());
  dp::spawn(ranks, [&](dp::rank_context& rank) { run_rank(rank.group(), cfg, times, bytes); });
  report(times, bytes, csv);
#endif
}

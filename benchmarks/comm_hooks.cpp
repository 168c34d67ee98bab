// comm_hooks: what DDP's communication hooks (docs/comm-hooks.md) cost and save, per step, against
// the default average: the bytes each rank hands to its collectives (counted by a communicator
// that forwards to the host engine) and the step time, on thread ranks (default 2) of a model of
// --params parameters (default 24 M, in 24 tensors, one flat gradient buffer) whose step function
// only writes its gradients (a cheap deterministic formula) and marks them ready, so the step is
// the gradient reduction: the copies into the buckets, the compression, the all-reduce and the
// write-back. The hooks take turns (none, fp16, bf16, bf16 with error feedback), --rounds times;
// each turn wraps the rank's model anew and takes one untimed step first. Times are medians and
// bests over the rounds; ratios are against `none` measured in the same rounds. On the host engine the all-reduce is memory copies
// and sums: halving its bytes saves time only where those dominate the conversion work.

#include "bench_util.hpp"

#include <dparallel/dparallel.hpp>

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

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv, usage);
  auto const params = static_cast<std::size_t>(a.num("params", 24e6));
  int const ranks = static_cast<int>(a.num("ranks", 2));
  int const steps = static_cast<int>(a.num("steps", 3));
  int const rounds = static_cast<int>(a.num("rounds", 5));
  double const bucket_mb = a.num("bucket-mb", 25);
  std::string const csv = a.str("csv", "");
  a.done();

  std::vector<hook_kind> const hooks{{"none", 0}, {"fp16", 1}, {"bf16", 2}, {"bf16+ef", 3}};
  std::size_t const nh = hooks.size();
  std::vector<std::vector<double>> times(nh);  // rank 0's seconds per step, one per round
  std::vector<std::size_t> bytes(nh, 0);       // rank 0's reduced bytes per step
  std::printf("comm_hooks: %zu parameters (%.1f MB of F32 gradients), %d thread ranks, %s\n", params,
              static_cast<double>(params) * 4 / 1e6, ranks, bench::load_note().c_str());

  dp::spawn(ranks, [&](dp::rank_context& rank) {
    auto comm = std::make_shared<counting_comm>(rank.group());
    dp::process_group const group(comm);
    flat_model model(params);
    std::vector<float> batch(1, static_cast<float>(rank.rank() + 1));
    auto const fn = [](flat_model& m, std::span<const float> b, dp::step_context& ctx) {
      std::size_t end = m.g.size();
      for (std::size_t p = m.sizes.size(); p-- > 0;) {  // backward: last tensor first, each marked ready
        std::size_t const first = end - m.sizes[p];
        for (std::size_t j = first; j < end; ++j) m.g[j] = m.w[j] * 0.001f * b[0] + static_cast<float>(j % 7);
        ctx.grad_ready(p);
        end = first;
      }
    };
    for (int round = -1; round < rounds; ++round) {  // round -1 warms up
      for (std::size_t h = 0; h < nh; ++h) {
        // A wrapper per hook and round (one model may have one wrapper at a time), warmed up by
        // one untimed step (its buckets are rebuilt after the first).
        dp::distributed_data_parallel<flat_model> ddp(model, group, dp::options{.bucket_cap_mb = bucket_mb});
        auto& red = ddp.reducer();
        if (hooks[h].kind == 1) red.register_comm_hook(dp::compress_state{}, dp::fp16_compress);
        if (hooks[h].kind == 2) red.register_comm_hook(dp::compress_state{}, dp::bf16_compress);
        if (hooks[h].kind == 3) red.register_comm_hook(dp::compress_state{.error_feedback = true}, dp::bf16_compress);
        ddp.step(batch, fn);
        group.barrier().wait();
        (void)comm->take_bytes();
        auto const t0 = bench::clock::now();
        for (int s = 0; s < steps; ++s) ddp.step(batch, fn);
        group.barrier().wait();
        double const t = bench::seconds_since(t0) / steps;
        std::size_t const b = comm->take_bytes();
        if (rank.rank() == 0 && round >= 0) {
          times[h].push_back(t);
          bytes[h] = b / static_cast<std::size_t>(steps);
        }
      }
    }
  });

  bench::table t({"hook", "bytes_per_step", "bytes_vs_none", "median_s", "best_s", "median_vs_none"});
  double const base = bench::median(times[0]);
  for (std::size_t h = 0; h < nh; ++h) {
    double const med = bench::median(times[h]);
    double const best = *std::min_element(times[h].begin(), times[h].end());
    char b1[32], b2[32], b3[32], b4[32];
    std::snprintf(b1, sizeof b1, "%.3f", static_cast<double>(bytes[h]) / static_cast<double>(bytes[0]));
    std::snprintf(b2, sizeof b2, "%.4f", med);
    std::snprintf(b3, sizeof b3, "%.4f", best);
    std::snprintf(b4, sizeof b4, "%.3f", med / base);
    t.add({hooks[h].name, std::to_string(bytes[h]), b1, b2, b3, b4});
  }
  t.print();
  t.write_csv(csv);
  std::printf("%s\n", bench::load_note().c_str());
}

// mlp_cost: where one device's time goes on the reference workload, against what one
// forward + backward over the whole batch would cost (the way PyTorch runs it).
//
// The example's model (examples/mlp.hpp) computes a batch in passes of at most split.block
// samples and sums the passes' gradients pairwise, so that single, dp and ddp give the same bits;
// train_mlp's default pass is a device's whole shard. This program measures, on one thread, in CPU
// time per sample (the load of a shared machine distorts CPU time far less than wall time), modes
// taking turns, best of the rounds, for each pass size <rows> from 32, doubling, to the batch:
//   model_<rows>     mlp::forward_backward over a batch in passes of <rows> (pairwise sums)
//   gemms_<rows>     only the five GEMMs one forward + backward runs, over passes of <rows>
//                    samples (the output layer's and the first layer's gradient GEMMs write
//                    their whole result each pass); <rows> = batch is the one-pass cost
// over_model_32 is model_32's time over the mode's (what a pass size gains over 32-sample blocks);
// over_one_pass is the mode's time over gemms_<batch> (its cost against one-pass GEMMs alone).
// All of it is arithmetic layout: the library is not involved.
//   mlp_cost [--batch 128] [--rounds 5] [--steps 200] [--csv FILE]

#include "bench_util.hpp"
#include "blas_info.hpp"
#include "mlp.hpp"

#include <ctime>

namespace {

double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

// The GEMMs of one forward + backward of the 784-512-10 MLP over `rows` samples, with the
// shapes and transpositions examples/mlp.hpp uses.
struct gemms {
  int rows;
  std::vector<float> x, w1, w2, h, z, dh, g1, g2;
  explicit gemms(int r)
      : rows(r),
        x(static_cast<std::size_t>(r) * mlp::inputs, 0.25f),
        w1(mlp::inputs * mlp::hidden, 0.01f),
        w2(mlp::hidden * mlp::classes, 0.01f),
        h(static_cast<std::size_t>(r) * mlp::hidden),
        z(static_cast<std::size_t>(r) * mlp::classes),
        dh(h.size()),
        g1(w1.size()),
        g2(w2.size()) {}
  void run() {
    int const n = rows, in = int{mlp::inputs}, hid = int{mlp::hidden}, cls = int{mlp::classes};
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hid, in, 1.0f, x.data(), in, w1.data(), hid, 0.0f,
                h.data(), hid);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, cls, hid, 1.0f, h.data(), hid, w2.data(), cls, 0.0f,
                z.data(), cls);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, hid, cls, n, 1.0f, h.data(), hid, z.data(), cls, 0.0f,
                g2.data(), cls);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, hid, cls, 1.0f, z.data(), cls, w2.data(), cls, 0.0f,
                dh.data(), hid);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, hid, n, 1.0f, x.data(), in, dh.data(), hid, 0.0f,
                g1.data(), hid);
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv,
                "mlp_cost [--batch 128] [--rounds 5] [--steps 200] [--csv FILE]\n"
                "One device's CPU time per sample: the example model against its GEMMs alone.\n");
  auto const batch = static_cast<std::size_t>(a.num("batch", 128));
  int const rounds = static_cast<int>(a.num("rounds", 5));
  int const steps = static_cast<int>(a.num("steps", 200));
  std::string const csv = a.str("csv", "");
  a.done();
  openblas_set_num_threads(1);

  std::vector<float> images(batch * mlp::inputs);
  std::vector<std::int32_t> labels(batch);
  splitmix64 rng(7);
  for (float& v : images) v = rng.uniform();
  for (auto& y : labels) y = static_cast<std::int32_t>(rng.below(mlp::classes));
  ::batch const b{dparallel::tensor_view<float const>(images.data(), images.size(), batch),
                  dparallel::tensor_view<std::int32_t const>(labels.data(), batch, batch)};

  // The pass sizes: 32, doubling up to the whole batch; per size, the model and its GEMMs alone.
  std::vector<int> rows;
  for (std::size_t r = 32; r < batch; r *= 2) rows.push_back(static_cast<int>(r));
  rows.push_back(static_cast<int>(batch));
  std::vector<mlp> models;
  std::vector<gemms> g;
  for (int r : rows) {
    models.emplace_back(1).split.block = static_cast<std::size_t>(r);
    g.emplace_back(r);
  }

  // One timed unit per mode: `steps` batches. Modes (model_<rows>, gemms_<rows>, ...) take turns.
  std::size_t const modes = 2 * rows.size();
  auto run_mode = [&](std::size_t m) {
    if (m % 2 == 0) {
      (void)models[m / 2].forward_backward(b);
      return;
    }
    gemms& k = g[m / 2];
    for (std::size_t first = 0; first < batch; first += static_cast<std::size_t>(k.rows)) k.run();
  };
  for (std::size_t m = 0; m < modes; ++m)
    for (int i = 0; i < 10; ++i) run_mode(m);  // warm-up
  std::vector<double> best(modes, 1e300);
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t m = 0; m < modes; ++m) {
      double const t0 = cpu_seconds();
      for (int i = 0; i < steps; ++i) run_mode(m);
      best[m] = std::min(best[m], (cpu_seconds() - t0) / (static_cast<double>(steps) * static_cast<double>(batch)));
    }
  }

  std::printf("# one device, batch %zu: CPU time per sample, best of %d rounds of %d batches; %s\n", batch, rounds,
              steps, bench::load_note().c_str());
  std::printf("# %s\n", blas_info::summary(blas_info::detect()).c_str());
  bench::table t({"mode", "rows_per_gemm", "cpu_us_per_sample", "samples_per_cpu_s", "over_model_32",
                  "over_one_pass"});
  double const one_pass = best[modes - 1];
  for (std::size_t m = 0; m < modes; ++m) {
    std::string const name = bench::fmt(m % 2 == 0 ? "model_%d" : "gemms_%d", rows[m / 2]);
    t.add({name, bench::fmt("%d", rows[m / 2]), bench::fmt("%.2f", best[m] * 1e6), bench::fmt("%.0f", 1.0 / best[m]),
           bench::fmt("%.3f", best[0] / best[m]), bench::fmt("%.3f", best[m] / one_pass)});
  }
  t.print();
  if (!csv.empty()) t.write_csv(csv);
  return 0;
}

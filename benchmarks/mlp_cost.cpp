// mlp_cost: where one device's time goes on the reference workload, against what one
// forward + backward over the whole batch would cost (the way PyTorch runs it).
//
// The example's model (examples/mlp.hpp) computes a batch in blocks of mlp::block samples and
// sums the blocks' gradients pairwise, so that single, dp and ddp give the same bits. This
// program measures, on one thread, in CPU time per sample (the load of a shared machine distorts
// CPU time far less than wall time), modes taking turns, best of the rounds:
//   model            mlp::forward_backward over a batch (blocks of mlp::block, pairwise sums)
//   gemms_<rows>     only the five GEMMs one forward + backward runs, over blocks of <rows>
//                    samples (the output layer's and the first layer's gradient GEMMs write
//                    their whole result each block); <rows> = batch is the one-pass cost
// The ratio gemms_<batch> / model is the throughput a one-pass model would have over ours on
// this BLAS, all of it arithmetic layout: the library is not involved.
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

  mlp model(1);
  std::vector<float> images(batch * mlp::inputs);
  std::vector<std::int32_t> labels(batch);
  splitmix64 rng(7);
  for (float& v : images) v = rng.uniform();
  for (auto& y : labels) y = static_cast<std::int32_t>(rng.below(mlp::classes));
  ::batch const b{dparallel::tensor_view<float const>(images.data(), images.size(), batch),
                  dparallel::tensor_view<std::int32_t const>(labels.data(), batch, batch)};

  // The block sizes: the model's, then doubling up to the whole batch.
  std::vector<int> blocks;
  for (std::size_t r = mlp::block; r < batch; r *= 2) blocks.push_back(static_cast<int>(r));
  blocks.push_back(static_cast<int>(batch));
  std::vector<gemms> g;
  for (int r : blocks) g.emplace_back(r);

  // One timed unit per mode: `steps` batches. Modes take turns each round.
  std::size_t const modes = 1 + g.size();
  auto run_mode = [&](std::size_t m) {
    if (m == 0) {
      (void)model.forward_backward(b);
      return;
    }
    gemms& k = g[m - 1];
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
  bench::table t({"mode", "rows_per_gemm", "cpu_us_per_sample", "samples_per_cpu_s", "over_model"});
  for (std::size_t m = 0; m < modes; ++m) {
    std::string const name = m == 0 ? "model" : bench::fmt("gemms_%d", g[m - 1].rows);
    int const rows = m == 0 ? static_cast<int>(mlp::block) : g[m - 1].rows;
    t.add({name, bench::fmt("%d", rows), bench::fmt("%.2f", best[m] * 1e6), bench::fmt("%.0f", 1.0 / best[m]),
           bench::fmt("%.3f", best[0] / best[m])});
  }
  t.print();
  if (!csv.empty()) t.write_csv(csv);
  return 0;
}

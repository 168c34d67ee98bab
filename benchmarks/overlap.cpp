// overlap: how much of DDP's communication hides behind backward when the model calls
// step_context::grad_ready as each gradient is finished.
//
// The model is a deep MLP (default 24 layers of 512 x 512 with ReLU, MSE loss, synthetic data,
// 16 samples per rank: enough compute that the reduction of 24 MiB of gradients can hide in it)
// whose parameters and gradients each live in one flat buffer. Per rank and step, four times are
// measured over the same ranks (thread ranks of one process, one core each):
//   compute   forward + backward, every rank at once, no DDP; the ranks meet at a barrier after
//             each step, as every synchronous step does (a step waits for the slowest rank, and
//             that wait is not communication);
//   comm      a DDP step whose step function does nothing: the gradient reduction alone;
//   serial    a DDP step whose model never calls grad_ready: every bucket is reduced after
//             backward (communication exposed);
//   overlap   the same step with grad_ready: a bucket is reduced as soon as its gradients are done.
// hidden = (compute + comm - overlap) / comm is the share of the communication time that the
// overlapped step did not pay for (1: all of it hidden, 0: none). The serial step often pays more
// for communication than the comm step alone, so a second share is printed beside it:
// hidden_vs_serial = (serial - overlap) / (serial - compute), the part of the serial step's exposed
// communication that overlapping removed.
//
// What the cores allow. The host communicator's work (copies and sums) runs on CPU threads. The
// process's CPU time per step is measured beside each wall time (std::clock: every thread). An
// overlapped step must do the CPU work of both the compute step and the comm step, so on C
// hardware threads it takes at least (compute_cpu + comm_cpu) / C, and
//   hidden_limit = (compute + comm - (compute_cpu + comm_cpu) / C) / comm
// is the most any overlap could hide on this machine. When the ranks' compute already fills every
// core (C = ranks), it is about the comm step's idle share: hiding needs idle cores (or a copy
// engine, as on a GPU), not a better schedule.
// --bucket-view also runs the DDP steps with options::gradient_as_bucket_view (buckets are views
// of the flat gradient buffer: no copies into and out of bucket storage).

#include "bench_util.hpp"
#include "blas_info.hpp"

#include <dparallel/dparallel.hpp>

#include <cblas.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

extern "C" void openblas_set_num_threads(int);

namespace dp = dparallel;

namespace {

char const* const usage =
    "usage: overlap [--layers 24] [--width 512] [--batch 16] [--ranks 2] [--bucket-mb 4] [--steps 1]\n"
    "               [--rounds 40] [--warmup 3] [--bucket-view 0|1] [--csv FILE]\n"
    "  --batch      samples per rank and step\n"
    "  --steps      steps per mode and round; the modes take turns, --rounds times\n"
    "  --bucket-mb  DDP's bucket_cap_mb (the first bucket: a quarter of it)\n"
    "  --bucket-view 1  also measure with options::gradient_as_bucket_view\n";

struct samples {
  dp::tensor_view<float const> x;  // rows = samples, width values each
  dp::tensor_view<float const> y;
};

/// layers x (W: width x width, b: width), ReLU between layers, loss 0.5 * mean squared error.
/// Parameter 2l is W_l, 2l+1 is b_l; backward marks b_l then W_l ready, last layer first.
struct deep_mlp {
  std::size_t width, layers;
  std::vector<float> params, grads;
  std::vector<float> acts, delta, prev;

  deep_mlp(std::size_t w, std::size_t l) : width(w), layers(l), params(l * (w * w + w)), grads(params.size()) {
    std::uint64_t s = 12345;
    // He-uniform: the activations keep their scale through the ReLU layers (no denormals).
    float const limit = std::sqrt(6.0f / static_cast<float>(w));
    for (float& p : params) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      p = (static_cast<float>(s >> 40) * 0x1.0p-24f * 2.0f - 1.0f) * limit;
    }
  }

  float* W(std::size_t l) { return params.data() + l * (width * width + width); }
  float* b(std::size_t l) { return W(l) + width * width; }
  float* gW(std::size_t l) { return grads.data() + l * (width * width + width); }
  float* gb(std::size_t l) { return gW(l) + width * width; }

  std::vector<dp::tensor_view<float>> parameters() { return views(params); }
  std::vector<dp::tensor_view<float>> gradients() { return views(grads); }

  float forward_backward(samples const& s, dp::step_context* ctx) {
    std::size_t const n = s.x.rows(), w = width;
    auto const ni = static_cast<int>(n), wi = static_cast<int>(w);
    acts.resize((layers + 1) * n * w);
    delta.resize(n * w);
    prev.resize(n * w);
    std::copy(s.x.begin(), s.x.end(), acts.begin());
    for (std::size_t l = 0; l < layers; ++l) {
      float const* in = acts.data() + l * n * w;
      float* out = acts.data() + (l + 1) * n * w;
      for (std::size_t i = 0; i < n; ++i) std::copy(b(l), b(l) + w, out + i * w);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, wi, wi, 1.0f, in, wi, W(l), wi, 1.0f, out, wi);
      if (l + 1 < layers)
        for (std::size_t k = 0; k < n * w; ++k) out[k] = std::max(out[k], 0.0f);
    }
    float const* top = acts.data() + layers * n * w;
    double loss = 0;
    for (std::size_t k = 0; k < n * w; ++k) {
      float const r = top[k] - s.y[k];
      loss += 0.5 * static_cast<double>(r) * static_cast<double>(r);
      delta[k] = r / static_cast<float>(n);
    }
    for (std::size_t l = layers; l-- > 0;) {
      float const* in = acts.data() + l * n * w;
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, wi, wi, ni, 1.0f, in, wi, delta.data(), wi, 0.0f, gW(l), wi);
      std::fill(gb(l), gb(l) + w, 0.0f);
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < w; ++j) gb(l)[j] += delta[i * w + j];
      if (ctx != nullptr) {
        ctx->grad_ready(2 * l + 1);
        ctx->grad_ready(2 * l);
      }
      if (l == 0) break;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, wi, wi, 1.0f, delta.data(), wi, W(l), wi, 0.0f,
                  prev.data(), wi);
      for (std::size_t k = 0; k < n * w; ++k) prev[k] = in[k] > 0.0f ? prev[k] : 0.0f;
      delta.swap(prev);
    }
    return static_cast<float>(loss / static_cast<double>(n));
  }

 private:
  std::vector<dp::tensor_view<float>> views(std::vector<float>& flat) {
    std::vector<dp::tensor_view<float>> out;
    for (std::size_t l = 0; l < layers; ++l) {
      float* base = flat.data() + l * (width * width + width);
      out.emplace_back(base, width * width);
      out.emplace_back(base + width * width, width);
    }
    return out;
  }
};

struct config {
  std::size_t layers = 24, width = 512, batch = 16;
  int ranks = 2;
  double bucket_mb = 4;
  std::size_t steps = 1, rounds = 40, warmup = 3;
};

std::vector<float> synthetic(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  for (float& x : v) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<float>(seed >> 40) * 0x1.0p-24f * 2.0f - 1.0f;
  }
  return v;
}

enum class kind { compute, comm, serial, overlap };
constexpr std::size_t kinds = 4;

struct per_step {
  double wall = 0;  ///< seconds per step, rank 0's clock between two barriers
  double cpu = 0;   ///< CPU seconds per step, every thread of the process
};

/// Every mode's time per step, in the same rank threads. This machine's cores change speed from
/// second to second (it is shared), so the modes take turns: each round runs `steps` steps of
/// every mode (starting with a different mode each round), and each mode's result is the median
/// of its rounds. A mode is never measured in a faster or slower phase than the others.
std::vector<per_step> measure(config const& c, bool bucket_view) {
  std::barrier sync(c.ranks);
  std::vector<std::vector<double>> wall(kinds), cpu(kinds);
  dp::spawn(c.ranks, [&](dp::rank_context& rank) {
    deep_mlp m(c.width, c.layers);
    auto const xs = synthetic(c.batch * c.width, 7 + static_cast<std::uint64_t>(rank.rank()));
    auto const ys = synthetic(c.batch * c.width, 70 + static_cast<std::uint64_t>(rank.rank()));
    samples const s{dp::tensor_view<float const>(xs.data(), xs.size(), c.batch),
                    dp::tensor_view<float const>(ys.data(), ys.size(), c.batch)};
    dp::options opts;
    opts.bucket_cap_mb = c.bucket_mb;
    opts.first_bucket_cap_mb = c.bucket_mb / 4;
    opts.gradient_as_bucket_view = bucket_view;
    dp::distributed_data_parallel<deep_mlp> ddp(m, rank.group(), opts);
    auto step = [&](kind k) {
      switch (k) {
        case kind::compute:
          m.forward_backward(s, nullptr);
          sync.arrive_and_wait();
          break;
        case kind::comm: ddp.step(s, [](deep_mlp&, samples) {}); break;
        case kind::serial: ddp.step(s, [](deep_mlp& r, samples x) { r.forward_backward(x, nullptr); }); break;
        case kind::overlap:
          ddp.step(s, [](deep_mlp& r, samples x, dp::step_context& ctx) { r.forward_backward(x, &ctx); });
          break;
      }
    };
    for (std::size_t k = 0; k < kinds; ++k)
      for (std::size_t j = 0; j < c.warmup; ++j) step(static_cast<kind>(k));
    for (std::size_t r = 0; r < c.rounds; ++r) {
      for (std::size_t i = 0; i < kinds; ++i) {
        std::size_t const k = (r + i) % kinds;
        sync.arrive_and_wait();
        auto const t0 = bench::clock::now();
        std::clock_t const c0 = std::clock();
        for (std::size_t j = 0; j < c.steps; ++j) step(static_cast<kind>(k));
        sync.arrive_and_wait();
        if (rank.rank() == 0) {
          auto const steps = static_cast<double>(c.steps);
          wall[k].push_back(bench::seconds_since(t0) / steps);
          cpu[k].push_back(static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC / steps);
        }
      }
    }
  });
  std::vector<per_step> out(kinds);
  for (std::size_t k = 0; k < kinds; ++k) out[k] = {bench::median(wall[k]), bench::median(cpu[k])};
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  openblas_set_num_threads(1);
  bench::args a(argc, argv, usage);
  config c;
  c.layers = static_cast<std::size_t>(a.num("layers", 24));
  c.width = static_cast<std::size_t>(a.num("width", 512));
  c.batch = static_cast<std::size_t>(a.num("batch", 16));
  c.ranks = static_cast<int>(a.num("ranks", 2));
  c.bucket_mb = a.num("bucket-mb", 4);
  c.steps = static_cast<std::size_t>(a.num("steps", 1));
  c.rounds = static_cast<std::size_t>(a.num("rounds", 40));
  c.warmup = static_cast<std::size_t>(a.num("warmup", 3));
  bool const view = a.num("bucket-view", 1) != 0;
  std::string const csv = a.str("csv", "");
  a.done();

  std::vector<bool> views{false};
  if (view) views.push_back(true);
  bench::table t({"gradient_as_bucket_view", "compute_ms", "comm_ms", "serial_ms", "overlap_ms", "exposed_comm_ms",
                  "hidden_share", "hidden_vs_serial", "compute_cpu_ms", "comm_cpu_ms", "hidden_limit"});
  double const cores = std::max(1u, std::thread::hardware_concurrency());
  double const grad_mb = static_cast<double>(c.layers * (c.width * c.width + c.width) * sizeof(float)) / (1 << 20);
  std::printf("# overlap: %zu layers of %zu x %zu (%.1f MiB of gradients), %zu samples per rank, %d ranks, "
              "buckets of %.2f MiB; median of %zu rounds of %zu steps per mode, the modes taking turns; %s\n",
              c.layers, c.width, c.width, grad_mb, c.batch, c.ranks, c.bucket_mb, c.rounds, c.steps,
              bench::load_note().c_str());
  for (bool v : views) {
    std::vector<per_step> const times = measure(c, v);
    double const compute = times[0].wall, comm = times[1].wall, serial = times[2].wall, overlap = times[3].wall;
    double const hidden = comm > 0 ? (compute + comm - overlap) / comm : 0;
    double const hidden_serial = serial > compute ? (serial - overlap) / (serial - compute) : 0;
    double const floor = (times[0].cpu + times[1].cpu) / cores;  // the least an overlapped step can take
    double const limit = comm > 0 ? std::min(1.0, (compute + comm - floor) / comm) : 0;
    t.add({v ? "1" : "0", bench::fmt("%.2f", compute * 1e3), bench::fmt("%.2f", comm * 1e3),
           bench::fmt("%.2f", serial * 1e3), bench::fmt("%.2f", overlap * 1e3),
           bench::fmt("%.2f", (overlap - compute) * 1e3), bench::fmt("%.3f", hidden), bench::fmt("%.3f", hidden_serial),
           bench::fmt("%.2f", times[0].cpu * 1e3), bench::fmt("%.2f", times[1].cpu * 1e3), bench::fmt("%.3f", limit)});
  }
  t.print();
  t.write_csv(csv);
  std::printf("# hidden_share = (compute + comm - overlap) / comm (target >= 0.5); hidden_vs_serial = (serial - overlap) / "
              "(serial - compute);\n# hidden_limit = (compute + comm - (compute_cpu + comm_cpu) / %.0f hardware threads) / comm: "
              "the most any overlap can hide here.  %s\n",
              cores, bench::load_note().c_str());
  blas_info::report const blas = blas_info::detect();
  std::printf("# %s\n", blas_info::summary(blas).c_str());
  if (auto const w = blas_info::warning(blas); !w.empty()) std::fprintf(stderr, "overlap: %s\n", w.c_str());
  return 0;
}

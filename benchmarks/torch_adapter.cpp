// torch_adapter: the libtorch adapter against libtorch's and PyTorch's own data parallelism, on
// the same module (the reference 784-512-ReLU-10 MLP, a libtorch module) and the same data
// (synthetic, from torch::manual_seed: PyTorch's generator gives Python the same tensors), one
// training step = forward, cross-entropy, backward, SGD. In one run, rounds interleaved:
//   dp:  dparallel's DataParallel over N host devices against libtorch's
//        torch::nn::parallel::data_parallel() done step by step (see libtorch_dp: a deep clone
//        of the module per call, one thread per replica, the gradients summed into the master),
//        every thread running torch with one intra-op thread.
//   ddp: dparallel's DDP over N thread ranks against PyTorch's Python DDP (gloo over the
//        loopback, N processes of one thread; --torch-ddp names the script,
//        benchmarks/torch_adapter_ddp.py), on the same global batch split in N.
// Prints samples/s of each mode (the median of --rounds rounds) and the ratios dparallel / theirs.
// Run it with OPENBLAS_NUM_THREADS=1 (scripts/bench does): Debian's libtorch calls OpenBLAS, whose
// pthread server serialises the GEMMs that several threads of one process issue, which halves
// every threaded mode here (see docs/libtorch.md, "Threads and BLAS").
#include "train_torch.hpp"

#include <dparallel/adapters/libtorch.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using example::Mlp;

struct args {
  int devices = 2;
  std::int64_t batch = 256;
  int steps = 30, warmup = 5, rounds = 5;
  std::string torch_ddp;  // the command that runs benchmarks/torch_adapter_ddp.py; empty: no ddp comparison
};

using batch_t = std::tuple<torch::Tensor, torch::Tensor>;
using clock_type = std::chrono::steady_clock;

// One intra-op thread on every thread that runs a dparallel device or rank (the devices are the
// threads). With OpenMP the setting is per thread, hence once on each.
void one_torch_thread() {
  thread_local bool done = false;
  if (!done) {
    torch::set_num_threads(1);
    done = true;
  }
}

double loss_backward(Mlp& m, batch_t const& b) {
  auto loss = torch::cross_entropy_loss(m->forward(std::get<0>(b)), std::get<1>(b));
  loss.backward();
  return loss.item<double>();
}

struct data {
  std::vector<batch_t> batches;  // --warmup + --steps global batches
};
data make_data(args const& a) {
  torch::manual_seed(7);
  data d;
  for (int i = 0; i < a.warmup + a.steps; ++i)
    d.batches.emplace_back(torch::randn({a.batch, 784}), torch::randint(0, 10, {a.batch}, torch::kLong));
  return d;
}

// Runs warmup + steps steps of `step(batch)` and returns samples/s of the timed ones.
template <class Step>
double timed(args const& a, data const& d, Step&& step) {
  clock_type::time_point start;
  for (int i = 0; i < a.warmup + a.steps; ++i) {
    if (i == a.warmup) start = clock_type::now();
    step(d.batches[static_cast<std::size_t>(i)]);
  }
  double const s = std::chrono::duration<double>(clock_type::now() - start).count();
  return static_cast<double>(a.steps * a.batch) / s;
}

// libtorch's data_parallel(), step by step: replicate() deep-clones the module for every call,
// parallel_apply() runs each replica on its chunk of the batch on its own thread, and backward
// sums the replicas' gradients into the master (ReduceAdd). Here the same work with Module::clone,
// one std::thread per replica and an explicit sum, since Debian's CPU libtorch cannot include
// <torch/nn/parallel/data_parallel.h> (it pulls in CUDA headers the package does not ship).
double libtorch_dp(args const& a, data const& d, Mlp& master) {
  torch::optim::SGD opt(master->parameters(), 0.01);
  auto const n = static_cast<std::size_t>(a.devices);
  return timed(a, d, [&](batch_t const& b) {
    opt.zero_grad();
    std::vector<Mlp> replicas;
    for (std::size_t i = 0; i < n; ++i)
      replicas.emplace_back(std::dynamic_pointer_cast<example::MlpImpl>(master->clone()));
    auto const xs = std::get<0>(b).chunk(a.devices, 0), ys = std::get<1>(b).chunk(a.devices, 0);
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        one_torch_thread();
        double const weight = static_cast<double>(xs[i].size(0)) / static_cast<double>(a.batch);
        (torch::cross_entropy_loss(replicas[i]->forward(xs[i]), ys[i]) * weight).backward();
      });
    for (auto& t : threads) t.join();
    torch::NoGradGuard const no_grad;
    auto params = master->parameters();
    for (std::size_t i = 0; i < n; ++i) {
      auto const theirs = replicas[i]->parameters();
      for (std::size_t k = 0; k < params.size(); ++k) {
        if (params[k].grad().defined()) params[k].mutable_grad().add_(theirs[k].grad());
        else params[k].mutable_grad() = theirs[k].grad().clone();
      }
    }
    opt.step();
  });
}

double dparallel_dp(args const& a, data const& d, Mlp& master) {
  std::vector<dparallel::device> devices;
  for (int i = 0; i < a.devices; ++i) devices.push_back(dparallel::device{dparallel::device_kind::host, i});
  dparallel::data_parallel<Mlp> dp(master, devices);
  torch::optim::SGD opt(master->parameters(), 0.01);
  return timed(a, d, [&](batch_t const& b) {
    dp.step(b, [](Mlp& m, batch_t s) {
      one_torch_thread();
      loss_backward(m, s);
    });
    opt.step();
  });
}

double dparallel_ddp(args const& a, data const& d, Mlp const& init) {
  std::vector<Mlp> nets;
  for (int r = 0; r < a.devices; ++r) nets.push_back(dparallel::model_traits<Mlp>::make_replica(init, dparallel::host_memory));
  std::vector<double> rates(static_cast<std::size_t>(a.devices));
  std::int64_t const per_rank = a.batch / a.devices;
  dparallel::spawn(a.devices, [&](dparallel::rank_context& rank) {
    one_torch_thread();
    auto const r = static_cast<std::size_t>(rank.rank());
    dparallel::distributed_data_parallel<Mlp> ddp(nets[r], rank);
    torch::optim::SGD opt(nets[r]->parameters(), 0.01);
    auto const first = static_cast<std::size_t>(rank.rank() * per_rank);
    rates[r] = timed(a, d, [&](batch_t const& b) {
      ddp.step(dparallel::slice_batch(b, first, first + static_cast<std::size_t>(per_rank)),
               [](Mlp& m, batch_t s) { loss_backward(m, s); });
      opt.step();
    });
  });
  return rates[0];  // every rank steps in lockstep; rank 0's clock
}

// PyTorch's DDP: the script prints "samples_per_s=<x>" on its last line.
double torch_ddp(args const& a) {
  std::string const cmd = a.torch_ddp + " --ranks " + std::to_string(a.devices) + " --batch " + std::to_string(a.batch) +
                          " --steps " + std::to_string(a.steps) + " --warmup " + std::to_string(a.warmup);
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  if (!p) throw std::runtime_error("torch_adapter: could not run " + cmd);
  char line[512];
  double rate = -1;
  while (std::fgets(line, sizeof line, p.get()) != nullptr) {
    std::string_view const s(line);
    if (s.starts_with("samples_per_s=")) rate = std::strtod(line + 14, nullptr);
  }
  if (rate <= 0) throw std::runtime_error("torch_adapter: expected samples_per_s=... from " + cmd);
  return rate;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    std::string_view const k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(std::string(k) + ": expected a value");
    char const* v = argv[++i];
    if (k == "--devices") a.devices = std::atoi(v);
    else if (k == "--batch") a.batch = std::atoll(v);
    else if (k == "--steps") a.steps = std::atoi(v);
    else if (k == "--warmup") a.warmup = std::atoi(v);
    else if (k == "--rounds") a.rounds = std::atoi(v);
    else if (k == "--torch-ddp") a.torch_ddp = v;
    else throw std::invalid_argument("unknown option " + std::string(k));
  }
  if (a.devices < 2 || a.batch % a.devices != 0 || a.steps < 1 || a.rounds < 1)
    throw std::invalid_argument("expected --devices >= 2 dividing --batch, --steps >= 1, --rounds >= 1");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    args const a = parse(argc, argv);
    torch::set_num_threads(1);
    data const d = make_data(a);
    torch::manual_seed(1);
    Mlp const init;
    std::vector<double> theirs_dp, ours_dp, theirs_ddp, ours_ddp;
    for (int r = 0; r < a.rounds; ++r) {
      Mlp m1 = dparallel::model_traits<Mlp>::make_replica(init, dparallel::host_memory);
      Mlp m2 = dparallel::model_traits<Mlp>::make_replica(init, dparallel::host_memory);
      theirs_dp.push_back(libtorch_dp(a, d, m1));
      ours_dp.push_back(dparallel_dp(a, d, m2));
      if (!a.torch_ddp.empty()) theirs_ddp.push_back(torch_ddp(a));
      ours_ddp.push_back(dparallel_ddp(a, d, init));
    }
    std::printf("torch_adapter: the 784-512-ReLU-10 MLP (libtorch module), global batch %lld, %d devices/ranks, "
                "median of %d rounds of %d steps\n",
                static_cast<long long>(a.batch), a.devices, a.rounds, a.steps);
    std::printf("%-44s %12s\n", "mode", "samples/s");
    std::printf("%-44s %12.0f\n", "libtorch data_parallel recipe (replicate)", median(theirs_dp));
    std::printf("%-44s %12.0f\n", "dparallel DP (libtorch adapter)", median(ours_dp));
    if (!theirs_ddp.empty()) std::printf("%-44s %12.0f\n", "PyTorch DDP (Python, gloo, processes)", median(theirs_ddp));
    std::printf("%-44s %12.0f\n", "dparallel DDP (libtorch adapter, thread ranks)", median(ours_ddp));
    std::printf("ratio dp: dparallel / libtorch = %.2f\n", median(ours_dp) / median(theirs_dp));
    if (!theirs_ddp.empty()) std::printf("ratio ddp: dparallel / PyTorch = %.2f\n", median(ours_ddp) / median(theirs_ddp));
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "torch_adapter: error: %s\n", e.what());
    return 1;
  }
}

// The libtorch adapter's DDP over NCCL ranks that are processes (built when libtorch has CUDA and
// NCCL is found), started torchrun-style by scripts/gpu-check like nccl_ranks (on one GPU with the
// environment `nccl_ranks --shared-gpu-env` prints; docs/gpu-check.md). Exit status 0 = passed.
//
// Each rank first trains the module with libtorch alone on the GPU, the whole batch per step (the
// reference, in this process); then rank r starts from a module of its own (rank 0 from the
// reference's initial values, the others from another seed and another buffer), wraps it in DDP
// over the NCCL group (the construction broadcasts rank 0's parameters and buffers), and trains
// on rows [r*B/n, (r+1)*B/n) of the same batches: after 20 SGD steps its parameters equal the
// reference's within 1e-9 relative (float64; the averaged shard gradients are the whole batch's
// up to the sums' order), and every rank holds rank 0's bits.
#include <dparallel/adapters/libtorch.hpp>  // first: the adapter's header compiles on its own

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/dparallel.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>
#include <vector>

namespace dpl = dparallel;

namespace {

int failures = 0;
std::string me = "libtorch_ranks";

void expect(bool ok, std::string const& what) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "%s: FAILED: %s\n", me.c_str(), what.c_str());
}

// A small regression module: a linear layer, a GELU, a linear layer, and a buffer added to the
// output (so that DDP's broadcast of buffers matters).
struct RegressorImpl : torch::nn::Cloneable<RegressorImpl> {
  explicit RegressorImpl(double shift = 0.125) : shift_value(shift) { reset(); }
  void reset() override {
    in = register_module("in", torch::nn::Linear(32, 128));
    out = register_module("out", torch::nn::Linear(128, 8));
    shift = register_buffer("shift", torch::full({8}, shift_value));
  }
  torch::Tensor forward(torch::Tensor const& x) { return out(torch::gelu(in(x))) + shift; }
  double shift_value;
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::Tensor shift;
};
TORCH_MODULE(Regressor);

using batch_t = std::tuple<torch::Tensor, torch::Tensor>;
constexpr int steps = 20;
constexpr double lr = 0.1;
constexpr std::int64_t rows = 256;

// The module from `seed` with buffer value `shift`, float64, on `gpu`.
Regressor make(std::uint64_t seed, double shift, torch::Device gpu) {
  torch::manual_seed(seed);
  Regressor m(shift);
  m->to(torch::kDouble);
  m->to(gpu);
  return m;
}

// Every step's whole batch (the same on every rank: a CPU generator per step), on `gpu`.
std::vector<batch_t> batches(torch::Device gpu) {
  std::vector<batch_t> out;
  auto const opts = torch::TensorOptions().dtype(torch::kDouble);
  for (int s = 0; s < steps; ++s) {
    auto g = torch::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(500 + s));
    out.emplace_back(torch::randn({rows, 32}, g, opts).to(gpu), torch::randn({rows, 8}, g, opts).to(gpu));
  }
  return out;
}

void loss_backward(Regressor& m, batch_t const& b) {
  torch::mse_loss(m->forward(std::get<0>(b)), std::get<1>(b)).backward();
}

// The parameters and buffers, in order, as one float64 vector on the host.
std::vector<double> state(Regressor& m) {
  std::vector<torch::Tensor> parts;
  for (auto const& p : m->parameters()) parts.push_back(p.detach().flatten());
  for (auto const& b : m->buffers()) parts.push_back(b.detach().flatten());
  torch::Tensor const all = torch::cat(parts).to(torch::kCPU).contiguous();
  return {all.data_ptr<double>(), all.data_ptr<double>() + all.numel()};
}

double relative(std::vector<double> const& a, std::vector<double> const& ref) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return diff / scale;
}

void check_ddp(dpl::distributed_group const& g) {
  int const n = g.size(), r = g.rank();
  torch::Device const gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(g.bound_device()->index));
  auto const data = batches(gpu);
  // The reference: libtorch alone, the whole batch per step.
  Regressor ref = make(7, 0.125, gpu);
  std::vector<double> const initial = state(ref);
  {
    torch::optim::SGD opt(ref->parameters(), lr);
    for (auto const& b : data) {
      opt.zero_grad(false);
      loss_backward(ref, b);
      opt.step();
    }
  }
  std::vector<double> const want = state(ref);
  expect(relative(want, initial) > 1e-3, "the reference trained");
  // DDP: rank 0 from the reference's start, the others from elsewhere (the broadcast fixes that).
  Regressor m = r == 0 ? make(7, 0.125, gpu) : make(8, -0.5, gpu);
  expect((state(m) == initial) == (r == 0), "only rank 0 starts from the reference's initial values");
  dpl::parallel<Regressor, dpl::ddp, dpl::cuda::backend> ddp(m, g);
  expect(state(m) == initial, "DDP's construction made this rank's parameters and buffers rank 0's");
  torch::optim::SGD opt(m->parameters(), lr);
  std::int64_t const per = rows / n;
  for (auto const& b : data) {
    batch_t const shard{std::get<0>(b).narrow(0, per * r, per), std::get<1>(b).narrow(0, per * r, per)};
    ddp.step(shard, [](Regressor& replica, batch_t sb) { loss_backward(replica, sb); });
    opt.step();
  }
  std::vector<double> const got = state(m);
  double const rel = relative(got, want);
  std::printf("%s: parameters after %d steps within %.3g relative of libtorch alone\n", me.c_str(), steps, rel);
  expect(rel <= 1e-9, "DDP's parameters within 1e-9 relative of libtorch alone's, found " + std::to_string(rel));
  std::vector<double> r0 = got;  // every rank holds rank 0's bits
  g.broadcast(dpl::view(r0), 0).wait();
  expect(std::memcmp(r0.data(), got.data(), got.size() * sizeof(double)) == 0, "this rank's parameters bitwise rank 0's");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || std::string(argv[1]) != "ddp") {
    std::fprintf(stderr, "usage: libtorch_ranks ddp   (one process per rank, started torchrun-style)\n");
    return 2;
  }
  try {
    dpl::distributed_group g = dpl::nccl::init_process_group({.timeout = std::chrono::seconds(60)});
    me = "libtorch_ranks ddp rank " + std::to_string(g.rank()) + "/" + std::to_string(g.size()) + " on " +
         dpl::to_string(*g.bound_device());
    if (rows % g.size() != 0) {
      std::fprintf(stderr, "%s: FAILED: %lld rows do not split over %d ranks\n", me.c_str(), static_cast<long long>(rows), g.size());
      return 1;
    }
    check_ddp(g);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "%s: FAILED: %s\n", me.c_str(), e.what());
    return 1;
  }
  std::printf("%s: %s\n", me.c_str(), failures == 0 ? "passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}

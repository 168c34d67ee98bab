// The libtorch adapter on the CUDA backend (built when libtorch has CUDA, DPARALLEL_LIBTORCH_CUDA;
// scripts/gpu-check builds it against the GPU machine's PyTorch): the step function's kernels run
// on dparallel's stream of the shard's lane; DataParallel over 2 lanes of one GPU, and DDP on NCCL
// at world size 1, give the parameters of the same module trained on the GPU by libtorch alone,
// with the optimizer's updates issued on libtorch's default stream behind a busy kernel between
// steps (what cuda::backend::begin_step orders the step after); the gradient accumulators the
// adapter makes run on dparallel's stream, and accumulators made before on libtorch's default
// stream, held there behind a busy kernel, are waited for before DDP stages its bucket. Without a
// GPU: skipped (77).
#include <dparallel/adapters/libtorch.hpp>  // first: the adapter's header compiles on its own

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/dparallel.hpp>
#if DPARALLEL_TEST_NCCL
#include <dparallel/comm/nccl.hpp>
#endif

#include <c10/cuda/CUDAStream.h>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace dpl = dparallel;

namespace {

using gpu = dpl::cuda::backend;

// The reference module of tests/test_libtorch.cpp, on the GPU: two linear layers, a tanh, and a
// buffer the output is scaled by.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(64, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 16));
    scale = register_buffer("scale", torch::full({16}, 0.5));
  }
  torch::Tensor forward(torch::Tensor const& x) { return fc2(torch::tanh(fc1(x))) * scale; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Net);

using batch_t = std::tuple<torch::Tensor, torch::Tensor>;

constexpr int steps = 20;
constexpr double lr = 0.05;
constexpr std::int64_t rows = 512;

torch::Device const cuda0(torch::kCUDA, 0);

// The module every run starts from (double precision, on GPU 0).
Net initial() {
  torch::manual_seed(11);
  Net m;
  m->to(torch::kDouble);
  m->to(cuda0);
  return m;
}

// Step s's batch, made on the GPU by libtorch (its default stream), the same for every run.
batch_t batch_of(int s) {
  auto g = torch::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(100 + s));
  auto const opts = torch::TensorOptions().dtype(torch::kDouble);
  return {torch::randn({rows, 64}, g, opts).to(cuda0), torch::randn({rows, 16}, g, opts).to(cuda0)};
}

void step_fn(Net& m, batch_t b) { torch::mse_loss(m->forward(std::get<0>(b)), std::get<1>(b)).backward(); }

// Every step's batch, made before training: making one copies it to the GPU synchronously, which
// would also wait for everything queued on the default stream (and hide a missing order).
std::vector<batch_t> all_batches() {
  std::vector<batch_t> out;
  for (int s = 0; s < steps; ++s) out.push_back(batch_of(s));
  return out;
}

__global__ void spin(long long cycles) {
  long long const t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// The optimizer's update, queued on libtorch's current (default) stream behind about 20 ms of
// busy GPU: a step that did not wait for the default stream would read the parameters before it.
void late_update(torch::optim::SGD& opt) {
  spin<<<1, 1, 0, c10::cuda::getCurrentCUDAStream(0).stream()>>>(30'000'000);
  dpl::cuda::check(cudaGetLastError(), "spin");
  opt.step();
}

torch::Tensor flat(Net& m) {
  std::vector<torch::Tensor> parts;
  for (auto const& p : m->parameters()) parts.push_back(p.detach().flatten().to(torch::kCPU));
  return torch::cat(parts);
}

double relative(torch::Tensor const& a, torch::Tensor const& ref) {
  return (a - ref).abs().max().item<double>() / ref.abs().max().item<double>();
}

// The reference: libtorch alone on GPU 0, the whole batch per step.
torch::Tensor one_device() {
  Net m = initial();
  torch::optim::SGD opt(m->parameters(), lr);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad(false);
    step_fn(m, batch_of(s));
    opt.step();
  }
  return flat(m);
}

}  // namespace

TEST_CASE("libtorch on CUDA: the step function runs on dparallel's stream of its lane", "[libtorch][cuda]") {
  Net m = initial();
  dpl::parallel<Net, dpl::dp, gpu> dp(m, dpl::cuda::logical_devices(2, 0));
  // Catch2 is not thread-safe: the lanes' threads record, this thread checks.
  std::vector<int> same(2, -1), accumulates_on_it(2, -1);
  std::vector<cudaStream_t> seen(2, nullptr);
  dp.step(batch_of(0), [&](Net& r, batch_t b, dpl::step_context& ctx) {
    auto const i = static_cast<std::size_t>(ctx.replica());
    seen[i] = c10::cuda::getCurrentCUDAStream(0).stream();
    same[i] = seen[i] == dpl::cuda::current_stream() ? 1 : 0;
    // Autograd accumulates into .grad on its accumulator's stream: the adapter made it under the
    // guard, so it is the lane's stream too.
    bool all = true;
    for (auto const& p : r->parameters())
      all = all && torch::autograd::impl::grad_accumulator(p)->input_metadata(0).stream() ==
                       c10::cuda::getCurrentCUDAStream(0).unwrap();
    accumulates_on_it[i] = all ? 1 : 0;
    step_fn(r, std::move(b));
  });
  CHECK(same == std::vector<int>{1, 1});
  CHECK(accumulates_on_it == std::vector<int>{1, 1});
  CHECK(seen[0] != seen[1]);  // each lane its own stream
  // Outside a step libtorch's current stream is its own again.
  CHECK(c10::cuda::getCurrentCUDAStream(0).stream() != seen[0]);
  CHECK(c10::cuda::getCurrentCUDAStream(0).stream() != seen[1]);
}

TEST_CASE("libtorch on CUDA: DataParallel over 2 lanes of one GPU equals libtorch alone after 20 steps",
          "[libtorch][cuda][dp]") {
  torch::Tensor const ref = one_device();
  Net m = initial();
  dpl::parallel<Net, dpl::dp, gpu> dp(m, dpl::cuda::logical_devices(2, 0));
  torch::optim::SGD opt(m->parameters(), lr);  // updates the master on libtorch's default stream
  std::vector<batch_t> const batches = all_batches();
  std::vector<void*> grads_before;
  for (int s = 0; s < steps; ++s) {
    dp.step(batches[static_cast<std::size_t>(s)], step_fn);
    late_update(opt);
    if (s == 0)
      for (auto const& g : dpl::gradient_refs(dp.replica(1))) grads_before.push_back(g.data());
  }
  CHECK(relative(flat(m), ref) <= 1e-9);
  std::vector<void*> grads_after;
  for (auto const& g : dpl::gradient_refs(dp.replica(1))) grads_after.push_back(g.data());
  CHECK(grads_after == grads_before);  // allocated once
}

#if DPARALLEL_TEST_NCCL
TEST_CASE("libtorch on CUDA: DDP on NCCL (world size 1) equals libtorch alone after 20 steps",
          "[libtorch][cuda][ddp]") {
  torch::Tensor const ref = one_device();
  dpl::device const gpu0{dpl::device_kind::cuda, 0, 0};
  auto group = dpl::nccl::make_groups({gpu0}).at(0);
  Net m = initial();
  dpl::parallel<Net, dpl::ddp, gpu> ddp(m, group, {.local_device = gpu0});
  torch::optim::SGD opt(m->parameters(), lr);
  std::vector<batch_t> const batches = all_batches();
  for (int s = 0; s < steps; ++s) {
    ddp.step(batches[static_cast<std::size_t>(s)], step_fn);
    late_update(opt);
  }
  CHECK(relative(flat(m), ref) <= 1e-9);
}

TEST_CASE("libtorch on CUDA: DDP's buckets read .grad after autograd's accumulation on another, slower stream",
          "[libtorch][cuda][ddp]") {
  // Accumulators made outside any step, so on libtorch's default stream, and held (as a graph the
  // caller keeps would hold them): the adapter uses them as they are. In every step those
  // accumulations queue behind about 20 ms of busy GPU on that stream, while the readiness hooks
  // stage the gradients into DDP's bucket on dparallel's non-blocking stream during backward. A
  // staging copy that did not wait would read the zeroed gradients, and the bucket's write-back
  // after the step (which PyTorch's end-of-backward sync orders after the accumulations) would put
  // zeros into .grad: the parameters would not move.
  torch::Tensor const ref = one_device();
  dpl::device const gpu0{dpl::device_kind::cuda, 0, 0};
  auto group = dpl::nccl::make_groups({gpu0}).at(0);
  Net m = initial();
  dpl::parallel<Net, dpl::ddp, gpu> ddp(m, group, {.local_device = gpu0});
  std::vector<dpl::libtorch::detail::accumulator_ptr> held;
  for (auto const& p : m->parameters()) held.push_back(torch::autograd::impl::grad_accumulator(p));
  for (auto const& a : held) REQUIRE(a->input_metadata(0).stream() == c10::cuda::getDefaultCUDAStream(0).unwrap());
  cudaStream_t const libtorch_default = c10::cuda::getDefaultCUDAStream(0).stream();
  torch::optim::SGD opt(m->parameters(), lr);
  std::vector<batch_t> const batches = all_batches();
  for (int s = 0; s < steps; ++s) {
    ddp.step(batches[static_cast<std::size_t>(s)], [&](Net& r, batch_t b) {
      spin<<<1, 1, 0, libtorch_default>>>(30'000'000);
      dpl::cuda::check(cudaGetLastError(), "spin");
      step_fn(r, std::move(b));
    });
    late_update(opt);
  }
  CHECK(relative(flat(m), ref) <= 1e-9);
}
#endif

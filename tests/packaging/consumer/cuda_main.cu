// A user's CUDA program: DataParallel over two lanes of GPU 0 (dparallel::cuda) and DDP over a
// one-rank NCCL group (dparallel::nccl) on a one-parameter model whose gradient a kernel makes. It
// returns 0 only when both give the one-device gradient exactly, and 77 (skipped) when no GPU can
// be used, so that building it proves the add-ons compile and link in the user's project and
// running it on a GPU proves they work.
#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/dparallel.hpp>

#include <cuda_runtime_api.h>

#include <array>
#include <cstdio>
#include <exception>
#include <vector>

namespace {

// The loss w * mean(x) over a shard: dL/dw = mean(x), made by one GPU thread.
__global__ void mean_of(float const* x, unsigned n, float* out) {
  float sum = 0.0F;
  for (unsigned i = 0; i < n; ++i) sum += x[i];
  *out = sum / static_cast<float>(n);
}

struct model {
  dparallel::cuda::device_buffer<float> w, g;
  explicit model(dparallel::device d) : w(1, d), g(1, d) {}
  auto parameters() { return std::array{w.view()}; }
  auto gradients() { return std::array{g.view()}; }
  model make_replica(dparallel::device d) const { return model(d); }
};

void step_fn(model& m, dparallel::tensor_view<float> x) {
  mean_of<<<1, 1, 0, dparallel::cuda::current_stream()>>>(x.data(), static_cast<unsigned>(x.size()), m.g.data());
}

float gradient_of(model const& m) {
  float out = 0.0F;
  dparallel::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  dparallel::cuda::check(cudaMemcpy(&out, m.g.data(), sizeof out, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return out;
}

}  // namespace

int main() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("cuda consumer: built; no GPU to run on: skipped\n");
    return 77;
  }
  try {
    // Shards {1, 2} and {3, 4} each weigh 1/2: the gradient is mean(1, 2, 3, 4) = 2.5 exactly.
    // The batch lives on the GPU (DDP hands the step function its batch as it is).
    std::vector<float> const host{1.0F, 2.0F, 3.0F, 4.0F};
    dparallel::device const gpu0{dparallel::device_kind::cuda, 0, 0};
    dparallel::cuda::device_buffer<float> on_gpu(host.size(), gpu0);
    dparallel::cuda::check(cudaMemcpy(on_gpu.data(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
                           "cudaMemcpy");
    dparallel::tensor_view<float> const batch = on_gpu.view();

    model m(gpu0);
    dparallel::data_parallel<model, dparallel::cuda::backend> dp(m, dparallel::cuda::logical_devices(2, 0));
    dp.step(batch, step_fn);
    float const dp_grad = gradient_of(m);

    model n(gpu0);
    auto group = dparallel::nccl::make_groups({gpu0}).at(0);
    dparallel::distributed_data_parallel<model, dparallel::cuda::backend> ddp(n, group, {.local_device = gpu0});
    ddp.step(batch, step_fn);
    float const ddp_grad = gradient_of(n);

    if (dp_grad != 2.5F || ddp_grad != 2.5F) {
      std::fprintf(stderr, "cuda consumer: expected the gradient 2.5 from DP and DDP, found %.9g and %.9g\n",
                   static_cast<double>(dp_grad), static_cast<double>(ddp_grad));
      return 1;
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "cuda consumer: %s\n", e.what());
    return 1;
  }
  std::printf("cuda consumer: dparallel %d.%d.%d OK on the GPU: DP and DDP (NCCL) gradients 2.5\n",
              DPARALLEL_VERSION_MAJOR, DPARALLEL_VERSION_MINOR, DPARALLEL_VERSION_PATCH);
  return 0;
}

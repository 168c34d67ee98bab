// train_mlp's CUDA backend (--backend cuda): the GPU model of mlp_cuda.cuh in each mode, behind the
// runner interface of train_mlp_cuda.hpp. Compiled by nvcc into train_mlp when CMake found CUDA.
//
// - single: one model on GPU 0; its work goes to the legacy default stream.
// - dp: dparallel::data_parallel<mlp_cuda, cuda::backend> over one logical device per GPU, or over
//   lanes of GPU 0 when there are fewer GPUs than --devices (each lane has its own stream).
// - ddp: dparallel::distributed_data_parallel<mlp_cuda, cuda::backend> over an NCCL group: thread
//   ranks (one per GPU, nccl::make_groups) or processes (--comm nccl, nccl::init_process_group).
//
// Every step function copies its host shard to its GPU on dparallel::cuda::current_stream().

#include "mlp_cuda.cuh"
#include "train_mlp_cuda.hpp"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/dparallel.hpp>
#if DPARALLEL_EXAMPLE_NCCL
#include <dparallel/comm/nccl.hpp>
#endif

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace train_mlp_cuda {
namespace {

namespace dpl = dparallel;
using gpu_backend = dpl::cuda::backend;

dpl::device gpu_device(int ordinal) {
  return dpl::device{dpl::device_kind::cuda, ordinal, 0};
}

std::string names(std::vector<dpl::device> const& devs) {
  std::string out;
  for (auto const& d : devs) out += (out.empty() ? "" : ", ") + dpl::to_string(d);
  return out;
}

float run_shard(mlp_cuda& m, batch shard, dpl::step_context&) {
  return m.forward_backward(shard);
}

class single_runner final : public runner {
 public:
  explicit single_runner(mlp const& start) : model_(start, gpu_device(0)) {}
  double step(batch const& b, std::chrono::nanoseconds) override {
    return static_cast<double>(model_.forward_backward(b));
  }
  void sgd(float lr) override { model_.sgd(lr); }
  void download(mlp& host) override { model_.download(host); }
  [[nodiscard]] std::string profile() const override { return {}; }
  [[nodiscard]] std::string devices() const override { return dpl::to_string(model_.where()); }

 private:
  mlp_cuda model_;
};

class dp_runner final : public runner {
 public:
  dp_runner(mlp const& start, std::vector<dpl::device> const& devs)
      : master_(start, devs.front()), dp_(master_, devs) {}
  double step(batch const& b, std::chrono::nanoseconds waited) override {
    dp_.note_data_wait(waited);
    std::vector<float> const losses = dp_.step(b, &run_shard);
    // One mean loss per device that received a shard, in device order: weight each by its size.
    double sum = 0;
    std::size_t k = 0;
    for (std::size_t size : dp_.last_shard_sizes())
      if (size != 0) sum += static_cast<double>(losses[k++]) * static_cast<double>(size);
    return sum / static_cast<double>(b.images.rows());
  }
  void sgd(float lr) override { master_.sgd(lr); }
  void download(mlp& host) override { master_.download(host); }
  [[nodiscard]] std::string profile() const override { return dpl::format_profile(dp_.profile()); }
  [[nodiscard]] std::string devices() const override { return names(dp_.devices()); }

 private:
  mlp_cuda master_;  // first: dp_ holds a reference to it
  dpl::data_parallel<mlp_cuda, gpu_backend> dp_;
};

class ddp_runner final : public runner {
 public:
  ddp_runner(mlp const& start, dpl::process_group const& group, int gpu)
      : group_(group), model_(start, gpu_device(gpu)), ddp_(model_, group, {.local_device = gpu_device(gpu)}) {}
  double step(batch const& b, std::chrono::nanoseconds waited) override {
    ddp_.note_data_wait(waited);
    return static_cast<double>(ddp_.step(b, &run_shard));  // this rank's mean loss (train() sums the epoch's)
  }
  void sgd(float lr) override { model_.sgd(lr); }
  void download(mlp& host) override { model_.download(host); }
  [[nodiscard]] std::string profile() const override { return dpl::format_profile(ddp_.profile()); }
  [[nodiscard]] std::string devices() const override { return dpl::to_string(model_.where()); }

 private:
  dpl::process_group group_;
  mlp_cuda model_;  // before ddp_, which holds a reference to it
  dpl::distributed_data_parallel<mlp_cuda, gpu_backend> ddp_;
};

}  // namespace

int device_count() {
  return dpl::cuda::device_count();
}

std::string no_device_reason() {
  return dpl::cuda::no_device_reason();
}

std::unique_ptr<runner> make_single(mlp const& start) {
  return std::make_unique<single_runner>(start);
}

std::unique_ptr<runner> make_dp(mlp const& start, int devices) {
  auto const devs =
      dpl::cuda::device_count() >= devices ? dpl::cuda::devices(devices) : dpl::cuda::logical_devices(devices, 0);
  return std::make_unique<dp_runner>(start, devs);
}

std::unique_ptr<runner> make_ddp(mlp const& start, dpl::process_group const& group, int gpu) {
  return std::make_unique<ddp_runner>(start, group, gpu);
}

std::vector<dpl::process_group> make_nccl_groups(int ranks) {
  std::string const n = std::to_string(ranks);
#if DPARALLEL_EXAMPLE_NCCL
  int const gpus = dpl::cuda::device_count();
  if (gpus < ranks)
    throw std::runtime_error("--mode ddp --devices " + n + ": ddp on CUDA needs " + n +
                             " GPUs (NCCL: one rank per GPU), found " + std::to_string(gpus) +
                             "; use --mode dp --devices " + n + " for " + n + " logical devices on one GPU");
  return dpl::nccl::make_groups(dpl::cuda::devices(ranks));
#else
  throw std::runtime_error("--mode ddp --devices " + n +
                           ": ddp on CUDA runs over NCCL, which this build of train_mlp " +
                           "did not find (set NCCL_ROOT and reconfigure); use --mode dp for several GPUs");
#endif
}

dpl::distributed_group init_nccl_process_group([[maybe_unused]] dpl::process_group const& bootstrap) {
#if DPARALLEL_EXAMPLE_NCCL
  return dpl::nccl::init_process_group({}, bootstrap);
#else
  throw std::runtime_error("--comm nccl: this build of train_mlp has no NCCL");
#endif
}

int gpu_of(dpl::distributed_group const& group) {
  auto const d = group.bound_device();
  if (!d) throw std::runtime_error("--comm nccl: expected an NCCL group bound to a GPU, found a group bound to none");
  return d->index;
}

}  // namespace train_mlp_cuda

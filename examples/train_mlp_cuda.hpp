#pragma once
// The CUDA half of train_mlp, as the host program sees it: train_mlp_cuda.cu (compiled by nvcc,
// linked into train_mlp only when CMake found CUDA; DPARALLEL_EXAMPLE_CUDA=1) defines these
// functions around the GPU model of mlp_cuda.cuh. Nothing here needs a CUDA header, so
// train_mlp.cpp stays plain C++ and keeps one training loop for both backends: the loop drives a
// runner, which does a mode's forward/backward and SGD on the GPU and hands back host copies of
// the master's parameters for evaluation, fingerprints and files.

#include "mlp.hpp"

#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/dparallel.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace train_mlp_cuda {

/// Number of visible GPUs: 0 without a GPU or a usable driver (no_device_reason() says why).
int device_count();
/// The CUDA runtime's reason for device_count() == 0 (empty when there are GPUs).
std::string no_device_reason();

/// One mode's training state on the GPU (its models, its wrapper, its cuBLAS handles).
class runner {
 public:
  runner() = default;
  runner(runner const&) = delete;
  runner& operator=(runner const&) = delete;
  virtual ~runner() = default;

  /// Forward and backward over `b` (a host batch; the model copies it to its GPU): leaves the
  /// gradient of the mean loss over the global batch on the master and returns that mean loss
  /// (ddp: over every rank's part of the global batch). `waited`: the loop's wait for this batch.
  virtual double step(batch const& b, std::chrono::nanoseconds waited) = 0;
  /// Plain SGD on the master, on the GPU: p -= lr * g.
  virtual void sgd(float lr) = 0;
  /// The master's parameters copied into `host`.
  virtual void download(mlp& host) = 0;
  /// The wrapper's mean step profile as a table (format_profile); empty without a wrapper (single).
  [[nodiscard]] virtual std::string profile() const = 0;
  /// The logical devices, as "cuda:0, cuda:0.1".
  [[nodiscard]] virtual std::string devices() const = 0;
};

/// --mode single: `start`'s parameters on GPU 0.
std::unique_ptr<runner> make_single(mlp const& start);
/// --mode dp: DataParallel over `devices` logical devices: one per GPU (cuda::devices) when there
/// are that many GPUs, else lanes of GPU 0 (cuda::logical_devices).
std::unique_ptr<runner> make_dp(mlp const& start, int devices);
/// --mode ddp: this rank's replica on GPU `gpu`, wrapped by DDP over `group` (an NCCL group).
std::unique_ptr<runner> make_ddp(mlp const& start, dparallel::process_group const& group, int gpu);

/// --mode ddp with thread ranks: one NCCL group per rank, rank r on GPU r (nccl::make_groups).
/// Throws unless there are `ranks` GPUs (NCCL: one rank per GPU) and the build found NCCL.
std::vector<dparallel::process_group> make_nccl_groups(int ranks);
/// --comm nccl: this process's rank of an NCCL group over the processes of the launch
/// (nccl::init_process_group); rank 0's unique id travels through `bootstrap` when it is valid
/// (an MPI group), else through the TCP rendezvous at MASTER_ADDR:MASTER_PORT. Its GPU is
/// local_rank % the GPUs this process sees (one visible GPU per rank works: srun
/// --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank), as the group says (gpu_of()).
dparallel::distributed_group init_nccl_process_group(dparallel::process_group const& bootstrap);
/// The GPU of a process rank: the one its NCCL communicator runs on (process_group::bound_device).
int gpu_of(dparallel::distributed_group const& group);

}  // namespace train_mlp_cuda

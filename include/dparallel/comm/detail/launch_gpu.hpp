#pragma once
// Which GPU a rank runs on, decided from what the launch says and what the process sees, without
// touching a GPU (no CUDA or NCCL header): nccl::init_process_group and nccl::make_groups apply
// these decisions, parallel<> takes DDP's default device from the group's own GPU, and the host
// tests check them over the launch layouts clusters use.
//
// - A process rank: the `gpu` argument when given, else GPU local_rank % visible among the GPUs
//   this process sees. With at least as many visible GPUs as ranks on the node (torchrun
//   --nproc_per_node <= GPUs, round-robin placement, mpirun --map-by node) that is GPU local_rank.
//   With fewer (srun --gpus-per-task=1, or any launcher that sets CUDA_VISIBLE_DEVICES per rank,
//   so every rank sees its own GPU as GPU 0) the ranks may still hold distinct GPUs, which only
//   NCCL can tell (it compares the GPUs' bus ids per host when the communicator is made, and
//   fails with "Duplicate GPU" when two ranks really share one); that failure is reported with
//   the fix (shared_gpu_message).
// - DDP's default device: the device the group's communicator is bound to (an NCCL rank's GPU),
//   else the backend's round-robin choice by rank.
// - Several ranks on one GPU, for correctness checks on a machine with one GPU only (NCCL does not
//   support it for training): processes get the environment of shared_gpu_environment; thread
//   ranks of one process need NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 (check_group_gpus).

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// What a process rank knows when it picks its GPU.
struct rank_gpu_inputs {
  int rank = 0;                                     // global rank (messages)
  int local_rank = 0;                               // rank among this node's processes
  int local_world_size = 1;                         // processes on this node
  std::string local_source;                         // where the local rank and size came from
  int visible = 0;                                  // GPUs this process sees (cudaGetDeviceCount)
  std::optional<int> explicit_gpu;                  // the caller's `gpu`
  std::optional<std::string> cuda_visible_devices;  // CUDA_VISIBLE_DEVICES as set (messages)
};

/// A process rank's GPU, and whether it may be another rank's too.
struct rank_gpu {
  int gpu = 0;
  /// More ranks on this node than GPUs this process sees, and no explicit `gpu`: the ranks hold
  /// distinct GPUs only if each sees its own (per-rank CUDA_VISIBLE_DEVICES); NCCL checks it.
  bool may_share = false;
};

/// NCCL's version code (ncclGetVersion, e.g. 22809 for 2.28.9) as "2.28.9".
inline std::string nccl_version_string(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

/// NCCL lets ranks share a GPU (NCCL_MULTI_RANK_GPU_ENABLE, experimental) from 2.30 on.
inline constexpr int nccl_multi_rank_gpu_version = 23000;

/// The GPU of one process rank; invalid_argument when the process sees no GPU and none was given.
/// `no_gpu_reason` says why none is visible (the CUDA runtime's answer).
inline rank_gpu choose_rank_gpu(rank_gpu_inputs const& in, std::string const& no_gpu_reason = {}) {
  std::string const who = "dparallel: nccl::init_process_group on rank " + std::to_string(in.rank) + ": ";
  if (in.explicit_gpu) {
    require(*in.explicit_gpu >= 0, [&] {
      return who + "expected a GPU ordinal >= 0 as `gpu`, found " + std::to_string(*in.explicit_gpu);
    });
    return {*in.explicit_gpu, false};
  }
  if (in.visible <= 0)
    throw invalid_argument(who + "no GPU visible to this process" +
                           (no_gpu_reason.empty() ? std::string() : " (" + no_gpu_reason + ")") +
                           (in.cuda_visible_devices ? "; CUDA_VISIBLE_DEVICES='" + *in.cuda_visible_devices + "'" : std::string()));
  require(in.local_rank >= 0 && in.local_world_size > in.local_rank, [&] {
    return who + "expected a local rank in [0, " + std::to_string(in.local_world_size) + "), found " +
           std::to_string(in.local_rank);
  });
  return {in.local_rank % in.visible, in.local_world_size > in.visible};
}

/// Whether NCCL's last error says that two ranks of the communicator are on one GPU.
inline bool names_duplicate_gpu(std::string_view nccl_last_error) {
  return nccl_last_error.find("Duplicate GPU") != std::string_view::npos;
}

/// The message for a rank whose communicator NCCL refused because another rank of the job holds
/// the same GPU: what was found, why the choice was made, and the fixes.
inline std::string shared_gpu_message(rank_gpu_inputs const& in, rank_gpu const& chosen, std::string_view nccl_last_error) {
  std::string m = "dparallel: nccl::init_process_group on rank " + std::to_string(in.rank) + ": another rank of this job uses GPU " +
                  std::to_string(chosen.gpu) + " of this host too (NCCL: " + std::string(nccl_last_error) + "). ";
  if (in.explicit_gpu) {
    m += "This rank was given GPU " + std::to_string(chosen.gpu) + " explicitly; give each rank of a host its own.";
  } else {
    m += "This rank took GPU " + std::to_string(chosen.gpu) + " = local rank " + std::to_string(in.local_rank) + " % " +
         std::to_string(in.visible) + " visible GPU(s)" +
         (in.cuda_visible_devices ? " (CUDA_VISIBLE_DEVICES='" + *in.cuda_visible_devices + "')" : std::string()) + ", with " +
         std::to_string(in.local_world_size) + " ranks on this host (" + in.local_source + "). ";
    m += "NCCL needs one GPU per rank: start at most as many ranks per host as it has GPUs, or give each rank its own GPU "
         "(srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank, or the `gpu` argument).";
  }
  m += " Several ranks on one GPU are for correctness checks only: see docs/gpu-check.md.";
  return m;
}

/// DDP's device when options::local_device is not given: the device the group's communicator is
/// bound to when it is of the backend's kind (an NCCL rank's own GPU, whatever the launch), else
/// device rank % `count` (the backend's device count; host: device `rank` when count is empty).
inline device default_rank_device(std::optional<device> bound, device_kind kind, int rank, std::optional<int> count) {
  if (bound && bound->kind == kind) return *bound;
  return device{kind, count && *count > 0 ? rank % *count : rank, 0};
}

/// One environment variable to set.
struct env_setting {
  std::string name;
  std::string value;
};

/// The environment that makes NCCL accept `rank` as one of several processes on one GPU (a
/// correctness check only; NCCL does not support it for training): NCCL >= 2.30 has
/// NCCL_MULTI_RANK_GPU_ENABLE (experimental); older NCCL takes each process for a host of its own
/// (NCCL_HOSTID) whose ranks talk over sockets on loopback (InfiniBand off), so its duplicate-GPU
/// check compares nothing and only the network transport is used.
inline std::vector<env_setting> shared_gpu_environment(int nccl_version, int rank) {
  if (nccl_version >= nccl_multi_rank_gpu_version) return {{"NCCL_MULTI_RANK_GPU_ENABLE", "1"}};
  return {{"NCCL_HOSTID", "dparallel-shared-gpu-rank-" + std::to_string(rank)},
          {"NCCL_SOCKET_IFNAME", "lo"},
          {"NCCL_IB_DISABLE", "1"}};
}

/// Checks the GPUs of nccl::make_groups' thread ranks (ordinals, rank i on gpus[i]): distinct,
/// unless `allow_shared` (a test's explicit consent) and NCCL can share a GPU between ranks of one
/// process (version >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, read from `multi_rank_env`).
/// Returns whether two ranks share a GPU; invalid_argument otherwise.
inline bool check_group_gpus(std::vector<int> const& gpus, bool allow_shared, int nccl_version,
                             std::optional<std::string> const& multi_rank_env) {
  require(!gpus.empty(), "nccl::make_groups: expected at least one GPU, found none");
  std::optional<std::pair<std::size_t, std::size_t>> dup;
  for (std::size_t i = 0; i < gpus.size() && !dup; ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (gpus[j] == gpus[i]) {
        dup = std::pair{j, i};
        break;
      }
  if (!dup) return false;
  std::string const found = "found ranks " + std::to_string(dup->first) + " and " + std::to_string(dup->second) +
                            " on GPU " + std::to_string(gpus[dup->second]);
  if (!allow_shared)
    throw invalid_argument("dparallel: nccl::make_groups: NCCL needs one rank per GPU, " + found +
                           "; logical devices of one GPU use the CUDA backend's copy/kernel path");
  if (nccl_version < nccl_multi_rank_gpu_version)
    throw invalid_argument("dparallel: nccl::make_groups (shared GPU allowed for tests): " + found + ", but NCCL " +
                           nccl_version_string(nccl_version) + " cannot put two ranks of one process on one GPU (NCCL " +
                           nccl_version_string(nccl_multi_rank_gpu_version) +
                           " can, with NCCL_MULTI_RANK_GPU_ENABLE=1); with this NCCL run the ranks as processes, each "
                           "with its own NCCL_HOSTID (docs/gpu-check.md)");
  if (!multi_rank_env || *multi_rank_env != "1")
    throw invalid_argument("dparallel: nccl::make_groups (shared GPU allowed for tests): " + found + "; NCCL " +
                           nccl_version_string(nccl_version) +
                           " shares a GPU between ranks only with NCCL_MULTI_RANK_GPU_ENABLE=1, found " +
                           (multi_rank_env ? "'" + *multi_rank_env + "'" : std::string("it unset")) +
                           ": set it before the process's first NCCL call");
  return true;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

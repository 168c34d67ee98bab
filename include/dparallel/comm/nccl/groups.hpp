#pragma once
// The ways to make NCCL process groups: nccl::make_groups (thread ranks of one process, one GPU
// each) and nccl::init_process_group (one rank per process, from the launcher's environment).
// Included by <dparallel/comm/nccl.hpp>; the communicator is in comm/nccl/communicator.hpp.

#include <dparallel/comm/nccl/communicator.hpp>

DPARALLEL_NAMESPACE_BEGIN
namespace nccl {

/// Whether nccl::make_groups may put two thread ranks on one GPU.
enum class shared_gpu {
  refuse,           ///< every rank on a GPU of its own (NCCL's supported layout)
  allow_for_tests,  ///< tests of the rank logic on one GPU: needs NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1
};

/// NCCL's version code at run time (ncclGetVersion: 22809 for 2.28.9).
inline int runtime_version() {
  int v = 0;
  check(ncclGetVersion(&v), "ncclGetVersion", 0);
  return v;
}

/// Thread ranks of one process, rank i on GPU gpus[i] (distinct GPUs; NCCL refuses two ranks on
/// one GPU, unless `sharing` allows it for tests on an NCCL that can, see
/// detail::check_group_gpus). Made together with ncclCommInitAll; hand group i to the thread that
/// runs rank i.
inline std::vector<process_group> make_groups(std::vector<device> const& gpus,
                                              std::chrono::milliseconds timeout = std::chrono::seconds(300),
                                              shared_gpu sharing = shared_gpu::refuse) {
  std::vector<int> ordinals;
  for (auto const& g : gpus) {
    cuda::check_device(g);
    ordinals.push_back(g.index);
  }
  bool const allow = sharing == shared_gpu::allow_for_tests;
  int const version = allow ? runtime_version() : 0;
  (void)dparallel::detail::check_group_gpus(ordinals, allow, version, process_environment()("NCCL_MULTI_RANK_GPU_ENABLE"));
  std::vector<ncclComm_t> comms(gpus.size(), nullptr);
  check(ncclCommInitAll(comms.data(), static_cast<int>(comms.size()), ordinals.data()), "ncclCommInitAll", 0);
  std::vector<process_group> out;
  for (std::size_t i = 0; i < gpus.size(); ++i)
    out.emplace_back(std::make_shared<communicator>(comms[i], static_cast<int>(i), static_cast<int>(gpus.size()),
                                                    gpus[i], timeout));
  return out;
}

/// One rank per process: resolves the launch from the environment (see init_process_group), picks
/// its GPU (detail::choose_rank_gpu: `gpu` when given, else local_rank % the GPUs this process
/// sees, so one visible GPU per rank works too), shares rank 0's unique id through `bootstrap`
/// (e.g. an MPI group) or the TCP rendezvous, and makes the communicator with ncclCommInitRank.
/// Two ranks that really share a GPU on one host fail with a comm_error naming the fix.
inline distributed_group init_process_group(init_options const& opts = {}, process_group const& bootstrap = {},
                                            std::optional<device> gpu = std::nullopt,
                                            environment const& env = process_environment()) {
  return dparallel::init_process_group(
      [&](launch_info const& info, init_options const& o) -> process_group {
        dparallel::detail::rank_gpu_inputs in;
        in.rank = info.rank;
        in.local_rank = info.local_rank;
        in.local_world_size = info.local_world_size;
        in.local_source = info.local_source;
        in.explicit_gpu = gpu ? std::optional<int>(gpu->index) : std::nullopt;
        in.cuda_visible_devices = env ? env("CUDA_VISIBLE_DEVICES") : std::nullopt;
        in.visible = gpu ? 0 : cuda::device_count();
        auto const chosen = dparallel::detail::choose_rank_gpu(in, gpu || in.visible > 0 ? std::string() : cuda::no_device_reason());
        device const d = gpu.value_or(device{device_kind::cuda, chosen.gpu, 0});
        cuda::check_device(d);
        ncclUniqueId id{};
        if (info.rank == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId", 0);
        auto const bytes = share_root_bytes(info, std::as_bytes(std::span(&id, 1)), sizeof id, bootstrap, o.timeout);
        std::memcpy(&id, bytes.data(), sizeof id);
        // The rank's GPU becomes this thread's current device once, for good (no guard restoring
        // another device): NCCL and the user's kernels of this rank run there, and no context is
        // created on a GPU this rank does not use (CUDA: cudaSetDevice sets the calling host
        // thread's device; contexts are made on first use).
        cuda::check(cudaSetDevice(d.index), "cudaSetDevice", d);
        ncclComm_t comm = nullptr;
        ncclResult_t const r = ncclCommInitRank(&comm, info.world_size, id, info.rank);
        if (r != ncclSuccess && r != ncclInProgress) {
          // NCCL compares the ranks' GPUs (bus id per host) while making the communicator and
          // fails with "Duplicate GPU" when two ranks of one host hold the same one.
          char const* last = ncclGetLastError(nullptr);
          if (last != nullptr && dparallel::detail::names_duplicate_gpu(last))
            throw comm_error(info.rank, dparallel::detail::shared_gpu_message(in, chosen, last));
          check(r, "ncclCommInitRank", info.rank);
        }
        return process_group(std::make_shared<communicator>(comm, info.rank, info.world_size, d, o.timeout));
      },
      opts, env);
}
}  // namespace nccl
DPARALLEL_NAMESPACE_END

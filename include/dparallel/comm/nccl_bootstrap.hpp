#pragma once
// NCCL bootstrap across processes, without NCCL's header: rank 0 makes an ncclUniqueId
// (NCCL_UNIQUE_ID_BYTES = 128 opaque bytes) and every rank needs a copy before
// ncclCommInitRank. share_root_bytes carries such bytes from rank 0 to every rank:
//   - through `group` when the program already has a process group (e.g. MPI: a broadcast of
//     U8 elements), the preferred path under mpirun/srun;
//   - else through tcp_rendezvous at MASTER_ADDR:MASTER_PORT (torchrun-style `env://`).
//
//   ncclUniqueId id{};
//   if (info.rank == 0) ncclGetUniqueId(&id);
//   auto bytes = dparallel::share_root_bytes(info, std::as_bytes(std::span(&id, 1)), sizeof id);
//   std::memcpy(&id, bytes.data(), sizeof id);
//   ncclCommInitRank(&comm, info.world_size, id, info.rank);

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/comm/rendezvous.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Size of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES), so that code without NCCL's header can size buffers.
inline constexpr std::size_t nccl_unique_id_bytes = 128;

/// Returns rank 0's `bytes` (exactly `size` of them) on every rank. Rank 0 passes its bytes; the
/// other ranks' `mine` is ignored. Through `group` when it is valid (it must be rank info.rank of
/// info.world_size), else through tcp_rendezvous at info.master_addr:info.master_port.
inline std::vector<std::byte> share_root_bytes(launch_info const& info, std::span<std::byte const> mine,
                                               std::size_t size, process_group const& group = {},
                                               std::chrono::milliseconds timeout = std::chrono::seconds(300)) {
  std::string const who = "dparallel: share_root_bytes on rank " + std::to_string(info.rank) + ": ";
  if (info.rank == 0 && mine.size() != size)
    throw invalid_argument(who + "expected rank 0's " + std::to_string(size) + " bytes, found " +
                           std::to_string(mine.size()));
  std::vector<std::byte> out(size);
  if (info.rank == 0) std::copy(mine.begin(), mine.end(), out.begin());
  if (group.valid()) {
    if (group.rank() != info.rank || group.size() != info.world_size)
      throw invalid_argument(who + "the group is rank " + std::to_string(group.rank()) + " of " +
                             std::to_string(group.size()) + ", the launch says rank " + std::to_string(info.rank) +
                             " of " + std::to_string(info.world_size));
    tensor_ref const t(out.data(), out.size(), dtype::u8);
    try {
      group.broadcast(t, 0).wait();
    } catch (...) {
      group.drain();  // `out` must outlive the collective
      throw;
    }
    return out;
  }
  if (info.world_size == 1) return out;
  if (info.master_addr.empty() || info.master_port == 0)
    throw invalid_argument(who + "no process group to broadcast through, and " +
                           (info.master_addr.empty() ? std::string("MASTER_ADDR") : std::string("MASTER_PORT")) +
                           " is not set: set MASTER_ADDR and MASTER_PORT (rank 0's host and a free port), or "
                           "bootstrap through an MPI process group");
  auto const blobs = tcp_rendezvous({.master_addr = info.master_addr,
                                     .master_port = info.master_port,
                                     .rank = info.rank,
                                     .world_size = info.world_size,
                                     .timeout = timeout},
                                    info.rank == 0 ? mine : std::span<std::byte const>{});
  if (blobs[0].size() != size)
    throw comm_error(0, who + "rank 0 sent " + std::to_string(blobs[0].size()) + " bytes, expected " +
                            std::to_string(size));
  return blobs[0];
}

DPARALLEL_NAMESPACE_END

#pragma once
// The options of a shared-memory process group and the bootstrap that carries its segment's name
// from rank 0 to the other ranks (see <dparallel/comm/shm.hpp>). No POSIX or MPI header.

#include <dparallel/config.hpp>

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace shm {

/// Options of a shared-memory process group (the same on every rank).
struct options {
  /// A collective whose input is at most this many bytes per rank meets once (copy in, meet,
  /// every rank computes its result); larger ones go in chunks, with two meetings per chunk.
  std::size_t small_bytes = std::size_t{64} << 10;
  /// Bytes per rank of one chunk of a large collective: the segment holds (ranks + 1) chunks plus
  /// 2 x ranks small slots, all reserved in /dev/shm when the group is made (a /dev/shm too small
  /// for them is an error on every rank, naming the bytes).
  std::size_t chunk_bytes = std::size_t{4} << 20;
  /// Bytes per rank of group memory: what process_group::allocate hands out in the segment, so
  /// that an all_reduce or reduce of a buffer every rank allocated there reads and writes the
  /// ranks' buffers in place (no copy through the segment). Address space only: a page takes
  /// memory once allocated. Allocations beyond it (or beyond what /dev/shm holds) get ordinary
  /// memory, which the collectives copy as before. Subgroups get the same.
  std::size_t arena_bytes = std::size_t{1} << 30;
  /// Names the segment "/dparallel-<job_id>" (letters, digits, '.', '_', '-'); empty (the
  /// default): rank 0 picks a random name. A segment of that name left by an earlier job that
  /// crashed during its setup is replaced; one whose creating process still runs is an error.
  std::string job_id{};
};

/// Carries rank 0's bytes to every rank of the group: rank 0 passes its bytes, every rank
/// (rank 0 too) returns them. E.g. an MPI_Bcast, or tcp_rendezvous (rendezvous_bootstrap).
using bootstrap_fn = std::function<std::vector<std::byte>(std::span<std::byte const> root_bytes)>;

}  // namespace shm

DPARALLEL_NAMESPACE_END

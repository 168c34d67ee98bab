#pragma once
// The MPI engine's shared-memory switch (see <dparallel/comm/mpi.hpp>, "Shared memory"): when
// every rank of the parent communicator shares this node (MPI_Comm_split_type with
// MPI_COMM_TYPE_SHARED gives one communicator as large as the parent), the group's data moves
// through a shared-memory segment (comm/shm.hpp) instead of MPI; MPI only broadcasts the
// segment's name (MPI_Ibcast on the node's communicator, bounded by the timeout).

#include <dparallel/config.hpp>
#include <dparallel/comm/mpi/detail/common.hpp>
#include <dparallel/comm/mpi/detail/engine.hpp>
#include <dparallel/comm/shm.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// (progress thread) Broadcasts `count` bytes at `data` from rank 0 of `comm` with MPI_Ibcast,
/// polling until `deadline`; returns an error message, empty on success.
inline std::string mpi_bcast_until(MPI_Comm comm, void* data, int count, mpi_clock::time_point deadline) {
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Ibcast(data, count, MPI_BYTE, 0, comm, &req);
  if (rc != MPI_SUCCESS) return "MPI_Ibcast failed: " + mpi_error_text(rc);
  for (int spins = 0;; ++spins) {
    int flag = 0;
    rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return "MPI_Ibcast failed: " + mpi_error_text(rc);
    if (flag != 0) return {};
    if (mpi_clock::now() >= deadline)
      return "broadcasting the shared-memory segment's name did not complete within the timeout";
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 10 : 200));
  }
}

/// Frees an MPI communicator (unless null) on the progress thread when it goes out of scope.
struct mpi_comm_owner {
  std::shared_ptr<mpi_engine> engine;  ///< The engine whose progress thread makes MPI calls.
  MPI_Comm comm = MPI_COMM_NULL;       ///< Freed by the destructor.
  ~mpi_comm_owner() {
    if (comm != MPI_COMM_NULL) engine->call([&] { MPI_Comm_free(&comm); });
  }
};

/// Why a failed node group must end the MPI job with MPI_Abort, empty when MPI_Finalize can end
/// it: a rank that did not arrive within the timeout (stopped, hung: it may never reach
/// MPI_Finalize, which would wait for it for ever) or whose process died. A failure every rank
/// learns at once (an abort, mismatched collectives, a rank that finished) leaves every process
/// free to finalise. `lead`: whether this rank calls MPI_Abort first (the lowest rank not at
/// fault; the others give it 5 s).
inline std::pair<std::string, bool> shm_exit_problem(shm_group const& g) {
  if (!g.failed()) return {};
  auto const [f, cause] = g.failure_and_cause();
  if (cause == shm_fail_cause::reported) return {};
  int const leader = f.rank == 0 && g.size() > 1 ? 1 : 0;
  return {"its shared-memory group failed on rank " + std::to_string(g.rank()) + " (" + f.reason + ")",
          g.rank() == leader};
}

/// The shared-memory group of the ranks of `parent` when they all share this node and `opts`
/// allow it (shared_memory, rank_order, not cuda_aware); nullopt otherwise (the same answer on
/// every rank). Every rank of `parent` must call it, after constructing its MPI communicator.
/// `parent_ranks`: for a subgroup, its members in its parent (named in its errors).
inline std::optional<process_group> mpi_shared_memory_group(MPI_Comm parent, std::chrono::milliseconds timeout,
                                                            mpi::options const& opts,
                                                            std::vector<int> parent_ranks = {}) {
  if (!opts.shared_memory || opts.cuda_aware || opts.reduce != mpi::reduction::rank_order) return std::nullopt;
  auto engine = mpi_engine::instance();
  MPI_Comm node = MPI_COMM_NULL;
  int rank = 0, size = 0, node_size = 0;
  std::string problem;
  engine->call([&] {
    MPI_Comm_rank(parent, &rank);
    MPI_Comm_size(parent, &size);
    int const rc = MPI_Comm_split_type(parent, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    if (rc != MPI_SUCCESS) {
      problem = "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed: " + mpi_error_text(rc);
      return;
    }
    MPI_Comm_set_errhandler(node, MPI_ERRORS_RETURN);
    MPI_Comm_size(node, &node_size);
  });
  if (!problem.empty()) throw comm_error(rank, "dparallel: mpi: rank " + std::to_string(rank) + ": " + problem);
  mpi_comm_owner const owner{engine, node};
  if (node_size != size) return std::nullopt;  // several nodes: MPI moves the data

  auto const deadline = mpi_clock::now() + timeout;
  shm::bootstrap_fn const share = [&](std::span<std::byte const> mine) {
    std::uint64_t len = mine.size();
    std::vector<std::byte> bytes(mine.begin(), mine.end());
    std::string why;
    engine->call([&] {
      why = mpi_bcast_until(node, &len, static_cast<int>(sizeof len), deadline);
      if (!why.empty()) return;
      bytes.resize(static_cast<std::size_t>(len));
      why = mpi_bcast_until(node, bytes.data(), static_cast<int>(len), deadline);
    });
    if (!why.empty()) {
      engine->must_abort("rank " + std::to_string(rank) + ": " + why);  // a broadcast may be left in flight
      throw timeout_error(0, "dparallel: mpi: rank " + std::to_string(rank) + ": " + why);
    }
    return bytes;
  };
  std::shared_ptr<shm_group> group;
  try {
    group = join_shm_group(rank, size, share, timeout, shm::options{});
  } catch (timeout_error const& e) {
    engine->must_abort(std::string("setting up its shared-memory group failed: ") + e.what());
    throw;
  }
  group->set_parent_ranks(std::move(parent_ranks));
  // The group's failure reaches the engine's exit: when the group is destroyed, or at exit if it lives.
  group->on_failed_release([engine](shm_group const& g) {
    if (auto [why, lead] = shm_exit_problem(g); !why.empty()) engine->must_abort(std::move(why), lead);
  });
  engine->watch_exit([w = std::weak_ptr<shm_group>(group)]() -> std::pair<std::string, bool> {
    if (auto g = w.lock()) return shm_exit_problem(*g);
    return {};
  });
  return process_group(std::make_shared<shm::communicator>(std::move(group), timeout));
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// The MPI engine's shared vocabulary (see <dparallel/comm/mpi.hpp> for the design): the options,
// MPI datatypes and error texts, the rank-order integer reduction, and one collective as the
// progress thread runs it (mpi_task queued, mpi_running in flight).

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the C API only: no deprecated C++ bindings
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/shm/detail/kernels.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace mpi {

/// How F32/F64 reductions are computed (see <dparallel/comm/mpi.hpp>); F16/BF16 always take rank_order.
enum class reduction : std::uint8_t {
  rank_order,  ///< each element summed in rank order 0..n-1: bitwise the host communicator's result
  native,      ///< MPI's own reduction (MPI_SUM): MPI's order, within rounding of rank_order
};

/// Options of an MPI communicator; the timeout is separate (constructor argument, set_timeout).
struct options {
  reduction reduce = reduction::rank_order;
  /// Accept device (CUDA) memory and hand it to MPI as is: only with a CUDA-aware MPI. Device
  /// buffers take MPI's own reductions (sum only: avg needs a kernel dparallel does not run here).
  bool cuda_aware = false;
  /// Longest message of one MPI call, in elements; longer collectives are split (MPI counts are int).
  std::size_t max_message_elements = std::size_t{1} << 28;
  /// After a timeout, how long a rank waits for its peers to answer its status query.
  std::chrono::milliseconds probe_window = std::chrono::seconds(2);
  /// At exit, how long a rank whose group failed waits for its peers' EXIT messages before
  /// ending the job with MPI_Abort.
  std::chrono::milliseconds exit_grace = std::chrono::seconds(10);
  /// Before each collective the ranks exchange a descriptor of it (operation, dtype, element
  /// count, reduce op, root, sequence number: one MPI_Iallgather of 64 bytes per rank); when the
  /// descriptors differ no rank runs it and every rank's wait fails with a comm_error naming the
  /// rank at fault and what each rank called. false skips the exchange: a mismatched collective
  /// is then undefined (wrong data, an MPI error or a timeout).
  bool check_collectives = true;
  /// When every rank of the group shares one node (MPI_Comm_split_type, MPI_COMM_TYPE_SHARED),
  /// make_group and init_process_group return a shared-memory group (comm/shm.hpp): the same
  /// bits, without MPI's staging copies and all-to-alls; MPI only broadcasts the segment's name.
  /// Applies with reduction::rank_order and without cuda_aware; false keeps MPI for the data.
  bool shared_memory = true;
};

}  // namespace mpi

namespace detail {

using mpi_clock = std::chrono::steady_clock;

inline std::string mpi_error_text(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(buf, static_cast<std::size_t>(len));
}

/// The MPI datatype of one element of `t` (F16/BF16 as 16-bit words: MPI moves them, dparallel
/// reduces them, always in rank order).
inline MPI_Datatype mpi_type_of(dtype t) {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::f16:
    case dtype::bf16: return MPI_UINT16_T;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

/// One rank's slice of a rank-order reduction: F32/F64/F16/BF16 with the host communicator's
/// kernel (op applied), integers by wrapping sums (comm/shm/detail/kernels.hpp).
inline void reduce_in_rank_order(dtype t, std::span<void const* const> srcs, void* dst, std::size_t count,
                                 reduce_op op, int n) {
  reduce_any(t, srcs, std::span<void* const>(&dst, 1), count, op, n);
}

inline std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "level " + std::to_string(level);
  }
}

// --- one collective ---------------------------------------------------------------------------

using mpi_task = comm_task;  // the record every engine queues (comm/detail/comm_call.hpp)

/// A collective being executed: MPI requests started one after the other. On failure the whole
/// object (its request and staging memory) is kept as an orphan until MPI completes the request.
struct mpi_running {
  struct step {
    std::function<int(mpi_running&, MPI_Request*)> start;
    std::function<void(mpi_running&)> finish;
  };
  mpi_task task;
  std::vector<step> steps;
  std::size_t next = 0;
  MPI_Request req = MPI_REQUEST_NULL;
  bool in_flight = false;
  mpi_clock::time_point started;
  mpi_clock::time_point deadline;
  std::unique_ptr<std::byte[]> staging;
  std::size_t staging_bytes = 0;
  std::vector<int> c1, d1, c2, d2;  // counts and displacements of the step in flight
  // The descriptor check (options::check_collectives): this rank's fingerprint, every rank's,
  // and, when they differ, the rank at fault and the report (set by the check's finish).
  std::array<std::int64_t, desync_fingerprint::words> fp_mine{};
  std::vector<std::int64_t> fp_all;
  std::optional<std::pair<int, std::string>> mismatch;
};

/// Why an MPI group failed (the rank at fault, timeout or not, the reason).
using mpi_failure = comm_failure;

}  // namespace detail
DPARALLEL_NAMESPACE_END

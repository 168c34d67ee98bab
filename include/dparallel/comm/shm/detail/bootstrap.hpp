#pragma once
// Setting up a shared-memory process group (see <dparallel/comm/shm.hpp>): the segment's name,
// creating or mapping it with the bootstrap (comm/shm_options.hpp) carrying the name from rank 0,
// and the TCP rendezvous form of that bootstrap (torchrun-style launches), which also checks that
// every rank runs on this node.

#include <dparallel/config.hpp>
#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/comm/rendezvous.hpp>
#include <dparallel/comm/shm_options.hpp>
#include <dparallel/comm/shm/detail/group.hpp>
#include <dparallel/comm/shm/detail/segment.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/detail/printable.hpp>

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

inline void shm_setup_fail(std::string const& what) { throw invalid_argument("dparallel: shm::make_group: " + what); }

/// The first character of the "name" rank 0 shares when it could not make the segment (a real
/// name starts with '/'), followed by its error message.
inline constexpr char shm_failure_tag = '!';

/// What rank 0 shares instead of a token and a name when its set-up failed: a zero token, the tag
/// and `why` (at most 4 KiB of it), so that every rank reports rank 0's cause at once.
inline std::vector<std::byte> shm_failure_bytes(std::string_view why) {
  why = why.substr(0, 4096);
  std::vector<std::byte> b(2 * sizeof(std::uint64_t) + 1 + why.size(), std::byte{0});
  b[2 * sizeof(std::uint64_t)] = static_cast<std::byte>(shm_failure_tag);
  std::memcpy(b.data() + 2 * sizeof(std::uint64_t) + 1, why.data(), why.size());
  return b;
}

inline std::string shm_segment_name(shm::options const& opts) {
  if (!opts.job_id.empty()) {
    if (opts.job_id.size() > 200) shm_setup_fail("expected a job_id of at most 200 characters, found " + std::to_string(opts.job_id.size()));
    for (char c : opts.job_id) {
      bool const ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                      c == '_' || c == '-';
      if (!ok) shm_setup_fail("expected a job_id of letters, digits, '.', '_' and '-', found '" + opts.job_id + "'");
    }
    return "/dparallel-" + opts.job_id;
  }
  std::random_device rd;
  char buf[64];
  std::snprintf(buf, sizeof buf, "/dparallel-%ld-%08x%08x", static_cast<long>(::getpid()), rd(), rd());
  return buf;
}

/// Unlinks the randomly named segments ("/dparallel-<pid>-<16 hex digits>") in /dev/shm whose
/// creating process is gone (one of another PID namespace is left alone): left by a rank 0 that died before every rank had mapped its segment
/// (the only window in which a name exists). Linux only; elsewhere a no-op.
inline void sweep_stale_segments() {
#if defined(__linux__)
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    std::string const name = e->d_name;
    std::string const prefix = "dparallel-";
    if (name.rfind(prefix, 0) != 0) continue;
    auto const dash = name.find('-', prefix.size());
    if (dash == std::string::npos || dash == prefix.size() || name.size() != dash + 17) continue;
    std::string const pid = name.substr(prefix.size(), dash - prefix.size());
    if (pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    if (name.find_first_not_of("0123456789abcdef", dash + 1) != std::string::npos) continue;
    // The name's process id means something only in the creator's PID namespace (the header's).
    shm_creator const c = shm_creator_of("/" + name);
    bool const gone = c.pid != 0 ? c.gone() : process_gone(std::stoll(pid));
    if (gone) stale.push_back("/" + name);
  }
  ::closedir(d);
  for (auto const& n : stale) ::shm_unlink(n.c_str());
#endif
}

/// Creates (rank 0) or maps (the others) the segment, with `share` carrying its name and token,
/// and waits until every rank has mapped it.
inline std::shared_ptr<shm_group> join_shm_group(int rank, int n, shm::bootstrap_fn const& share,
                                                 std::chrono::milliseconds timeout, shm::options const& opts) {
  if (n < 1) shm_setup_fail("expected a world size of at least 1, found " + std::to_string(n));
  if (rank < 0 || rank >= n)
    shm_setup_fail("expected a rank in [0, " + std::to_string(n) + "), found " + std::to_string(rank));
  if (timeout.count() <= 0) shm_setup_fail("expected a positive timeout, found " + std::to_string(timeout.count()) + " ms");
  if (opts.chunk_bytes < 64 * static_cast<std::size_t>(n))
    shm_setup_fail("expected options::chunk_bytes >= 64 x world size = " + std::to_string(64 * n) + ", found " +
                   std::to_string(opts.chunk_bytes));
  if (opts.small_bytes > (std::size_t{1} << 30) || opts.chunk_bytes > (std::size_t{1} << 32))
    shm_setup_fail("expected options::small_bytes <= 1 GiB and chunk_bytes <= 4 GiB");
  if (opts.arena_bytes > (std::size_t{1} << 40))
    shm_setup_fail("expected options::arena_bytes <= 1 TiB, found " + std::to_string(opts.arena_bytes));
  if (n > 1 && !share) shm_setup_fail("expected a bootstrap function to share the segment's name, found none");
  shm_layout const layout{n, shm_layout::round(opts.small_bytes), shm_layout::round(opts.chunk_bytes),
                          (opts.arena_bytes + shm_layout::arena_align - 1) / shm_layout::arena_align *
                              shm_layout::arena_align};

  std::unique_ptr<shm_segment> seg;
  std::vector<std::byte> mine;
  std::exception_ptr failed;  // rank 0's set-up failure, handed to every rank through the bootstrap
  if (rank == 0) {
    try {
      if (opts.job_id.empty()) sweep_stale_segments();
      seg = shm_segment::create(shm_segment_name(opts), layout);
      std::string const& name = seg->name();
      mine.resize(sizeof seg->header().token + name.size());
      std::memcpy(mine.data(), seg->header().token, sizeof seg->header().token);
      std::memcpy(mine.data() + sizeof seg->header().token, name.data(), name.size());
    } catch (std::exception const& e) {
      failed = std::current_exception();
      mine = shm_failure_bytes(e.what());
    }
  }
  std::vector<std::byte> root;
  try {
    root = n > 1 ? share(mine) : mine;
  } catch (...) {
    if (failed) std::rethrow_exception(failed);  // rank 0's own cause, not the bootstrap's
    throw;
  }
  if (failed) std::rethrow_exception(failed);
  std::uint64_t token[2] = {0, 0};
  if (root.size() <= sizeof token)
    throw comm_error(0, "dparallel: shm::make_group on rank " + std::to_string(rank) + ": the bootstrap delivered " +
                            std::to_string(root.size()) + " bytes from rank 0, expected a token and a segment name");
  if (rank != 0) {
    std::memcpy(token, root.data(), sizeof token);
    std::string const name(reinterpret_cast<char const*>(root.data()) + sizeof token, root.size() - sizeof token);
    if (name.front() == shm_failure_tag)
      throw comm_error(0, "dparallel: shm::make_group on rank " + std::to_string(rank) +
                              ": rank 0 could not set up the shared-memory group: " +
                              printable(std::string_view(name).substr(1), 4096));
    seg = shm_segment::open(name, token, n);
  }
  auto group = std::make_shared<shm_group>(std::move(seg), rank);
  group->join(timeout);
  return group;
}

/// This machine: its host name and boot id (two processes with the same identity share /dev/shm).
inline std::string node_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string id = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot >> boot_id) id += "/" + boot_id;
  return id;
}

/// The bootstrap of a torchrun-style launch: tcp_rendezvous at MASTER_ADDR:MASTER_PORT, which
/// also checks that every rank runs on this node (a rank elsewhere: invalid_argument naming it).
inline shm::bootstrap_fn rendezvous_bootstrap(launch_info const& info, std::chrono::milliseconds timeout) {
  if (info.world_size > 1 && (info.master_addr.empty() || info.master_port == 0))
    throw invalid_argument("dparallel: shm::init_process_group on rank " + std::to_string(info.rank) + ": " +
                           (info.master_addr.empty() ? "MASTER_ADDR" : "MASTER_PORT") +
                           " is not set: set MASTER_ADDR and MASTER_PORT (rank 0's host and a free port) for the "
                           "rendezvous, or launch with MPI");
  return [info, timeout](std::span<std::byte const> root_bytes) {
    std::string const node = node_identity();
    auto const len = static_cast<std::uint32_t>(node.size());
    std::vector<std::byte> blob(sizeof len + node.size() + root_bytes.size());
    std::memcpy(blob.data(), &len, sizeof len);
    std::memcpy(blob.data() + sizeof len, node.data(), node.size());
    if (!root_bytes.empty()) std::memcpy(blob.data() + sizeof len + node.size(), root_bytes.data(), root_bytes.size());
    auto const blobs = tcp_rendezvous({.master_addr = info.master_addr,
                                       .master_port = info.master_port,
                                       .rank = info.rank,
                                       .world_size = info.world_size,
                                       .timeout = timeout},
                                      blob);
    std::vector<std::string> nodes;
    for (std::size_t j = 0; j < blobs.size(); ++j) {
      auto const& b = blobs[j];
      std::uint32_t l = 0;
      if (b.size() >= sizeof l) std::memcpy(&l, b.data(), sizeof l);
      if (b.size() < sizeof l + l)
        throw comm_error(static_cast<int>(j), "dparallel: shm::init_process_group: rank " + std::to_string(j) +
                                                  " sent a malformed rendezvous blob");
      std::string const other(reinterpret_cast<char const*>(b.data()) + sizeof l, l);
      if (other != node)
        throw invalid_argument("dparallel: shm::init_process_group on rank " + std::to_string(info.rank) + ": rank " +
                               std::to_string(j) + " runs on another node (" + other + ", this one is " + node +
                               "); without MPI, dparallel's process groups span one node (shared memory). Launch a "
                               "job on several nodes with MPI (mpirun / srun, dparallel::mpi::init_process_group)");
    }
    auto const& b0 = blobs[0];
    std::uint32_t l0 = 0;
    std::memcpy(&l0, b0.data(), sizeof l0);
    return std::vector<std::byte>(b0.begin() + static_cast<std::ptrdiff_t>(sizeof l0 + l0), b0.end());
  };
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

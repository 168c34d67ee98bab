#pragma once
// The POSIX shared-memory segment of one shared-memory process group (see <dparallel/comm/shm.hpp>):
// its layout, how rank 0 creates it and the other ranks map it, and the waiting primitives that
// the ranks' processes share through it (lock-free atomics on plain words, std::atomic_ref, and a
// futex on Linux; no process-shared mutex, which a crashed owner could leave locked).
//
// Lifetime. Rank 0 creates the segment (shm_open O_CREAT | O_EXCL, mode 0600), sizes and maps it,
// fills the header and publishes its magic word last; the name travels to the other ranks through
// the bootstrap (MPI, the TCP rendezvous). Each rank maps it and counts itself in; the rank whose
// count completes the group unlinks the name at once, so from then on the segment lives only in
// the mappings and disappears with the last process, whatever way it ends. A setup that fails
// (a rank that never maps it within the timeout, a rank that dies) unlinks the name too.
// A rank 0 that dies before every rank has mapped the segment leaves the name behind: the next
// group made on the node removes it (shm/detail/bootstrap.hpp, sweep_stale_segments).
// A name that exists already (a segment left by an earlier job that crashed during its setup,
// with the same shm::options::job_id) is replaced when the process that created it is gone, and
// is a clear error when that process still runs (or lives in another PID namespace, where its
// number cannot be checked: the header records the creator's PID namespace, each slot its rank's).
//
// Liveness. A rank that dies while the group is in use is found by its peers: within one PID
// namespace by its process id (kill(pid, 0), /proc), across PID namespaces (containers that share
// /dev/shm but not their process ids) by a lock. Each rank holds an open-file-description lock
// (F_OFD_SETLK) on byte `rank` of the segment's file through its own descriptor, which the kernel
// releases when the process ends in any way; a peer asks with F_OFD_GETLK whether anyone still
// holds that byte. The lock belongs to the descriptor, not to a thread or a process id, so it
// means the same in every namespace; a child forked after the group was made shares the
// descriptor and keeps its parent's rank looking alive (then only the timeout finds it).
//
// Memory. Rank 0 reserves the header, the slots and the chunks at creation (posix_fallocate): a
// /dev/shm that cannot hold them is an error naming the bytes needed and free (handed to every
// rank through the bootstrap), never a SIGBUS at first touch.
// Group memory. Past the chunks, each rank has a region of options::arena_bytes (rounded up to
// pages) that process_group::allocate hands out (shm/detail/arena.hpp). The file is sized to hold
// them but is sparse: a page takes memory once it is reserved (fallocate, so a full /dev/shm is an
// error at allocation rather than a SIGBUS at first touch) or touched. The descriptor of an
// all_reduce or reduce whose buffer lies in its rank's region carries the buffer's offset, so the
// peers read and write it in place (shm/detail/collectives.hpp).

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

inline constexpr std::uint64_t shm_magic = 0x4450'4152'5348'4d31ull;  // "DPARSHM1"
inline constexpr std::uint64_t shm_version = 4;
inline constexpr std::size_t shm_reason_bytes = 1024;

/// Why a shared-memory group failed (the header's fail_cause): what the error type and the end of
/// an MPI job depend on.
enum class shm_fail_cause : std::uint32_t {
  reported = 0,  ///< a live rank reported it (abort, mismatched collectives, invalid arguments, a rank that finished)
  timeout = 1,   ///< a rank did not arrive within the timeout (slow, stopped, hung)
  died = 2,      ///< a rank's process is gone
};

/// A collective's descriptor as a rank publishes it in its slot (what must match across ranks).
struct shm_call_record {
  std::uint64_t seq;
  std::uint64_t count;
  std::uint64_t total;
  std::uint64_t where;  // offset of the rank's buffer in its group memory (never 0: past the header); 0: none
  std::int32_t root;
  std::uint8_t kind;
  std::uint8_t type;
  std::uint8_t op;
  std::uint8_t pad;
};

/// One rank's control words, on cache lines of their own.
struct alignas(64) shm_rank_slot {
  alignas(8) std::uint64_t step;    // barriers this rank has arrived at
  alignas(8) std::uint64_t closed;  // last collective it will issue (max: still open)
  alignas(8) std::int64_t pid;      // its process, once it mapped the segment (0 before)
  std::uint64_t pidns;              // the PID namespace `pid` is valid in (written before pid)
  std::uint64_t holds_lock;         // 1: it holds its liveness lock (written before pid)
  shm_call_record calls[2];         // its descriptors, by sequence-number parity
};

/// The segment's header. Every word two processes touch is accessed through std::atomic_ref.
struct alignas(64) shm_header {
  alignas(8) std::uint64_t magic;  // published last by the creator
  std::uint64_t version;
  std::uint64_t token[2];          // random; the bootstrap carries it with the name
  std::int64_t creator_pid;
  std::uint64_t creator_pidns;     // the PID namespace creator_pid is valid in
  std::int32_t world;
  std::int32_t pad0;
  std::uint64_t small_bytes;
  std::uint64_t chunk_bytes;
  std::uint64_t arena_bytes;
  std::uint64_t total_bytes;
  alignas(64) std::uint32_t epoch;     // bumped on every change waiters wait for (the futex word)
  std::uint32_t sleepers;              // waiters inside futex_wait
  alignas(64) std::uint32_t fail_state;  // 0 healthy, 1 being written, 2 failed
  std::int32_t fail_rank;
  std::uint32_t fail_cause;            // a shm_fail_cause
  char fail_reason[shm_reason_bytes];
  alignas(64) std::uint64_t mapped;  // ranks that have mapped the segment
};

template <class T>
inline std::atomic_ref<T> shm_word(T& w) noexcept {
  static_assert(std::atomic_ref<T>::is_always_lock_free, "shared-memory words must be lock-free atomics");
  return std::atomic_ref<T>(w);
}

/// Offsets of the parts of a segment for `n` ranks.
struct shm_layout {
  int n = 1;
  std::size_t small = 0;  // per rank and parity
  std::size_t chunk = 0;  // per rank (and the result area)
  std::size_t arena = 0;  // per rank: its group memory (a multiple of arena_align)

  static constexpr std::size_t arena_align = 4096;

  static constexpr std::size_t round(std::size_t v) noexcept { return (v + 63) / 64 * 64; }
  [[nodiscard]] std::size_t slots_at() const noexcept { return round(sizeof(shm_header)); }
  [[nodiscard]] std::size_t small_at() const noexcept {
    return slots_at() + round(static_cast<std::size_t>(n) * sizeof(shm_rank_slot));
  }
  [[nodiscard]] std::size_t chunk_at() const noexcept { return small_at() + 2 * static_cast<std::size_t>(n) * small; }
  [[nodiscard]] std::size_t result_at() const noexcept { return chunk_at() + static_cast<std::size_t>(n) * chunk; }
  [[nodiscard]] std::size_t arena_at(int j) const noexcept {
    return (result_at() + chunk + arena_align - 1) / arena_align * arena_align + static_cast<std::size_t>(j) * arena;
  }
  [[nodiscard]] std::size_t total() const noexcept { return arena_at(n); }
};

/// Whether process `pid` is gone: no such process, or a zombie (dead, not yet reaped).
inline bool process_gone(std::int64_t pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
#if defined(__linux__)
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto const close = text.rfind(')');
  if (close != std::string::npos && close + 2 < text.size()) {
    char const state = text[close + 2];
    return state == 'Z' || state == 'X';
  }
#endif
  return false;
}

/// This process's PID namespace (the inode of /proc/self/ns/pid), 0 where unknown. Process ids
/// are compared, and probed with kill(), only between processes of one PID namespace: ranks in
/// containers that share /dev/shm (--ipc=host) but not their PID namespace see other numbers.
inline std::uint64_t pid_namespace_id() noexcept {
#if defined(__linux__)
  struct stat st{};
  if (::stat("/proc/self/ns/pid", &st) == 0) return static_cast<std::uint64_t>(st.st_ino);
#endif
  return 0;
}

/// Whether a process `pid` of PID namespace `pidns` is known to be gone: false when it runs, or
/// when it lives in another PID namespace than this process (its number means nothing here).
inline bool process_gone_in(std::int64_t pid, std::uint64_t pidns) {
  return pidns == pid_namespace_id() && process_gone(pid);
}

/// The creator recorded in segment `name`'s header (pid 0 when it cannot be read).
struct shm_creator {
  std::int64_t pid = 0;
  std::uint64_t pidns = 0;
  [[nodiscard]] bool gone() const { return process_gone_in(pid, pidns); }
};
inline shm_creator shm_creator_of(std::string const& name) {
  shm_creator c;
  int const fd = ::shm_open(name.c_str(), O_RDONLY, 0600);
  if (fd < 0) return c;
  struct stat st{};
  if (::fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) >= sizeof(shm_header)) {
    void* p = ::mmap(nullptr, sizeof(shm_header), PROT_READ, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      c.pid = static_cast<shm_header const*>(p)->creator_pid;
      c.pidns = static_cast<shm_header const*>(p)->creator_pidns;
      ::munmap(p, sizeof(shm_header));
    }
  }
  ::close(fd);
  return c;
}

/// Sleeps until `word` may differ from `seen` or `max_wait` passed (a futex across processes on
/// Linux; a short sleep elsewhere). Spurious returns are fine: callers re-check.
inline void shm_futex_wait(std::uint32_t& word, std::uint32_t seen, std::chrono::microseconds max_wait) {
#if defined(__linux__)
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(max_wait.count() / 1000000);
  ts.tv_nsec = static_cast<long>((max_wait.count() % 1000000) * 1000);
  ::syscall(SYS_futex, &word, FUTEX_WAIT, seen, &ts, nullptr, 0);
#else
  (void)word;
  (void)seen;
  std::this_thread::sleep_for(std::min(max_wait, std::chrono::microseconds(50)));
#endif
}

inline void shm_futex_wake_all(std::uint32_t& word) {
#if defined(__linux__)
  ::syscall(SYS_futex, &word, FUTEX_WAKE, std::numeric_limits<int>::max(), nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

/// A mapping of one segment, and the name while it exists.
class shm_segment {
 public:
  shm_segment(shm_segment const&) = delete;
  shm_segment& operator=(shm_segment const&) = delete;
  ~shm_segment() {
    if (!unlinked_ && owns_name_) ::shm_unlink(name_.c_str());
    if (base_ != nullptr) ::munmap(base_, bytes_);
    if (fd_ >= 0) ::close(fd_);
  }

  /// Rank 0: creates and maps segment `name` for `layout` (see the top of the file for a name that exists).
  static std::unique_ptr<shm_segment> create(std::string const& name, shm_layout const& layout) {
    std::unique_ptr<shm_segment> s(new shm_segment(name));
    int fd = -1;
    for (int attempt = 0; attempt < 2 && fd < 0; ++attempt) {
      fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 && errno == EEXIST && attempt == 0) {
        replace_stale(name);
        s->replaced_stale_ = true;
        continue;
      }
      if (fd < 0) fail("could not create shared-memory segment " + name, errno);
    }
    s->owns_name_ = true;
    s->fd_ = fd;  // closed by the destructor, which also unlinks the name if anything below fails
    s->bytes_ = layout.total();
    if (::ftruncate(fd, static_cast<off_t>(s->bytes_)) != 0) {
      fail("could not size shared-memory segment " + name + " to " + std::to_string(s->bytes_) +
               " bytes (is /dev/shm large enough? lower shm::options::chunk_bytes)",
           errno);
    }
    s->reserve_control(layout);
    s->map(s->fd_);
    shm_header& h = s->header();
    h.version = shm_version;
    std::random_device rd;
    h.token[0] = (std::uint64_t{rd()} << 32) ^ rd();
    h.token[1] = (std::uint64_t{rd()} << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
    h.creator_pid = ::getpid();
    h.creator_pidns = pid_namespace_id();
    h.world = layout.n;
    h.small_bytes = layout.small;
    h.chunk_bytes = layout.chunk;
    h.arena_bytes = layout.arena;
    h.total_bytes = s->bytes_;
    for (int j = 0; j < layout.n; ++j) s->slot(j).closed = std::numeric_limits<std::uint64_t>::max();
    shm_word(h.magic).store(shm_magic, std::memory_order_release);
    s->layout_ = layout;
    return s;
  }

  /// Ranks > 0: maps segment `name`, checking that it is the one rank 0 made (`token`, `n` ranks).
  static std::unique_ptr<shm_segment> open(std::string const& name, std::uint64_t const (&token)[2], int n) {
    std::unique_ptr<shm_segment> s(new shm_segment(name));
    int const fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      fail("could not open shared-memory segment " + name +
               " that rank 0 created (rank 0 died or gave up waiting, or the ranks do not share /dev/shm: "
               "are they on one node?)",
           errno);
    }
    struct stat st{};
    if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < sizeof(shm_header)) {
      ::close(fd);
      throw comm_error(0, "dparallel: shm: shared-memory segment " + name + " is smaller than its header (" +
                              std::to_string(st.st_size) + " bytes): rank 0 died while creating it");
    }
    s->bytes_ = static_cast<std::size_t>(st.st_size);
    s->map(fd);
    shm_header& h = s->header();
    if (shm_word(h.magic).load(std::memory_order_acquire) != shm_magic || h.version != shm_version ||
        h.token[0] != token[0] || h.token[1] != token[1] || h.world != n || h.total_bytes != s->bytes_) {
      throw comm_error(0, "dparallel: shm: shared-memory segment " + name +
                              " is not the one rank 0 announced (another job's, or a stale one with the same "
                              "name); expected " + std::to_string(n) + " ranks, found a header for " +
                              std::to_string(h.world));
    }
    s->layout_ = shm_layout{n, static_cast<std::size_t>(h.small_bytes), static_cast<std::size_t>(h.chunk_bytes),
                            static_cast<std::size_t>(h.arena_bytes)};
    if (s->layout_.total() != s->bytes_)
      throw comm_error(0, "dparallel: shm: shared-memory segment " + name + " has a header that does not add up");
    s->owns_name_ = true;  // until the group is complete, any rank may unlink it
    return s;
  }

  [[nodiscard]] shm_header& header() const noexcept { return *static_cast<shm_header*>(base_); }
  [[nodiscard]] shm_rank_slot& slot(int j) const noexcept {
    return reinterpret_cast<shm_rank_slot*>(at(layout_slots()))[j];
  }
  [[nodiscard]] std::byte* at(std::size_t offset) const noexcept { return static_cast<std::byte*>(base_) + offset; }
  [[nodiscard]] shm_layout const& layout() const noexcept { return layout_; }
  [[nodiscard]] std::string const& name() const noexcept { return name_; }
  [[nodiscard]] bool replaced_stale() const noexcept { return replaced_stale_; }

  /// Removes the name (idempotent); the mappings stay valid.
  void unlink() {
    if (unlinked_ || !owns_name_) return;
    unlinked_ = true;
    ::shm_unlink(name_.c_str());
  }
  /// Forgets the name without unlinking it (another rank does).
  void disown() noexcept { owns_name_ = false; }

  /// Takes rank `rank`'s liveness lock (see Liveness above); false where the system has none.
  [[nodiscard]] bool hold_liveness_lock(int rank) const noexcept {
#if defined(__linux__) && defined(F_OFD_SETLK)
    struct flock l = liveness_byte(rank);
    return ::fcntl(fd_, F_OFD_SETLK, &l) == 0;
#else
    (void)rank;
    return false;
#endif
  }
  /// Whether nothing holds rank `j`'s liveness lock any more (its process ended); false when
  /// unknown. Only for another rank's lock, taken with hold_liveness_lock.
  [[nodiscard]] bool liveness_lock_released(int j) const noexcept {
#if defined(__linux__) && defined(F_OFD_GETLK)
    struct flock l = liveness_byte(j);
    return ::fcntl(fd_, F_OFD_GETLK, &l) == 0 && l.l_type == F_UNLCK;
#else
    (void)j;
    return false;
#endif
  }

  /// Backs bytes [offset, offset + bytes) with memory now (fallocate): false when /dev/shm cannot
  /// hold them (or the system has no fallocate for it), instead of a SIGBUS when they are touched.
  [[nodiscard]] bool reserve(std::size_t offset, std::size_t bytes) const noexcept {
#if defined(__linux__)
    return bytes == 0 || (offset + bytes <= bytes_ &&
                          ::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes)) == 0);
#else
    (void)offset;
    return bytes == 0;
#endif
  }

 private:
  explicit shm_segment(std::string name) : name_(std::move(name)) {}

  [[nodiscard]] std::size_t layout_slots() const noexcept { return shm_layout::round(sizeof(shm_header)); }

  static struct flock liveness_byte(int rank) noexcept {
    struct flock l{};
    l.l_type = F_WRLCK;
    l.l_whence = SEEK_SET;
    l.l_start = static_cast<off_t>(rank);
    l.l_len = 1;
    return l;
  }

  // Backs everything but the group memory (header, slots, small slots, chunks, result: what every
  // collective touches) with memory now, so that a /dev/shm too small for it is an error here,
  // naming the bytes, instead of a SIGBUS in the first large collective. Group memory is reserved
  // when it is allocated (reserve()).
  void reserve_control(shm_layout const& layout) const {
#if defined(__linux__)
    std::size_t const need = layout.arena_at(0);
    int const rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(need));
    if (rc == 0) return;
    if (rc != ENOSPC && rc != EFBIG) fail("could not reserve " + std::to_string(need) + " bytes for shared-memory segment " + name_, rc);
    struct statvfs fs{};
    std::string const free_bytes = ::statvfs("/dev/shm", &fs) == 0
                                       ? std::to_string(static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize)
                                       : std::string("an unknown number of");
    throw comm_error(0, "dparallel: shm: /dev/shm cannot hold shared-memory segment " + name_ + ": a group of " +
                            std::to_string(layout.n) + " ranks needs " + std::to_string(need) +
                            " bytes there (header, control slots, and " + std::to_string(layout.n + 1) +
                            " chunks of shm::options::chunk_bytes = " + std::to_string(layout.chunk) +
                            "), and /dev/shm has " + free_bytes +
                            " bytes free. Enlarge /dev/shm (docker run --shm-size=1g, or remount it larger), run "
                            "fewer ranks or lower shm::options::chunk_bytes, or keep the data out of shared memory "
                            "(mpi::options::shared_memory = false under MPI)");
#else
    (void)layout;
#endif
  }

  [[noreturn]] static void fail(std::string const& what, int err) {
    throw comm_error(0, "dparallel: shm: " + what + ": " + std::system_category().message(err));
  }

  // Maps the segment, keeping `fd` for reserve() (closed with the mapping).
  void map(int fd) {
    fd_ = fd;
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) fail("could not map shared-memory segment " + name_, errno);
    base_ = p;
  }

  // `name` exists: a segment whose creator is gone is stale and removed; a live creator's is not ours.
  static void replace_stale(std::string const& name) {
    shm_creator const c = shm_creator_of(name);
    if (c.pid > 0 && !(c.pid == ::getpid() && c.pidns == pid_namespace_id()) && !c.gone()) {
      throw comm_error(0, "dparallel: shm: shared-memory segment " + name + " exists and its creator, process " +
                              std::to_string(c.pid) +
                              (c.pidns != pid_namespace_id() ? ", runs in another PID namespace (it cannot be checked)"
                                                             : ", is still running") +
                              ": another job uses the same job id; give this job another shm::options::job_id");
    }
    ::shm_unlink(name.c_str());  // stale: left by a job that crashed during its setup
  }

  std::string name_;
  void* base_ = nullptr;
  int fd_ = -1;
  std::size_t bytes_ = 0;
  shm_layout layout_{};
  bool owns_name_ = false;
  bool unlinked_ = false;
  bool replaced_stale_ = false;
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

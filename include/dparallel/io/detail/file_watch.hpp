#pragma once
// file_watch: an open descriptor of a file being read, kept to ask the kernel later whether the
// file was written since it was opened (a same-size rewrite in place changes no byte count and
// maybe no header, but always its modification time). A file replaced by a rename is another
// file: the descriptor keeps watching the one that was opened (whose change time moves when the
// rename unlinks it: so the change time is not compared). Timestamps have the file
// system's granularity (on Linux, the kernel's clock tick: a few milliseconds), so a rewrite that
// lands within the same tick as the open's last write is not told apart.

#include <dparallel/config.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#define DPARALLEL_FILE_WATCH 1
#else
#define DPARALLEL_FILE_WATCH 0
#endif

DPARALLEL_NAMESPACE_BEGIN

namespace detail {

/// What fstat says of a file that a write changes, and which file it is.
struct file_stamp {
  std::uint64_t device = 0, inode = 0, size = 0;
  std::int64_t modified_ns = 0;
  friend bool operator==(file_stamp const&, file_stamp const&) = default;
};

class file_watch {
 public:
  file_watch() = default;
  /// Opens `path` for watching; a file that cannot be opened is not watched (the reader's own
  /// open reports it).
  explicit file_watch(std::filesystem::path const& path) {
#if DPARALLEL_FILE_WATCH
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ >= 0 && !stamp(opened_)) close();
#else
    (void)path;
#endif
  }
  file_watch(file_watch&& o) noexcept : fd_(std::exchange(o.fd_, -1)), opened_(o.opened_) {}
  file_watch& operator=(file_watch&& o) noexcept {
    if (this != &o) {
      close();
      fd_ = std::exchange(o.fd_, -1);
      opened_ = o.opened_;
    }
    return *this;
  }
  file_watch(file_watch const&) = delete;
  file_watch& operator=(file_watch const&) = delete;
  ~file_watch() { close(); }

  /// Whether `path` names the watched file now (false when nothing is watched).
  [[nodiscard]] bool names(std::filesystem::path const& path) const {
#if DPARALLEL_FILE_WATCH
    struct ::stat s {};
    return fd_ >= 0 && ::stat(path.c_str(), &s) == 0 && static_cast<std::uint64_t>(s.st_dev) == opened_.device &&
           static_cast<std::uint64_t>(s.st_ino) == opened_.inode;
#else
    (void)path;
    return false;
#endif
  }

  /// What changed since the open ("" when nothing did, or nothing is watched).
  [[nodiscard]] std::string changes() const {
    file_stamp now;
    if (fd_ < 0 || !stamp(now) || now == opened_) return {};
    if (now.size != opened_.size)
      return "it had " + std::to_string(opened_.size) + " bytes, now " + std::to_string(now.size);
    return "it was written in place after it was opened: its modification time moved " +
           std::to_string(now.modified_ns - opened_.modified_ns) + " ns";
  }

 private:
  bool stamp(file_stamp& out) const {
#if DPARALLEL_FILE_WATCH
    struct ::stat s {};
    if (::fstat(fd_, &s) != 0) return false;
#if defined(__APPLE__)
    struct ::timespec const& t = s.st_mtimespec;
#else
    struct ::timespec const& t = s.st_mtim;
#endif
    out = {static_cast<std::uint64_t>(s.st_dev), static_cast<std::uint64_t>(s.st_ino),
           static_cast<std::uint64_t>(s.st_size), std::int64_t{t.tv_sec} * 1000000000 + t.tv_nsec};
    return true;
#else
    (void)out;
    return false;
#endif
  }
  void close() noexcept {
#if DPARALLEL_FILE_WATCH
    if (fd_ >= 0) ::close(fd_);
#endif
    fd_ = -1;
  }

  int fd_ = -1;
  file_stamp opened_{};
};

}  // namespace detail

DPARALLEL_NAMESPACE_END

#pragma once
// Atomic file replacement: the content goes to a temporary file in the target's directory, is
// flushed and synced to disk, and only then renamed over the target. A failure at any point
// (an exception from the writer, a full disk, an unwritable directory) leaves the previous file
// as it was and removes the temporary file.
//
// The temporary is named ".<target name>.tmp-<host>-<pid>-<n>". A process killed while writing
// cannot remove it; the next write of the same target does: it removes every temporary of that
// target made on this host by a process that no longer exists (a live writer's, another host's
// and other targets' temporaries are left alone). The replaced file keeps its permission bits
// and, where the process may set them, its owner and group; a new file gets 0666 minus the umask.
//
//   dparallel::detail::write_file_atomically("weights.safetensors", [&](dparallel::detail::file_sink& out) {
//     out.write(header.data(), header.size());
//     out.write(tensor.data(), tensor.size_bytes());
//   });

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#define DPARALLEL_IO_POSIX 1
#else
#define DPARALLEL_IO_POSIX 0
#endif

DPARALLEL_NAMESPACE_BEGIN

namespace detail {

inline std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

/// Where write_file_atomically's writer puts the bytes (a buffered temporary file).
class file_sink {
 public:
  file_sink(std::FILE* f, std::string where) : f_(f), where_(std::move(where)) {}
  file_sink(file_sink const&) = delete;
  file_sink& operator=(file_sink const&) = delete;

  /// Appends `n` bytes; throws dparallel::error when the write fails (disk full, quota, ...).
  void write(void const* data, std::size_t n) {
    if (n == 0) return;
    errno = 0;
    if (std::fwrite(data, 1, n, f_) != n) {
      int const e = errno;
      throw error("dparallel: could not write " + where_ + ": " + (e != 0 ? errno_text(e) : "short write") +
                  "; the previous file, if any, is unchanged");
    }
    written_ += n;
  }
  /// Bytes written so far.
  [[nodiscard]] std::uint64_t written() const noexcept { return written_; }

 private:
  std::FILE* f_;
  std::string where_;
  std::uint64_t written_ = 0;
};

/// This host's name, as temporary names carry it ("host" when it cannot be read); characters other
/// than letters, digits, '.' and '_' become '_'.
inline std::string host_tag() {
  std::string h = "host";
#if DPARALLEL_IO_POSIX
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) == 0 && buf[0] != '\0') h = buf;
#endif
  for (char& c : h)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_')) c = '_';
  return h;
}

/// The prefix of every temporary name of `target` made on this host: ".<name>.tmp-<host>-".
inline std::string temporary_prefix(std::filesystem::path const& target) {
  return "." + target.filename().string() + ".tmp-" + host_tag() + "-";
}

/// A temporary name next to `target`, unique within this process and across processes and hosts.
inline std::filesystem::path temporary_sibling(std::filesystem::path const& target) {
  static std::atomic<std::uint64_t> counter{0};
  std::string name = temporary_prefix(target);
#if DPARALLEL_IO_POSIX
  name += std::to_string(static_cast<long long>(::getpid())) + "-";
#endif
  name += std::to_string(counter.fetch_add(1));
  return target.parent_path() / name;
}

/// Removes the temporaries of `target` left on this host by writers that no longer exist (a
/// process killed during a write). Best effort: errors are ignored.
inline void remove_stale_temporaries(std::filesystem::path const& target) {
#if DPARALLEL_IO_POSIX
  std::string const prefix = temporary_prefix(target);
  std::filesystem::path const dir = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (dirent const* e = ::readdir(d)) {
    std::string_view const name = e->d_name;
    if (!name.starts_with(prefix)) continue;
    std::string_view rest = name.substr(prefix.size());  // "<pid>-<n>"
    std::size_t const dash = rest.find('-');
    if (dash == 0 || dash == std::string_view::npos || dash > 9) continue;
    long long pid = 0;
    bool digits = true;
    for (char c : rest.substr(0, dash)) {
      digits = digits && c >= '0' && c <= '9';
      pid = pid * 10 + (c - '0');
    }
    for (char c : rest.substr(dash + 1)) digits = digits && c >= '0' && c <= '9';
    if (!digits || dash + 1 == rest.size() || pid <= 0 || pid == ::getpid()) continue;
    // kill(pid, 0) fails with ESRCH only when no such process exists (EPERM: it exists).
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) stale.emplace_back(name);
  }
  ::closedir(d);
  for (auto const& name : stale) {
    std::error_code ignored;
    std::filesystem::remove(dir / name, ignored);
  }
#else
  (void)target;
#endif
}

/// Makes the changes of the directory entries beside `target` (a rename) durable. Best effort:
/// some file systems refuse to sync a directory.
inline void sync_directory_of(std::filesystem::path const& target) {
#if DPARALLEL_IO_POSIX
  std::filesystem::path const dir = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  int const dfd = ::open(dir.c_str(), O_RDONLY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
#else
  (void)target;
#endif
}

/// Writes a file atomically: `writer` fills a temporary file in the same directory, which is
/// flushed, synced (fsync) and renamed over `target`; on POSIX the directory is synced too, so the
/// rename survives a crash. Throws dparallel::error naming the file and the cause; whatever
/// happens, `target` holds either its previous content or the complete new one, and no temporary
/// file is left behind.
inline void write_file_atomically(std::filesystem::path const& target, std::function<void(file_sink&)> const& writer) {
  if (target.empty() || !target.has_filename())
    throw invalid_argument("dparallel: expected a file name to write, found '" + target.string() + "'");
  std::filesystem::path const tmp = temporary_sibling(target);
  std::string const where = "'" + target.string() + "' (through the temporary file '" + tmp.string() + "')";

  remove_stale_temporaries(target);
  std::FILE* f = nullptr;
#if DPARALLEL_IO_POSIX
  // The replaced file's mode and owner carry over (a file the user made 0600 stays 0600); a new
  // file gets 0666 minus the umask, as any file the process creates.
  struct ::stat old {};
  bool const replacing = ::stat(target.c_str(), &old) == 0 && S_ISREG(old.st_mode);
  int const fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, replacing ? 0600 : 0666);
  if (fd < 0) {
    int const e = errno;
    throw error("dparallel: could not create a temporary file to write '" + target.string() + "': " + errno_text(e) +
                "; check that the directory '" + target.parent_path().string() + "' exists and is writable");
  }
  if (replacing) {
    // Owner first (it may clear set-id bits), then the mode; both best effort: an unprivileged
    // process cannot give a file away, and then the new file is its own.
    // (glibc marks fchown warn_unused_result, which a cast to void does not silence in GCC.)
    if (::fchown(fd, old.st_uid, old.st_gid) != 0 && ::fchown(fd, static_cast<uid_t>(-1), old.st_gid) != 0) {
      // neither: the new file keeps this process's owner and group
    }
    (void)::fchmod(fd, old.st_mode & 07777);
  }
  f = ::fdopen(fd, "wb");
  if (f == nullptr) {
    int const e = errno;
    ::close(fd);
    std::remove(tmp.string().c_str());
    throw error("dparallel: could not open " + where + ": " + errno_text(e));
  }
#else
  f = std::fopen(tmp.string().c_str(), "wb");
  if (f == nullptr) {
    int const e = errno;
    throw error("dparallel: could not create a temporary file to write '" + target.string() + "': " + errno_text(e) +
                "; check that the directory '" + target.parent_path().string() + "' exists and is writable");
  }
#endif

  try {
    file_sink sink(f, where);
    writer(sink);
    errno = 0;
    if (std::fflush(f) != 0) {
      int const e = errno;
      throw error("dparallel: could not write " + where + ": " + errno_text(e) + "; the previous file is unchanged");
    }
#if DPARALLEL_IO_POSIX
    if (::fsync(::fileno(f)) != 0) {
      int const e = errno;
      throw error("dparallel: could not sync " + where + " to disk: " + errno_text(e) +
                  "; the previous file is unchanged");
    }
#endif
    std::FILE* const closing = f;
    f = nullptr;
    if (std::fclose(closing) != 0) {
      int const e = errno;
      throw error("dparallel: could not close " + where + ": " + errno_text(e) + "; the previous file is unchanged");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, target, ec);
    if (ec)
      throw error("dparallel: could not rename the temporary file '" + tmp.string() + "' to '" + target.string() +
                  "': " + ec.message() + "; the previous file is unchanged");
  } catch (...) {
    if (f != nullptr) std::fclose(f);
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw;
  }

  sync_directory_of(target);  // the rename itself durable
}

}  // namespace detail

DPARALLEL_NAMESPACE_END

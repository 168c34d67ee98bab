#pragma once
// Atomic file replacement: the content goes to a temporary file in the target's directory, is
// flushed and synced to disk, and only then renamed over the target. A failure at any point
// (an exception from the writer, a full disk, an unwritable directory) leaves the previous file
// as it was and removes the temporary file.
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
#include <utility>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
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

/// A temporary name next to `target`, unique within this process and across processes.
inline std::filesystem::path temporary_sibling(std::filesystem::path const& target) {
  static std::atomic<std::uint64_t> counter{0};
  std::string name = "." + target.filename().string() + ".tmp-";
#if DPARALLEL_IO_POSIX
  name += std::to_string(static_cast<long long>(::getpid())) + "-";
#endif
  name += std::to_string(counter.fetch_add(1));
  return target.parent_path() / name;
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

  std::FILE* f = nullptr;
#if DPARALLEL_IO_POSIX
  int const fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    int const e = errno;
    throw error("dparallel: could not create a temporary file to write '" + target.string() + "': " + errno_text(e) +
                "; check that the directory '" + target.parent_path().string() + "' exists and is writable");
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

#if DPARALLEL_IO_POSIX
  // Make the rename itself durable. Best effort: some file systems refuse to sync a directory.
  std::filesystem::path const dir = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  int const dfd = ::open(dir.c_str(), O_RDONLY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
#endif
}

}  // namespace detail

DPARALLEL_NAMESPACE_END

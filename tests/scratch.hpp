#pragma once
// Scratch directories for tests that write files: one per process under the system's temporary
// directory (named after the test program), removed at exit; scratch(name) is a fresh, empty one.
#include <filesystem>
#include <string>
#include <system_error>

#include <unistd.h>

namespace test {

inline std::filesystem::path const& scratch_root(char const* program) {
  struct root {
    std::filesystem::path path;
    ~root() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static root const r{std::filesystem::temp_directory_path() /
                      (std::string("dparallel_") + program + "_" + std::to_string(::getpid()))};
  return r.path;
}

/// A fresh, empty directory `name` under this program's scratch root.
inline std::filesystem::path scratch_dir(char const* program, std::string const& name) {
  std::filesystem::path const dir = scratch_root(program) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace test

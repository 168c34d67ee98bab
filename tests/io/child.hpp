#pragma once
// Running a piece of a test in a forked child (for resource limits that must not touch the test
// process) and classifying how a call ended.
#include <dparallel/core/error.hpp>

#include <exception>
#include <functional>
#include <string>
#include <string_view>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace test {

/// How `f` ended: 0 normally, 1 a dparallel::error whose message contains `expected`, 2 another
/// dparallel::error, 3 any other exception.
inline int outcome(std::function<void()> const& f, std::string_view expected) {
  try {
    f();
  } catch (dparallel::error const& e) {
    return std::string_view(e.what()).find(expected) != std::string_view::npos ? 1 : 2;
  } catch (...) {
    return 3;
  }
  return 0;
}

/// Runs `body` in a forked child and returns the child's exit status (what `body` returned), or
/// -1 when the child could not start or did not exit normally.
inline int in_child(std::function<int()> const& body) {
  pid_t const child = ::fork();
  if (child < 0) return -1;
  if (child == 0) ::_exit(body());
  int status = 0;
  if (::waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

}  // namespace test

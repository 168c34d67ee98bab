#pragma once
// Forked ranks for tests of process groups on one node (test_shm, test_shm_subgroups): run_ranks
// forks one process per rank with a pipe bootstrap from rank 0, and collects what each reported;
// require_no_segments_of checks that /dev/shm holds no segment those processes created; free_port
// finds a port for a TCP rendezvous.
#include <dparallel/comm/shm.hpp>
#include <dparallel/core/error.hpp>

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace dpl = dparallel;

namespace {

// --- processes ------------------------------------------------------------------------------

/// What one forked rank reported: its text, and how it ended.
struct rank_result {
  std::string text;
  int exit_code = -1;  // 128 + signal when killed
};

/// A rank's body: its rank and the bootstrap (pipes from rank 0) -> its report.
using rank_fn = std::function<std::string(int rank, dpl::shm::bootstrap_fn const& share)>;

void write_all(int fd, void const* p, std::size_t n) {
  auto const* b = static_cast<char const*>(p);
  while (n != 0) {
    ssize_t const k = ::write(fd, b, n);
    if (k <= 0) return;
    b += k;
    n -= static_cast<std::size_t>(k);
  }
}
bool read_all(int fd, void* p, std::size_t n) {
  auto* b = static_cast<char*>(p);
  while (n != 0) {
    ssize_t const k = ::read(fd, b, n);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

/// Forks `n` processes, rank r running fn(r, share) where share carries rank 0's bytes through
/// pipes; returns each rank's report once all ended, and their process ids in `pids`.
std::vector<rank_result> run_ranks(int n, rank_fn const& fn, std::vector<pid_t>* pids = nullptr) {
  auto const un = static_cast<std::size_t>(n);
  std::vector<std::array<int, 2>> boot(un), out(un);
  for (std::size_t j = 0; j < un; ++j) {
    REQUIRE(::pipe(boot[j].data()) == 0);
    REQUIRE(::pipe(out[j].data()) == 0);
  }
  std::vector<pid_t> children;
  std::fflush(nullptr);  // what the test wrote is not written again by each child
  for (int r = 0; r < n; ++r) {
    pid_t const pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      auto const ur = static_cast<std::size_t>(r);
      for (std::size_t j = 0; j < un; ++j) {
        ::close(out[j][0]);
        if (j != ur) ::close(out[j][1]);
        if (j != ur || r == 0) ::close(boot[j][0]);
        if (r != 0) ::close(boot[j][1]);  // rank 0 alone writes: a dead rank 0 means EOF
      }
      dpl::shm::bootstrap_fn const share = [&](std::span<std::byte const> mine) {
        if (r == 0) {
          auto const len = static_cast<std::uint64_t>(mine.size());
          for (std::size_t j = 1; j < un; ++j) {
            write_all(boot[j][1], &len, sizeof len);
            write_all(boot[j][1], mine.data(), mine.size());
          }
          return std::vector<std::byte>(mine.begin(), mine.end());
        }
        std::uint64_t len = 0;
        if (!read_all(boot[ur][0], &len, sizeof len)) throw dpl::comm_error(0, "test bootstrap: rank 0 is gone");
        std::vector<std::byte> b(len);
        if (!read_all(boot[ur][0], b.data(), b.size())) throw dpl::comm_error(0, "test bootstrap: rank 0 is gone");
        return b;
      };
      std::string text;
      int code = 0;
      try {
        text = fn(r, share);
      } catch (dpl::timeout_error const& e) {
        text = "EXC timeout_error " + std::to_string(e.rank()) + ": " + e.what();
        code = 1;
      } catch (dpl::comm_error const& e) {
        text = "EXC comm_error " + std::to_string(e.rank()) + ": " + e.what();
        code = 1;
      } catch (std::exception const& e) {
        text = std::string("EXC other -1: ") + e.what();
        code = 1;
      }
      write_all(out[ur][1], text.data(), text.size());
      ::close(out[ur][1]);
      ::_exit(code);
    }
    children.push_back(pid);
  }
  for (std::size_t j = 0; j < un; ++j) {
    ::close(boot[j][0]);
    ::close(boot[j][1]);
    ::close(out[j][1]);
  }
  std::vector<rank_result> results(un);
  for (std::size_t j = 0; j < un; ++j) {
    char buf[4096];
    for (;;) {
      ssize_t const k = ::read(out[j][0], buf, sizeof buf);
      if (k <= 0) break;
      results[j].text.append(buf, static_cast<std::size_t>(k));
    }
    ::close(out[j][0]);
    int status = 0;
    ::waitpid(children[j], &status, 0);
    results[j].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  }
  if (pids != nullptr) *pids = children;
  return results;
}

/// A TCP port on the loopback interface that was free a moment ago (for a rendezvous).
[[maybe_unused]] int free_port() {
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// The shared-memory objects in /dev/shm whose name starts with `prefix`.
std::set<std::string> shm_objects(std::string const& prefix) {
  std::set<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      std::string const name = e->d_name;
      if (name.rfind(prefix, 0) == 0) names.insert(name);
    }
    ::closedir(d);
  }
  return names;
}

/// No segment made by any of `pids` (rank 0 puts its process id in the name) is left in /dev/shm.
void require_no_segments_of(std::vector<pid_t> const& pids) {
  for (pid_t p : pids) {
    INFO("segments of process " << p);
    CHECK(shm_objects("dparallel-" + std::to_string(p) + "-").empty());
  }
}

}  // namespace

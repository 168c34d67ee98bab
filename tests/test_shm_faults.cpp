// Faults of the shared-memory engine between real processes (fork), most of which need a changed
// system: a /dev/shm too small for the segment (a 1 MiB tmpfs mounted in a mount namespace of the
// test's own), a rank in another PID namespace (ranks of containers that share /dev/shm but not
// their process ids), a rank that destroyed its group while its peer waits, and ranks that come
// late (the "still waiting" lines). The namespace cases need root (CAP_SYS_ADMIN); where unshare
// is refused they say so and check nothing.
#include "fork_ranks.hpp"

#include <dparallel/comm/shm.hpp>
#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <regex>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

/// Runs `fn` in a forked child and returns what it returned (or "EXC <what>" / "CRASH").
std::string in_child(std::function<std::string()> const& fn) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t const pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(p[0]);
    std::string text;
    try {
      text = fn();
    } catch (std::exception const& e) {
      text = std::string("EXC ") + e.what();
    } catch (...) {
      text = "EXC (not a std::exception)";
    }
    write_all(p[1], text.data(), text.size());
    ::close(p[1]);
    ::_exit(0);
  }
  ::close(p[1]);
  std::string text;
  char buf[4096];
  for (;;) {
    ssize_t const k = ::read(p[0], buf, sizeof buf);
    if (k <= 0) break;
    text.append(buf, static_cast<std::size_t>(k));
  }
  ::close(p[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status)) text += "CRASH signal " + std::to_string(WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  return text;
}

/// In a private mount namespace with a `size` tmpfs on /dev/shm: two ranks make a group and
/// all-reduce 4 MiB (the chunked path); each rank's exit code and report, and what /dev/shm holds
/// after them. "SKIP ..." where the namespace cannot be made.
std::string small_shm_run(char const* size) {
  return in_child([size]() -> std::string {
    if (::unshare(CLONE_NEWNS) != 0) return std::string("SKIP unshare(CLONE_NEWNS): ") + std::strerror(errno);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", "/dev/shm", "tmpfs", 0, (std::string("size=") + size).c_str()) != 0)
      return std::string("SKIP mount tmpfs: ") + std::strerror(errno);
    auto const got = run_ranks(2, [](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
      auto const g = dpl::shm::make_group(rank, 2, share, 10s);
      std::vector<float> v(std::size_t{1} << 20, 1.0f);
      g.all_reduce(dpl::view(v)).wait();
      return "finished, sum " + std::to_string(v[0]);
    });
    std::string out;
    for (auto const& r : got) out += std::to_string(r.exit_code) + "\t" + r.text + "\n";
    return out + "left in /dev/shm: " + std::to_string(shm_objects("").size() - shm_objects(".").size());
  });
}

}  // namespace

TEST_CASE("shm fault: a /dev/shm too small for the segment is an error on every rank, naming the bytes; no SIGBUS",
          "[shm][fault]") {
  std::string const small = small_shm_run("1m");
  if (small.rfind("SKIP", 0) == 0) {
    WARN("not checked: " << small);
    return;
  }
  INFO(small);
  // Both ranks end by the error (exit code 1, no 128 + SIGBUS), saying what is needed and free and the fixes.
  CHECK_THAT(small, Catch::StartsWith("1\tEXC comm_error 0: dparallel: shm: /dev/shm cannot hold shared-memory segment"));
  CHECK_THAT(small, Catch::Contains("\n1\tEXC comm_error 0: dparallel: shm::make_group on rank 1: rank 0 could not set "
                                    "up the shared-memory group: dparallel: shm: /dev/shm cannot hold"));
  CHECK(std::regex_search(small, std::regex("a group of 2 ranks needs [0-9]{8} bytes there")));
  CHECK(std::regex_search(small, std::regex("/dev/shm has [0-9]{5,7} bytes free")));
  CHECK_THAT(small, Catch::Contains("--shm-size") && Catch::Contains("fewer ranks") &&
                        Catch::Contains("shared_memory = false"));
  CHECK_THAT(small, Catch::EndsWith("left in /dev/shm: 0"));  // the segment was removed
  // The same group in a /dev/shm that holds it works: the error above is the size, nothing else.
  std::string const large = small_shm_run("32m");
  INFO(large);
  CHECK(large == "0\tfinished, sum 2.000000\n0\tfinished, sum 2.000000\nleft in /dev/shm: 0");
}

TEST_CASE("shm fault: a rank in another PID namespace is not taken for dead", "[shm][fault]") {
  // Rank 1 runs in a PID namespace of its own (as in a container sharing /dev/shm with --ipc=host):
  // rank 0's process id means nothing there, so probing it would report rank 0 dead.
  auto const body = [](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
    auto const g = dpl::shm::make_group(rank, 2, share, 20s);
    std::vector<double> v{1.0};
    for (int k = 0; k < 4; ++k) {
      if (rank == 0) std::this_thread::sleep_for(50ms);  // rank 1 waits, probing its peer's process
      g.all_reduce(dpl::view(v)).wait();
    }
    return "sum " + std::to_string(v[0]);
  };
  auto const got = run_ranks(2, [&](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
    if (rank == 0) return body(rank, share);
    if (::unshare(CLONE_NEWPID) != 0) {
      (void)share({});  // rank 0 waits for its bootstrap
      return std::string("SKIP unshare(CLONE_NEWPID): ") + std::strerror(errno);
    }
    return in_child([&] { return std::to_string(::getpid()) + " " + body(rank, share); });  // pid 1 there
  });
  if (got[1].text.rfind("SKIP", 0) == 0) {
    WARN("not checked: " << got[1].text);
    return;
  }
  INFO("rank 0: " << got[0].text << "\nrank 1: " << got[1].text);
  CHECK(got[0].text == "sum 16.000000");
  CHECK(got[1].text == "1 sum 16.000000");
}

TEST_CASE("shm fault: a rank of another PID namespace killed with -9 is named at once, not at the timeout",
          "[shm][fault]") {
  // Rank 1 runs in a PID namespace of its own and dies (SIGKILL) after its first collective: rank
  // 0 cannot probe its process id, and finds it gone by its liveness lock instead.
  auto const t0 = std::chrono::steady_clock::now();
  auto const got = run_ranks(2, [&](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
    if (rank == 0) {
      auto const g = dpl::shm::make_group(rank, 2, share, 60s);
      std::vector<double> v{1.0};
      g.all_reduce(dpl::view(v)).wait();
      g.all_reduce(dpl::view(v)).wait();  // rank 1 is dead by now
      return "no error";
    }
    if (::unshare(CLONE_NEWPID) != 0) {
      (void)share({});
      return std::string("SKIP unshare(CLONE_NEWPID): ") + std::strerror(errno);
    }
    // The namespace's first process (its init, which ignores SIGKILL from inside) forks the rank.
    return in_child([&] {
      return in_child([&]() -> std::string {
        auto const g = dpl::shm::make_group(rank, 2, share, 60s);
        std::vector<double> v{1.0};
        g.all_reduce(dpl::view(v)).wait();
        ::raise(SIGKILL);
        return "survived";
      });
    });
  });
  auto const elapsed = std::chrono::steady_clock::now() - t0;
  if (got[1].text.rfind("SKIP", 0) == 0) {
    WARN("not checked: " << got[1].text);
    return;
  }
  INFO("rank 0: " << got[0].text << "\nrank 1: " << got[1].text);
  // The process id inside the new namespace depends on what the namespace's init forked before.
  CHECK_THAT(got[0].text,
             Catch::StartsWith("EXC comm_error 1:") &&
                 Catch::Matches(".*rank 1 \\(process [0-9]+ of another PID namespace\\) died or exited.*"));
  CHECK(elapsed < 20s);  // the timeout is 60 s
}

TEST_CASE("shm fault: a rank that destroyed its group is named at once, as a comm_error", "[shm][fault]") {
  auto const t0 = std::chrono::steady_clock::now();
  std::vector<pid_t> pids;
  auto const got = run_ranks(2, [](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
    auto g = dpl::shm::make_group(rank, 2, share, 30s);
    std::vector<float> v(10, 1.0f);
    g.all_reduce(dpl::view(v)).wait();
    if (rank == 1) return "closed";  // destroys its group after one collective
    g.all_reduce(dpl::view(v)).wait();
    return "finished without error";
  }, &pids);
  auto const elapsed = std::chrono::steady_clock::now() - t0;
  INFO(got[0].text);
  CHECK(got[1].text == "closed");
  CHECK_THAT(got[0].text, Catch::StartsWith("EXC comm_error 1:") &&
                              Catch::Contains("rank 1 finished (its process_group was destroyed or closed) after "
                                              "issuing 1 collective, so it will never call collective #2"));
  CHECK(elapsed < 10s);  // the timeout is 30 s: the closed rank was seen, not waited out
  require_no_segments_of(pids);
}

TEST_CASE("shm and the TCP rendezvous say which rank they still wait for after about 10 s, well before the timeout",
          "[shm][rendezvous][fault]") {
  // Six forked ranks run three jobs at once, each with one rank 11 s late: the shared-memory
  // group (ranks 0, 1: rank 1 maps the segment late), a rendezvous whose rank 1 comes late (ranks
  // 2, 3: rank 0 of that job says so) and one whose rank 0 comes late (ranks 4, 5: its peer says
  // so). Each job still forms its group; a rank reports what it wrote to stderr.
  int const port_a = free_port(), port_b = free_port();
  auto const t0 = std::chrono::steady_clock::now();
  auto const got = run_ranks(6, [&](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
    std::FILE* err = std::tmpfile();
    REQUIRE(err != nullptr);
    ::dup2(::fileno(err), 2);
    int size = 0;
    if (rank < 2) {
      dpl::shm::bootstrap_fn const late = [&](std::span<std::byte const> mine) {
        auto got_name = share(mine);
        if (rank == 1) std::this_thread::sleep_for(11s);
        return got_name;
      };
      size = dpl::shm::make_group(rank, 2, late, 60s).size();
    } else {
      int const job_rank = rank % 2;
      bool const late = (rank < 4) == (job_rank == 1);  // job A: its rank 1 is late; job B: its rank 0
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(rank < 4 ? port_a : port_b).c_str(), 1);
      ::setenv("RANK", std::to_string(job_rank).c_str(), 1);
      ::setenv("WORLD_SIZE", "2", 1);
      ::setenv("LOCAL_RANK", std::to_string(job_rank).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", "2", 1);
      if (late) std::this_thread::sleep_for(11s);
      size = dpl::shm::init_process_group({.timeout = 60s}).size();
    }
    std::fflush(stderr);
    std::string text = "size " + std::to_string(size) + "\n";
    std::rewind(err);
    for (int c; (c = std::fgetc(err)) != EOF;) text += static_cast<char>(c);
    return text;
  });
  auto const elapsed = std::chrono::steady_clock::now() - t0;
  for (std::size_t r = 0; r < 6; ++r) {
    INFO("rank " << r << ": " << got[r].text);
    CHECK(got[r].exit_code == 0);
    CHECK_THAT(got[r].text, Catch::StartsWith("size 2"));
  }
  CHECK_THAT(got[0].text, Catch::Contains("shm: rank 0 is still waiting for rank 1 to map shared-memory segment") &&
                              Catch::Contains("s left of the timeout"));
  CHECK_THAT(got[2].text, Catch::Contains("tcp_rendezvous on rank 0 at") && Catch::Contains("still waiting for rank 1"));
  CHECK_THAT(got[5].text, Catch::Contains("tcp_rendezvous on rank 1: still waiting for rank 0 at"));
  for (std::size_t r : {1, 3, 4}) CHECK(got[r].text.find("still waiting") == std::string::npos);  // the late ones
  CHECK(elapsed < 30s);
}

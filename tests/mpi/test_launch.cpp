// Process-group setup without MPI: reading the launcher's environment (init_process_group's order
// and errors), the TCP rendezvous between real local processes (fork) and the NCCL unique-id
// bootstrap over it. Desync detection is test_desync's.
#include "../models.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/comm/nccl_bootstrap.hpp>
#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/comm/rendezvous.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace dpl = dparallel;

namespace {

dpl::environment env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string const& name) -> std::optional<std::string> {
    auto const it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

/// The message of the invalid_argument that resolve_launch throws (fails the test when none).
std::string launch_error(std::map<std::string, std::string> vars, dpl::init_options opts = {},
                         std::optional<dpl::launch_fallback> fallback = std::nullopt) {
  try {
    dpl::resolve_launch(opts, env_of(std::move(vars)), fallback);
  } catch (dpl::invalid_argument const& e) {
    return e.what();
  }
  FAIL("expected resolve_launch to throw invalid_argument");
  return {};
}

// --- processes ------------------------------------------------------------------------------

/// A forked process running f(); what f returns (or "EXC <type> <rank>: <what>" when it throws
/// a dparallel error) comes back through a pipe.
class child_process {
 public:
  explicit child_process(std::function<std::string()> f) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::close(fds[0]);
      std::string out;
      int code = 0;
      try {
        out = f();
      } catch (dpl::timeout_error const& e) {
        out = "EXC timeout_error " + std::to_string(e.rank()) + ": " + e.what();
        code = 1;
      } catch (dpl::comm_error const& e) {
        out = "EXC comm_error " + std::to_string(e.rank()) + ": " + e.what();
        code = 1;
      } catch (std::exception const& e) {
        out = std::string("EXC other -1: ") + e.what();
        code = 1;
      }
      std::size_t off = 0;
      while (off < out.size()) {
        ssize_t const k = ::write(fds[1], out.data() + off, out.size() - off);
        if (k <= 0) break;
        off += static_cast<std::size_t>(k);
      }
      ::close(fds[1]);
      ::_exit(code);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  child_process(child_process const&) = delete;
  child_process& operator=(child_process const&) = delete;
  ~child_process() {
    if (pid_ > 0) join();
  }

  /// Waits for the child; returns what it reported.
  std::string join() {
    std::string out;
    char buf[4096];
    for (;;) {
      ssize_t const k = ::read(fd_, buf, sizeof buf);
      if (k <= 0) break;
      out.append(buf, static_cast<std::size_t>(k));
    }
    ::close(fd_);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    return out;
  }
  [[nodiscard]] int exit_code() const noexcept { return exit_code_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  int exit_code_ = -1;
};

/// A TCP port on 127.0.0.1 that was free a moment ago.
int free_port() {
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::vector<std::byte> bytes_of(std::string const& s) {
  std::vector<std::byte> out;
  for (char c : s) out.push_back(static_cast<std::byte>(c));
  return out;
}
std::string text_of(std::span<std::byte const> b) {
  std::string s;
  for (std::byte x : b) s += static_cast<char>(x);
  return s;
}

/// 128 pseudo-random bytes standing in for an ncclUniqueId.
std::vector<std::byte> fake_unique_id(std::uint64_t seed) {
  test::rng g{seed};
  std::vector<std::byte> id(dpl::nccl_unique_id_bytes);
  for (auto& b : id) b = static_cast<std::byte>(g.next() & 0xff);
  return id;
}

std::string hex(std::span<std::byte const> b) {
  static char const digits[] = "0123456789abcdef";
  std::string s;
  for (std::byte x : b) {
    s += digits[static_cast<unsigned>(x) >> 4];
    s += digits[static_cast<unsigned>(x) & 15];
  }
  return s;
}

}  // namespace

// =================================================================================================
// init_process_group: where the rank comes from

TEST_CASE("launch: torchrun-style variables give rank, world size, local rank and master", "[launch]") {
  auto const info = dpl::resolve_launch({}, env_of({{"RANK", "3"},
                                                    {"WORLD_SIZE", "8"},
                                                    {"LOCAL_RANK", "1"},
                                                    {"LOCAL_WORLD_SIZE", "2"},
                                                    {"MASTER_ADDR", "node0"},
                                                    {"MASTER_PORT", "29500"}}));
  CHECK(info.rank == 3);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 2);
  CHECK(info.master_addr == "node0");
  CHECK(info.master_port == 29500);
  CHECK_THAT(info.source, Catch::Contains("RANK=3") && Catch::Contains("WORLD_SIZE=8"));
}

TEST_CASE("launch: the order is arguments, torchrun, Open MPI, Slurm, then the engine", "[launch]") {
  std::map<std::string, std::string> const all{{"RANK", "1"},
                                               {"WORLD_SIZE", "4"},
                                               {"LOCAL_RANK", "1"},
                                               {"LOCAL_WORLD_SIZE", "4"},
                                               {"OMPI_COMM_WORLD_RANK", "2"},
                                               {"OMPI_COMM_WORLD_SIZE", "6"},
                                               {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                                               {"SLURM_PROCID", "5"},
                                               {"SLURM_NTASKS", "7"},
                                               {"SLURM_LOCALID", "0"},
                                               {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                                               {"SLURM_NODEID", "3"}};
  auto without = [&](std::vector<std::string> const& drop) {
    auto m = all;
    for (auto const& d : drop) m.erase(d);
    return env_of(m);
  };
  auto info = dpl::resolve_launch({}, env_of(all));
  CHECK((info.rank == 1 && info.world_size == 4 && info.local_rank == 1 && info.local_world_size == 4));
  info = dpl::resolve_launch({.rank = 0, .world_size = 2, .local_rank = 0, .local_world_size = 1}, env_of(all));
  CHECK((info.rank == 0 && info.world_size == 2 && info.local_rank == 0 && info.local_world_size == 1));
  CHECK(info.source == "arguments");
  info = dpl::resolve_launch({}, without({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}));
  CHECK((info.rank == 2 && info.world_size == 6 && info.local_rank == 0 && info.local_world_size == 3));
  info = dpl::resolve_launch({}, without({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                          "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                          "OMPI_COMM_WORLD_LOCAL_SIZE"}));
  // Slurm: node 3 of "2(x3),1" runs 1 task.
  CHECK((info.rank == 5 && info.world_size == 7 && info.local_rank == 0 && info.local_world_size == 1));
  info = dpl::resolve_launch({}, env_of({}), dpl::launch_fallback{1, 2, 1, 2, "MPI_COMM_WORLD", true});
  CHECK((info.rank == 1 && info.world_size == 2 && info.local_rank == 1 && info.local_world_size == 2));
  CHECK(info.source == "MPI_COMM_WORLD");
  // An explicit rank overrides the launcher's one value.
  info = dpl::resolve_launch({.rank = 3}, env_of(all));
  CHECK((info.rank == 3 && info.world_size == 4));
}

TEST_CASE("launch: missing, malformed and inconsistent values name the variable", "[launch]") {
  CHECK_THAT(launch_error({{"RANK", "1"}}),
             Catch::Contains("found RANK=1") && Catch::Contains("but no WORLD_SIZE"));
  CHECK_THAT(launch_error({{"OMPI_COMM_WORLD_SIZE", "2"}}),
             Catch::Contains("OMPI_COMM_WORLD_SIZE=2") && Catch::Contains("no OMPI_COMM_WORLD_RANK"));
  CHECK_THAT(launch_error({{"RANK", "one"}, {"WORLD_SIZE", "2"}}),
             Catch::Contains("RANK (torchrun-style environment)") && Catch::Contains("'one'"));
  CHECK_THAT(launch_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}),
             Catch::Contains("rank to be in [0, world size)") && Catch::Contains("RANK=2") &&
                 Catch::Contains("WORLD_SIZE=2"));
  CHECK_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), Catch::Contains("WORLD_SIZE") && Catch::Contains("found 0"));
  CHECK_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
             Catch::Contains("local rank to be in [0, local world size 2)") && Catch::Contains("found 2"));
  CHECK_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}}),
             Catch::Contains("no local world size") && Catch::Contains("LOCAL_WORLD_SIZE"));
  CHECK_THAT(launch_error({}), Catch::Contains("found no world size") && Catch::Contains("WORLD_SIZE") &&
                                   Catch::Contains("OMPI_COMM_WORLD_SIZE") && Catch::Contains("SLURM_NTASKS"));
  CHECK_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29x00"}}),
             Catch::Contains("MASTER_PORT") && Catch::Contains("'29x00'"));
  CHECK_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
             Catch::Contains("MASTER_PORT") && Catch::Contains("[1, 65535]") && Catch::Contains("70000"));
  CHECK_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}}), Catch::Contains("MASTER_ADDR"));
  CHECK_THAT(launch_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                           {"SLURM_TASKS_PER_NODE", "2(y3)"}, {"SLURM_NODEID", "0"}}),
             Catch::Contains("SLURM_TASKS_PER_NODE") && Catch::Contains("'2(y3)'"));
  // MPI knows its rank: a launcher that disagrees is an error naming both.
  CHECK_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, {}, dpl::launch_fallback{1, 2, {}, {}, "MPI_COMM_WORLD", true}),
             Catch::Contains("inconsistent launch") && Catch::Contains("MPI_COMM_WORLD says rank 1 of 2") &&
                 Catch::Contains("RANK=0"));
  CHECK_THAT(launch_error({}, {.rank = 5}, dpl::launch_fallback{1, 2, {}, {}, "MPI_COMM_WORLD", true}),
             Catch::Contains("rank=5 (argument)"));
}

TEST_CASE("launch: the generic init_process_group builds, checks and wraps the engine's group", "[launch]") {
  auto one_rank = [](dpl::launch_info const& info, dpl::init_options const& o) {
    return dpl::host::make_group(info.world_size, o.timeout)[0];
  };
  auto g = dpl::init_process_group(one_rank, {.timeout = std::chrono::seconds(7)}, env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
  CHECK((g.rank() == 0 && g.size() == 1 && g.world_size() == 1 && g.local_rank() == 0 && g.local_world_size() == 1));
  CHECK(g.timeout() == std::chrono::seconds(7));
  std::vector<float> v{1, 2, 3};
  g.all_reduce(dpl::view(v)).wait();
  CHECK(v == std::vector<float>{1, 2, 3});
  dpl::distributed_sampler const sampler(10, g);  // a distributed_group is a rank source
  CHECK(sampler.size() == 10);

  // The engine must make the rank the launch names.
  auto wrong = [](dpl::launch_info const&, dpl::init_options const&) { return dpl::host::make_group(2)[1]; };
  CHECK_THROWS_WITH(dpl::init_process_group(wrong, {}, env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}})),
                    Catch::Contains("the engine made rank 1 of 2") && Catch::Contains("rank 0 of 1"));
  // Desync detection by option or variable: the group is wrapped.
  for (auto const& [flag, var] : {std::pair{true, ""}, std::pair{false, "1"}}) {
    std::map<std::string, std::string> vars{{"RANK", "0"}, {"WORLD_SIZE", "1"}};
    if (*var != 0) vars["DPARALLEL_DESYNC_DETECTION"] = var;
    auto w = dpl::init_process_group(one_rank, {.desync_detection = flag}, env_of(vars));
    std::vector<double> d{4};
    w.all_reduce(dpl::view(d), dpl::reduce_op::avg).wait();
    CHECK(d == std::vector<double>{4});
    CHECK(w.completed_ops() == 1);  // the wrapper's own count: the host group underneath ran 2 (check + collective)
  }
  CHECK_THROWS_WITH(dpl::init_process_group(one_rank, {}, env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"},
                                                                    {"DPARALLEL_DESYNC_DETECTION", "maybe"}})),
                    Catch::Contains("DPARALLEL_DESYNC_DETECTION") && Catch::Contains("'maybe'"));
}

// =================================================================================================
// TCP rendezvous between real processes

TEST_CASE("rendezvous: two processes exchange an NCCL unique id through MASTER_ADDR=127.0.0.1", "[rendezvous]") {
  auto const id = fake_unique_id(42);
  dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 2,
                                 .timeout = std::chrono::seconds(30)});
  int const port = server.port();
  child_process peer([port] {
    dpl::launch_info info;
    info.rank = 1;
    info.world_size = 2;
    info.master_addr = "127.0.0.1";
    info.master_port = port;
    auto const got = dpl::share_root_bytes(info, {}, dpl::nccl_unique_id_bytes, {}, std::chrono::seconds(30));
    return hex(got);
  });
  auto const blobs = server.run(id);
  std::string const got = peer.join();
  CHECK(peer.exit_code() == 0);
  CHECK(got == hex(id));  // the peer holds rank 0's id, byte for byte
  REQUIRE(blobs.size() == 2);
  CHECK(blobs[0] == id);
  CHECK(blobs[1].empty());
}

TEST_CASE("rendezvous: three processes all-gather their blobs; peers may start before rank 0", "[rendezvous]") {
  int const port = free_port();
  auto run_rank = [port](int rank) {
    return [port, rank] {
      auto const blobs = dpl::tcp_rendezvous({.master_addr = "127.0.0.1", .master_port = port, .rank = rank,
                                              .world_size = 3, .timeout = std::chrono::seconds(30)},
                                             bytes_of("blob of rank " + std::to_string(rank)));
      std::string s;
      for (auto const& b : blobs) s += text_of(b) + ";";
      return s;
    };
  };
  child_process one(run_rank(1));
  child_process two(run_rank(2));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0 comes up late: peers retry
  std::string const mine = run_rank(0)();
  std::string const want = "blob of rank 0;blob of rank 1;blob of rank 2;";
  CHECK(mine == want);
  CHECK(one.join() == want);
  CHECK(two.join() == want);
}

TEST_CASE("rendezvous: a peer that never comes times out naming it, on rank 0 and on the peers", "[rendezvous]") {
  dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 3,
                                 .timeout = std::chrono::milliseconds(1500)});
  int const port = server.port();
  child_process peer([port] {
    dpl::tcp_rendezvous({.master_addr = "127.0.0.1", .master_port = port, .rank = 1, .world_size = 3,
                         .timeout = std::chrono::seconds(30)},
                        {});
    return std::string("no error");
  });
  try {
    server.run({});
    FAIL("expected a timeout");
  } catch (dpl::timeout_error const& e) {
    CHECK(e.rank() == 2);
    CHECK_THAT(e.what(), Catch::Contains("rank 2 never connected") && Catch::Contains("1500 ms"));
  }
  std::string const got = peer.join();
  CHECK_THAT(got, Catch::StartsWith("EXC timeout_error 2:") && Catch::Contains("rank 2 never connected"));
}

TEST_CASE("rendezvous: a wrong world size and a duplicate rank fail every participant, naming the peer",
          "[rendezvous]") {
  {
    dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 2,
                                   .timeout = std::chrono::seconds(30)});
    int const port = server.port();
    child_process peer([port] {
      dpl::tcp_rendezvous({.master_addr = "127.0.0.1", .master_port = port, .rank = 1, .world_size = 3,
                           .timeout = std::chrono::seconds(30)},
                          {});
      return std::string("no error");
    });
    try {
      server.run({});
      FAIL("expected an error");
    } catch (dpl::comm_error const& e) {
      CHECK(e.rank() == 1);
      CHECK_THAT(e.what(), Catch::Contains("started with world size 3") && Catch::Contains("rank 0 with world size 2"));
    }
    CHECK_THAT(peer.join(), Catch::StartsWith("EXC comm_error 1:") && Catch::Contains("world size 3"));
  }
  {
    // Rank 2 never comes: after the failure rank 0 answers latecomers until its timeout (kept short).
    dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 3,
                                   .timeout = std::chrono::seconds(4)});
    int const port = server.port();
    auto as_rank_one = [port] {
      dpl::tcp_rendezvous({.master_addr = "127.0.0.1", .master_port = port, .rank = 1, .world_size = 3,
                           .timeout = std::chrono::seconds(30)},
                          {});
      return std::string("no error");
    };
    child_process a(as_rank_one);
    child_process b(as_rank_one);
    try {
      server.run({});
      FAIL("expected an error");
    } catch (dpl::comm_error const& e) {
      CHECK(e.rank() == 1);
      CHECK_THAT(e.what(), Catch::Contains("rank 1 connected twice") && Catch::Contains("distinct RANK"));
    }
    CHECK_THAT(a.join(), Catch::Contains("rank 1 connected twice"));
    CHECK_THAT(b.join(), Catch::Contains("rank 1 connected twice"));
  }
}

TEST_CASE("rendezvous: bad ports, ranks and addresses are clear errors", "[rendezvous]") {
  using opts = dpl::rendezvous_options;
  CHECK_THROWS_WITH(dpl::tcp_rendezvous(opts{.master_addr = "127.0.0.1", .master_port = 29500, .rank = 2, .world_size = 2}, {}),
                    Catch::Contains("expected a rank in [0, 2), found 2") && Catch::Contains("RANK and WORLD_SIZE"));
  CHECK_THROWS_WITH(dpl::tcp_rendezvous(opts{.master_addr = "127.0.0.1", .master_port = 0, .rank = 1, .world_size = 2}, {}),
                    Catch::Contains("MASTER_PORT in [1, 65535], found 0"));
  CHECK_THROWS_WITH(dpl::tcp_rendezvous(opts{.master_addr = "127.0.0.1", .master_port = 65536, .rank = 1, .world_size = 2}, {}),
                    Catch::Contains("found 65536"));
  CHECK_THROWS_WITH(dpl::tcp_rendezvous(opts{.master_addr = "no-such-host.invalid", .master_port = 29500, .rank = 1,
                                             .world_size = 2, .timeout = std::chrono::seconds(5)},
                                        {}),
                    Catch::Contains("cannot resolve MASTER_ADDR 'no-such-host.invalid'"));
  // An address nobody answers at (TEST-NET-1, never routed): retried until the timeout.
  try {
    dpl::tcp_rendezvous(opts{.master_addr = "192.0.2.1", .master_port = 29500, .rank = 1, .world_size = 2,
                             .timeout = std::chrono::milliseconds(1200)},
                        {});
    FAIL("expected an error");
  } catch (dpl::comm_error const& e) {
    CHECK(e.rank() == 0);
    CHECK_THAT(e.what(), Catch::Contains("rank 0 at 192.0.2.1:29500"));
  }
  // Rank 0 cannot listen on a port another process holds.
  dpl::rendezvous_server first({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 2});
  CHECK_THROWS_WITH(dpl::rendezvous_server({.master_addr = "127.0.0.1", .master_port = first.port(), .rank = 0,
                                            .world_size = 2}),
                    Catch::Contains("choose a free MASTER_PORT"));
  // A bootstrap without a group needs MASTER_ADDR and MASTER_PORT.
  dpl::launch_info info;
  info.rank = 1;
  info.world_size = 2;
  CHECK_THROWS_WITH(dpl::share_root_bytes(info, {}, 128), Catch::Contains("MASTER_ADDR is not set"));
}

TEST_CASE("bootstrap: through a process group, the unique id is rank 0's on every rank", "[rendezvous]") {
  auto const id = fake_unique_id(7);
  std::vector<std::vector<std::byte>> got(3);
  dpl::spawn(3, [&](dpl::rank_context& rank) {
    dpl::launch_info info;
    info.rank = rank.rank();
    info.world_size = 3;
    std::vector<std::byte> const mine = rank.rank() == 0 ? id : std::vector<std::byte>{};
    got[static_cast<std::size_t>(rank.rank())] =
        dpl::share_root_bytes(info, mine, dpl::nccl_unique_id_bytes, rank.group());
  });
  for (auto const& g : got) CHECK(g == id);
}

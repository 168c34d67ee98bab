// tcp_rendezvous under faults, on loopback only: a silent
// connection delays no rank and gets no rank blamed; a master announcing oversized lengths is
// reported with what was read and the limit; absurd world sizes are refused before any
// allocation; a RANK too long to be a rank is "out of range".
#include <dparallel/comm/process_group_init.hpp>
#include <dparallel/comm/rendezvous.hpp>

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dpl = dparallel;
using namespace std::chrono_literals;

namespace {

std::vector<std::byte> bytes_of(std::string const& s) {
  std::vector<std::byte> out(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) out[i] = static_cast<std::byte>(s[i]);
  return out;
}

/// A loopback TCP connection to `port` (blocking), or -1.
int connect_loopback(int port) {
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

/// A listening loopback socket on a free port; returns {fd, port}.
std::pair<int, int> listen_loopback() {
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return {fd, ntohs(a.sin_port)};
}

void put_u32(std::vector<unsigned char>& out, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<unsigned char>(v >> s));
}

/// A fake master: accepts one connection, reads its hello, answers `reply` and waits for the close.
std::thread fake_master(int listen_fd, std::vector<unsigned char> reply) {
  return std::thread([listen_fd, reply = std::move(reply)] {
    int const c = ::accept(listen_fd, nullptr, nullptr);
    if (c < 0) return;
    unsigned char hello[20];
    std::size_t got = 0;
    while (got < sizeof hello) {
      ssize_t const k = ::recv(c, hello + got, sizeof hello - got, 0);
      if (k <= 0) break;
      got += static_cast<std::size_t>(k);
    }
    (void)::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
    char sink[64];
    while (::recv(c, sink, sizeof sink, 0) > 0) {
    }
    ::close(c);
  });
}

std::string client_error(int port) {
  try {
    dpl::rendezvous_client({.master_addr = "127.0.0.1", .master_port = port, .rank = 1, .world_size = 2,
                            .timeout = 10s},
                           {});
  } catch (dpl::error const& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("rendezvous faults: a silent connection delays no rank", "[rendezvous][faults]") {
  // The timeout (4 s) is shorter than the hello bound (5 s): a master that served connections one
  // at a time would spend it all on the silent one.
  dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 2,
                                 .timeout = 4s});
  int const port = server.port();
  int const silent = connect_loopback(port);
  REQUIRE(silent >= 0);
  auto peer = std::async(std::launch::async, [port] {
    std::this_thread::sleep_for(100ms);  // after the silent one
    return dpl::rendezvous_client({.master_addr = "127.0.0.1", .master_port = port, .rank = 1, .world_size = 2,
                                   .timeout = 10s},
                                  bytes_of("one"));
  });
  auto const blobs = server.run(bytes_of("zero"));
  auto const theirs = peer.get();
  ::close(silent);
  REQUIRE(blobs.size() == 2);
  CHECK(blobs[1] == bytes_of("one"));
  CHECK(theirs == blobs);
}

TEST_CASE("rendezvous faults: on a timeout only the ranks that never said hello are blamed",
          "[rendezvous][faults]") {
  dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 3,
                                 .timeout = 2s});
  int const port = server.port();
  int const silent = connect_loopback(port);
  REQUIRE(silent >= 0);
  auto peer = std::async(std::launch::async, [port]() -> std::pair<int, std::string> {
    std::this_thread::sleep_for(100ms);
    try {
      dpl::rendezvous_client({.master_addr = "127.0.0.1", .master_port = port, .rank = 1, .world_size = 3,
                              .timeout = 10s},
                             {});
    } catch (dpl::timeout_error const& e) {
      return {e.rank(), e.what()};
    } catch (std::exception const& e) {
      return {-1, e.what()};
    }
    return {-1, "(no error)"};
  });
  int blamed = -1;
  std::string msg;
  try {
    server.run({});
  } catch (dpl::timeout_error const& e) {
    blamed = e.rank();
    msg = e.what();
  }
  ::close(silent);
  auto const [peer_blamed, peer_msg] = peer.get();
  CHECK(blamed == 2);
  CHECK_THAT(msg, Catch::Contains("rank 2 never connected (ranks 0 and 1 are here)"));
  CHECK(peer_blamed == 2);
  CHECK_THAT(peer_msg, Catch::Contains("rank 2 never connected"));
}

TEST_CASE("rendezvous faults: oversized lengths from the master say what was read and the limit",
          "[rendezvous][faults]") {
  constexpr std::uint32_t magic = 0x44505256;
  {
    auto [fd, port] = listen_loopback();
    std::vector<unsigned char> reply;
    for (std::uint32_t v : {magic, 1u, 0u, 0u, 70000u}) put_u32(reply, v);  // an error of 70000 bytes
    std::thread master = fake_master(fd, reply);
    std::string const msg = client_error(port);
    master.join();
    ::close(fd);
    CHECK_THAT(msg, Catch::Contains("an error message of 70000 bytes, more than the limit of 65536"));
  }
  {
    auto [fd, port] = listen_loopback();
    std::vector<unsigned char> reply;
    for (std::uint32_t v : {magic, 0u, 2u, 0u, 0xFFFFFFF0u}) put_u32(reply, v);  // rank 1's blob: 4 GiB
    std::thread master = fake_master(fd, reply);
    std::string const msg = client_error(port);
    master.join();
    ::close(fd);
    CHECK_THAT(msg, Catch::Contains("the blob of rank 1 of 4294967280 bytes, more than the limit of 67108864"));
  }
}

TEST_CASE("rendezvous faults: a world size above the maximum is refused before anything is allocated",
          "[rendezvous][faults]") {
  for (int world : {16'777'216, 2'147'483'647}) {
    INFO("world size " << world);
    dpl::rendezvous_options const o{.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = world,
                                    .timeout = 1s};
    CHECK_THROWS_AS(dpl::rendezvous_server(o), dpl::invalid_argument);
    CHECK_THROWS_WITH(dpl::rendezvous_server(o), Catch::Contains("expected a world size in [1, 1048576]") &&
                                                     Catch::Contains(std::to_string(world)));
  }
  CHECK(dpl::max_rendezvous_world_size == 1 << 20);
}

TEST_CASE("launch: a RANK of 20 digits is out of range, not malformed", "[launch]") {
  auto env = [](std::map<std::string, std::string> vars) -> dpl::environment {
    return [vars = std::move(vars)](std::string const& name) -> std::optional<std::string> {
      auto const it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    };
  };
  CHECK_THROWS_WITH(dpl::resolve_launch({}, env({{"RANK", "12345678901234567890"}, {"WORLD_SIZE", "2"}})),
                    Catch::Contains("RANK") && Catch::Contains("found 12345678901234567890 (out of range)"));
  CHECK_THROWS_WITH(dpl::resolve_launch({}, env({{"RANK", "1\x1b[2J"}, {"WORLD_SIZE", "2"}})),
                    Catch::Contains("'1\\x1b[2J'"));
}

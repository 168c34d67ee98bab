// tcp_rendezvous under faults, on loopback only: a silent connection delays no rank and gets no
// rank blamed; a master announcing oversized lengths is reported with what was read and the
// limit; absurd world sizes are refused before any allocation; a RANK too long to be a rank is
// "out of range"; a rendezvous that failed on rank 0 is told to the ranks that connect later; a
// job token keeps out hellos without it; rank 0's error text is escaped on the peers; unfinished
// hellos hold at most the pending-bytes budget; a master that ends before answering is named so.
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

/// rendezvous_client as rank `rank` of `world` ranks at `port` (with `token`): its error, or "(no error)".
std::string client_outcome(int port, int rank, int world, std::string token = {}, std::chrono::milliseconds t = 10s) {
  try {
    dpl::rendezvous_client({.master_addr = "127.0.0.1", .master_port = port, .rank = rank, .world_size = world,
                            .timeout = t, .token = std::move(token)},
                           bytes_of("blob of " + std::to_string(rank)));
  } catch (dpl::error const& e) {
    return e.what();
  }
  return "(no error)";
}

std::string client_error(int port) { return client_outcome(port, 1, 2); }

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

TEST_CASE("rendezvous faults: rank 0's failure is told to the ranks that connect after it", "[rendezvous][faults]") {
  // Rank 1 comes with another world size and fails the rendezvous; rank 2 connects afterwards. It
  // must get rank 0's cause, at once, not "could not connect" at its own timeout.
  dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 3,
                                 .timeout = 8s});
  int const port = server.port();
  auto const t0 = std::chrono::steady_clock::now();
  auto wrong = std::async(std::launch::async, [port] { return client_outcome(port, 1, 4); });
  auto late = std::async(std::launch::async, [port] {
    std::this_thread::sleep_for(500ms);  // after rank 0 failed
    return client_outcome(port, 2, 3, {}, 6s);
  });
  std::string msg;
  try {
    server.run({});
  } catch (dpl::comm_error const& e) {
    msg = e.what();
  }
  auto const elapsed = std::chrono::steady_clock::now() - t0;
  CHECK_THAT(msg, Catch::Contains("rank 1 (from 127.0.0.1:") && Catch::Contains("started with world size 4"));
  CHECK_THAT(wrong.get(), Catch::Contains("rank 0 reported: rank 1") && Catch::Contains("world size 4"));
  CHECK_THAT(late.get(), Catch::StartsWith("dparallel: tcp_rendezvous on rank 2: rank 0 reported: rank 1") &&
                             Catch::Contains("started with world size 4"));
  CHECK(elapsed < 4s);  // rank 0 stopped serving once every rank was told, well before its 8 s timeout
}

TEST_CASE("rendezvous faults: with a job token, a hello without it is refused and blamed on no rank",
          "[rendezvous][faults]") {
  dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 2,
                                 .timeout = 5s, .token = "s3cret-token"});
  int const port = server.port();
  auto serving = std::async(std::launch::async, [&server] { return server.run(bytes_of("zero")); });
  auto const refused = client_outcome(port, 1, 2, "guess");  // answered before the real rank 1 comes
  CHECK(client_outcome(port, 1, 2, "s3cret-token") == "(no error)");
  auto const blobs = serving.get();
  REQUIRE(blobs.size() == 2);
  CHECK(blobs[1] == bytes_of("blob of 1"));  // the token is not part of the blob
  CHECK_THAT(refused, Catch::Contains("rendezvous token does not match rank 0's") &&
                          Catch::Contains("DPARALLEL_RENDEZVOUS_TOKEN") && !Catch::Contains("s3cret"));
  // Without the token rank 1's seat stays free: a rendezvous with no token admits anyone (the
  // documented exposure), one with a token only the ranks that know it.
  dpl::rendezvous_server open({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 2,
                               .timeout = 5s, .token = ""});
  int const open_port = open.port();
  auto anyone = std::async(std::launch::async, [open_port] { return client_outcome(open_port, 1, 2); });
  CHECK(open.run({}).size() == 2);
  CHECK(anyone.get() == "(no error)");
}

TEST_CASE("rendezvous faults: rank 0's error text is escaped before a peer shows it", "[rendezvous][faults]") {
  constexpr std::uint32_t magic = 0x44505256;
  std::string const forged = "bad\x1b[2J\ndparallel: rank 3: all good\x07";
  auto [fd, port] = listen_loopback();
  std::vector<unsigned char> reply;
  for (std::uint32_t v : {magic, 1u, 0u, 0u, static_cast<std::uint32_t>(forged.size())}) put_u32(reply, v);
  reply.insert(reply.end(), forged.begin(), forged.end());
  std::thread master = fake_master(fd, reply);
  std::string const msg = client_error(port);
  master.join();
  ::close(fd);
  CHECK_THAT(msg, Catch::Contains("rank 0 reported: bad\\x1b[2J\\ndparallel: rank 3: all good\\x07"));
  CHECK(msg.find('\x1b') == std::string::npos);
  CHECK(msg.find('\n') == std::string::npos);
}

TEST_CASE("rendezvous faults: unfinished hellos together hold at most the pending-bytes budget",
          "[rendezvous][faults]") {
  // Three connections announce a 64 MiB blob each, send 48 MiB and stall. Rank 0 reads them only
  // up to the budget for all unfinished hellos (128 MiB), drops them at the hello bound (5 s) and
  // reports how much each had sent: together no more than the budget (144 MiB without it).
  constexpr std::size_t sent = std::size_t{48} << 20;
  std::vector<unsigned char> const payload(sent, 0x5a);
  dpl::rendezvous_server server({.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world_size = 2,
                                 .timeout = 6s});
  int const port = server.port();
  std::vector<int> fds;
  std::vector<std::thread> senders;
  for (int k = 0; k < 3; ++k) {
    int const fd = connect_loopback(port);
    REQUIRE(fd >= 0);
    fds.push_back(fd);
    senders.emplace_back([fd, &payload] {
      std::vector<unsigned char> head;
      for (std::uint32_t v : {0x44505256u, 2u, 1u, 2u, 64u << 20}) put_u32(head, v);
      (void)::send(fd, head.data(), head.size(), MSG_NOSIGNAL);
      std::size_t off = 0;
      while (off < payload.size()) {
        ssize_t const k2 = ::send(fd, payload.data() + off, payload.size() - off, MSG_NOSIGNAL);
        if (k2 <= 0) return;
        off += static_cast<std::size_t>(k2);
      }
    });
  }
  std::string msg;
  try {
    server.run({});
  } catch (dpl::timeout_error const& e) {
    msg = e.what();
  }
  for (int fd : fds) ::shutdown(fd, SHUT_RDWR);
  for (auto& t : senders) t.join();
  for (int fd : fds) ::close(fd);
  INFO(msg);
  std::size_t total = 0;
  int dropped = 0;
  std::string const mark = "(sent ";
  for (auto at = msg.find(mark); at != std::string::npos; at = msg.find(mark, at + 1)) {
    total += std::stoull(msg.substr(at + mark.size()));
    ++dropped;
  }
  CHECK(dropped == 3);
  CHECK(total > std::size_t{100} << 20);        // they did send (the budget was used)
  CHECK(total <= (std::size_t{128} << 20) + 60);  // but not beyond it (+ three 20-byte heads)
}

TEST_CASE("rendezvous faults: a master that ends before answering is named as such", "[rendezvous][faults]") {
  auto [fd, port] = listen_loopback();
  std::thread master([fd = fd] {  // reads the hello's head, then its process "ends"
    int const c = ::accept(fd, nullptr, nullptr);
    if (c < 0) return;
    unsigned char head[20];
    (void)::recv(c, head, sizeof head, MSG_WAITALL);
    ::shutdown(c, SHUT_RDWR);
    ::close(c);
  });
  std::string const msg = client_error(port);
  master.join();
  ::close(fd);
  CHECK_THAT(msg, Catch::Contains("rank 0 at 127.0.0.1:") &&
                      Catch::Contains("by rank 0 before it answered: its process ended (it died, was killed, or "
                                      "failed on its own: see rank 0's error)"));
}

#pragma once
// tcp_rendezvous: the `env://` bootstrap. Every rank contributes a small opaque blob (an NCCL
// unique id on rank 0, nothing on the others, say) and receives every rank's blob, through rank 0
// listening at MASTER_ADDR:MASTER_PORT. POSIX sockets only: no MPI, NCCL or CUDA.
//
//   auto blobs = dparallel::tcp_rendezvous({.master_addr = info.master_addr, .master_port = info.master_port,
//                                           .rank = info.rank, .world_size = info.world_size}, my_blob);
//   // blobs[r] is rank r's blob, on every rank
//
// Protocol (one TCP connection per rank r > 0, to rank 0):
//   r -> 0: "DPRV", version, r, world size, blob length, blob
//   0 -> r: "DPRV", status 0, then world-size blobs (length, bytes), rank order
//        or "DPRV", status 1, the rank at fault, a timeout flag, the error message
// Rank 0 listens on every interface of MASTER_ADDR's address family at MASTER_PORT (as PyTorch's
// TCPStore does), accepts until all world size - 1 peers said hello or the timeout passed, and
// checks each hello: a peer with another world size, a rank outside [1, world size) and a rank
// that connects twice fail the whole rendezvous, and rank 0 sends its error to every connected
// peer, so all of them fail with the same message. Peers retry connecting (rank 0 may start
// later) until the timeout, then fail with a timeout_error naming rank 0 and the last socket error.
// A connection that does not speak the protocol is dropped and does not count.
//
// Errors: invalid_argument for bad options (rank >= world size, port out of range, an address
// that does not resolve); timeout_error for a rank that never came (naming it) or a master that
// cannot be reached; comm_error for a wrong world size or duplicate rank (naming the peer).

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Where and who: what tcp_rendezvous needs (see resolve_launch for reading it from the environment).
struct rendezvous_options {
  std::string master_addr{};  ///< rank 0's host name or address (MASTER_ADDR)
  int master_port = 0;      ///< rank 0's TCP port (MASTER_PORT); rendezvous_server accepts 0 (any free port)
  /// This process's rank.
  int rank = 0;
  /// Number of ranks taking part.
  int world_size = 1;
  /// Bounds every wait: rank 0 for its peers, a peer for rank 0 to come up and answer.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
};

namespace detail::rdv {

using clock = std::chrono::steady_clock;
inline constexpr std::uint32_t magic = 0x44505256;  // "DPRV"
inline constexpr std::uint32_t version = 1;
inline constexpr std::uint32_t max_blob = 64u << 20;
inline constexpr std::uint32_t max_message = 1u << 16;

inline std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

inline std::string where(rendezvous_options const& o) {
  return o.master_addr + ":" + std::to_string(o.master_port);
}

/// Owns a file descriptor.
class fd_guard {
 public:
  fd_guard() = default;
  explicit fd_guard(int fd) noexcept : fd_(fd) {}
  fd_guard(fd_guard&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  fd_guard& operator=(fd_guard&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  fd_guard(fd_guard const&) = delete;
  fd_guard& operator=(fd_guard const&) = delete;
  ~fd_guard() { reset(); }
  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

inline int ms_left(clock::time_point deadline) {
  auto const ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 1 << 30));
}

inline void set_nonblocking(int fd) {
  int const flags = ::fcntl(fd, F_GETFL, 0);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

/// Sends n bytes before the deadline; on failure returns false and sets `why`.
inline bool send_all(int fd, void const* data, std::size_t n, clock::time_point deadline, std::string& why) {
  auto const* p = static_cast<char const*>(data);
  while (n > 0) {
    ssize_t const k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      why = errno_text(errno);
      return false;
    }
    pollfd pfd{fd, POLLOUT, 0};
    int const left = ms_left(deadline);
    if (left == 0 || ::poll(&pfd, 1, left) == 0) {
      why = "timed out while sending";
      return false;
    }
  }
  return true;
}

/// Receives n bytes before the deadline; on failure returns false and sets `why`.
inline bool recv_all(int fd, void* data, std::size_t n, clock::time_point deadline, std::string& why) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t const k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k == 0) {
      why = "the connection was closed";
      return false;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      why = errno_text(errno);
      return false;
    }
    pollfd pfd{fd, POLLIN, 0};
    int const left = ms_left(deadline);
    if (left == 0 || ::poll(&pfd, 1, left) == 0) {
      why = "timed out";
      return false;
    }
  }
  return true;
}

inline void put_u32(std::vector<std::byte>& out, std::uint32_t v) {
  std::uint32_t const be = htonl(v);
  auto const* b = reinterpret_cast<std::byte const*>(&be);
  out.insert(out.end(), b, b + 4);
}
inline void put_bytes(std::vector<std::byte>& out, std::span<std::byte const> b) {
  put_u32(out, static_cast<std::uint32_t>(b.size()));
  out.insert(out.end(), b.begin(), b.end());
}
inline bool recv_u32(int fd, std::uint32_t& v, clock::time_point deadline, std::string& why) {
  std::uint32_t be = 0;
  if (!recv_all(fd, &be, 4, deadline, why)) return false;
  v = ntohl(be);
  return true;
}

/// getaddrinfo for a stream socket; throws invalid_argument naming MASTER_ADDR on failure.
struct addr_list {
  addrinfo* head = nullptr;
  addr_list(std::string const& host, std::string const& port, bool passive, int rank) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = (passive ? AI_PASSIVE : 0) | (port.empty() ? 0 : AI_NUMERICSERV);
    int const rc = ::getaddrinfo(host.c_str(), port.empty() ? nullptr : port.c_str(), &hints, &head);
    if (rc != 0 || head == nullptr)
      throw invalid_argument("dparallel: tcp_rendezvous on rank " + std::to_string(rank) +
                             ": cannot resolve MASTER_ADDR '" + host + "': " + ::gai_strerror(rc) +
                             "; set MASTER_ADDR to rank 0's host name or IP address");
  }
  addr_list(addr_list const&) = delete;
  addr_list& operator=(addr_list const&) = delete;
  ~addr_list() {
    if (head != nullptr) ::freeaddrinfo(head);
  }
};

inline std::string peer_name(sockaddr_storage const& sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa.ss_family == AF_INET) {
    auto const& a = reinterpret_cast<sockaddr_in const&>(sa);
    ::inet_ntop(AF_INET, &a.sin_addr, host, sizeof host);
    port = ntohs(a.sin_port);
  } else if (sa.ss_family == AF_INET6) {
    auto const& a = reinterpret_cast<sockaddr_in6 const&>(sa);
    ::inet_ntop(AF_INET6, &a.sin6_addr, host, sizeof host);
    port = ntohs(a.sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

inline void validate(rendezvous_options const& o, bool server, std::size_t blob_size) {
  std::string const who = "dparallel: tcp_rendezvous on rank " + std::to_string(o.rank) + ": ";
  if (o.world_size < 1)
    throw invalid_argument(who + "expected a world size >= 1, found " + std::to_string(o.world_size) +
                           "; check WORLD_SIZE");
  if (o.rank < 0 || o.rank >= o.world_size)
    throw invalid_argument(who + "expected a rank in [0, " + std::to_string(o.world_size) + "), found " +
                           std::to_string(o.rank) + " with world size " + std::to_string(o.world_size) +
                           "; check RANK and WORLD_SIZE");
  if (server && o.rank != 0)
    throw invalid_argument(who + "rendezvous_server runs on rank 0, found rank " + std::to_string(o.rank));
  int const lo = server ? 0 : 1;
  if (o.master_port < lo || o.master_port > 65535)
    throw invalid_argument(who + "expected MASTER_PORT in [" + std::to_string(lo) + ", 65535], found " +
                           std::to_string(o.master_port));
  if (o.master_addr.empty())
    throw invalid_argument(who + "expected MASTER_ADDR (rank 0's host), found an empty string");
  if (o.timeout.count() <= 0)
    throw invalid_argument(who + "expected a positive timeout, found " + std::to_string(o.timeout.count()) + " ms");
  if (blob_size > max_blob)
    throw invalid_argument(who + "expected a blob of at most " + std::to_string(max_blob) + " bytes, found " +
                           std::to_string(blob_size));
}

}  // namespace detail::rdv

/// Rank 0's side of tcp_rendezvous, in two steps so that the port is known before any peer starts
/// (construct: bind and listen; run: accept the peers and answer them). Port 0 picks a free port.
class rendezvous_server {
 public:
  /// Binds and listens at opts.master_port (0: a free port); run() then serves the peers.
  explicit rendezvous_server(rendezvous_options opts) : opts_(std::move(opts)) {
    namespace rdv = detail::rdv;
    rdv::validate(opts_, true, 0);
    rdv::addr_list const addrs(opts_.master_addr, {}, false, 0);
    int const family = addrs.head->ai_family == AF_INET6 ? AF_INET6 : AF_INET;
    listen_ = rdv::fd_guard(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listen_.valid()) fail_setup("cannot create a socket", errno);
    int one = 1;
    ::setsockopt(listen_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_storage sa{};
    socklen_t len = 0;
    if (family == AF_INET6) {
      int zero = 0;
      ::setsockopt(listen_.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      auto& a = reinterpret_cast<sockaddr_in6&>(sa);
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<std::uint16_t>(opts_.master_port));
      len = sizeof a;
    } else {
      auto& a = reinterpret_cast<sockaddr_in&>(sa);
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<std::uint16_t>(opts_.master_port));
      len = sizeof a;
    }
    if (::bind(listen_.get(), reinterpret_cast<sockaddr*>(&sa), len) != 0) {
      int const e = errno;
      fail_setup("cannot listen on port " + std::to_string(opts_.master_port) +
                     (e == EADDRINUSE ? " (another process holds it: choose a free MASTER_PORT)" : ""),
                 e);
    }
    if (::listen(listen_.get(), std::clamp(opts_.world_size, 1, SOMAXCONN)) != 0) fail_setup("cannot listen", errno);
    rdv::set_nonblocking(listen_.get());
    sockaddr_storage bound{};
    socklen_t blen = sizeof bound;
    ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
    port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6&>(bound).sin6_port)
                                        : ntohs(reinterpret_cast<sockaddr_in&>(bound).sin_port);
  }

  /// The port it listens on (the chosen one when constructed with port 0).
  [[nodiscard]] int port() const noexcept { return port_; }

  /// Accepts world_size - 1 peers and gives each every rank's blob; returns them (index = rank).
  std::vector<std::vector<std::byte>> run(std::span<std::byte const> mine) {
    namespace rdv = detail::rdv;
    rdv::validate(opts_, true, mine.size());
    auto const n = static_cast<std::size_t>(opts_.world_size);
    auto const start = rdv::clock::now();
    auto const deadline = start + opts_.timeout;
    std::vector<rdv::fd_guard> peers(n);
    std::vector<std::string> from(n);
    std::vector<std::vector<std::byte>> blobs(n);
    blobs[0].assign(mine.begin(), mine.end());
    std::vector<std::string> ignored;
    std::size_t connected = 1;

    while (connected < n) {
      int const left = rdv::ms_left(deadline);
      if (left == 0) {
        std::vector<int> missing, present{0};
        for (std::size_t r = 1; r < n; ++r) (peers[r].valid() ? present : missing).push_back(static_cast<int>(r));
        std::string msg = "rendezvous at " + where() + " timed out after " + std::to_string(opts_.timeout.count()) +
                          " ms: " + ranks_text(missing) + " never connected (" + ranks_text(present) +
                          (present.size() == 1 ? " is" : " are") + " here). Start all " + std::to_string(n) +
                          " ranks with the same MASTER_ADDR and MASTER_PORT and WORLD_SIZE=" + std::to_string(n) +
                          ", or raise the timeout";
        if (!ignored.empty()) {
          msg += "; ignored " + std::to_string(ignored.size()) + " connection(s) that did not speak the protocol:";
          for (auto const& i : ignored) msg += " " + i;
        }
        fail(peers, missing[0], true, msg);
      }
      pollfd pfd{listen_.get(), POLLIN, 0};
      if (::poll(&pfd, 1, left) <= 0) continue;
      sockaddr_storage sa{};
      socklen_t slen = sizeof sa;
      rdv::fd_guard conn(::accept(listen_.get(), reinterpret_cast<sockaddr*>(&sa), &slen));
      if (!conn.valid()) continue;
      rdv::set_nonblocking(conn.get());
      std::string const name = rdv::peer_name(sa);
      // A hello must come quickly; a silent connection is dropped rather than blocking the others.
      auto const hello_deadline = std::min(deadline, rdv::clock::now() + std::chrono::seconds(10));
      std::string why;
      std::uint32_t m = 0, ver = 0, rank = 0, world = 0, blob_len = 0;
      if (!rdv::recv_u32(conn.get(), m, hello_deadline, why) || m != rdv::magic ||
          !rdv::recv_u32(conn.get(), ver, hello_deadline, why)) {
        ignored.push_back(name);
        continue;
      }
      if (ver != rdv::version) {
        ignored.push_back(name + " (dparallel rendezvous protocol version " + std::to_string(ver) + ", expected " +
                          std::to_string(rdv::version) + ")");
        continue;
      }
      if (!rdv::recv_u32(conn.get(), rank, hello_deadline, why) ||
          !rdv::recv_u32(conn.get(), world, hello_deadline, why) ||
          !rdv::recv_u32(conn.get(), blob_len, hello_deadline, why) || blob_len > rdv::max_blob) {
        ignored.push_back(name + " (" + (why.empty() ? "a bad blob length" : why) + ")");
        continue;
      }
      std::vector<std::byte> blob(blob_len);
      if (blob_len != 0 && !rdv::recv_all(conn.get(), blob.data(), blob_len, hello_deadline, why)) {
        ignored.push_back(name + " (" + why + ")");
        continue;
      }
      auto const r = static_cast<std::int32_t>(rank);
      auto const w = static_cast<std::int32_t>(world);
      if (w != opts_.world_size) {
        peers.push_back(std::move(conn));  // so that it hears the error too
        fail(peers, r, false,
             "rank " + std::to_string(r) + " (from " + name + ") was started with world size " + std::to_string(w) +
                 ", but rank 0 with world size " + std::to_string(opts_.world_size) +
                 ": every rank must be given the same WORLD_SIZE");
      }
      if (r <= 0 || r >= opts_.world_size) {
        peers.push_back(std::move(conn));
        fail(peers, r, false,
             r == 0 ? "a second rank 0 connected (from " + name +
                          "): rank 0 is the master itself; every rank needs a distinct RANK"
                    : "a peer (from " + name + ") announced rank " + std::to_string(r) + ", outside [1, " +
                          std::to_string(opts_.world_size) + "): check RANK and WORLD_SIZE");
      }
      auto const ur = static_cast<std::size_t>(r);
      if (peers[ur].valid()) {
        std::string const first = from[ur];
        peers.push_back(std::move(conn));
        fail(peers, r, false,
             "rank " + std::to_string(r) + " connected twice (from " + first + " and from " + name +
                 "): every rank needs a distinct RANK below WORLD_SIZE=" + std::to_string(opts_.world_size));
      }
      peers[ur] = std::move(conn);
      from[ur] = name;
      blobs[ur] = std::move(blob);
      ++connected;
    }

    std::vector<std::byte> reply;
    rdv::put_u32(reply, rdv::magic);
    rdv::put_u32(reply, 0);
    rdv::put_u32(reply, static_cast<std::uint32_t>(n));
    for (auto const& b : blobs) rdv::put_bytes(reply, b);
    auto const send_deadline = rdv::clock::now() + std::min<std::chrono::milliseconds>(opts_.timeout, std::chrono::seconds(30));
    for (std::size_t r = 1; r < n; ++r) {
      std::string why;
      if (!rdv::send_all(peers[r].get(), reply.data(), reply.size(), send_deadline, why))
        throw comm_error(static_cast<int>(r), "dparallel: tcp_rendezvous on rank 0: could not send the result to rank " +
                                                  std::to_string(r) + " (" + from[r] + "): " + why);
    }
    return blobs;
  }

 private:
  [[nodiscard]] std::string where() const { return opts_.master_addr + ":" + std::to_string(port_); }

  static std::string ranks_text(std::vector<int> const& r) {
    if (r.size() == 1) return "rank " + std::to_string(r[0]);
    std::string s = "ranks ";
    for (std::size_t i = 0; i < r.size(); ++i) s += (i == 0 ? "" : i + 1 == r.size() ? " and " : ", ") + std::to_string(r[i]);
    return s;
  }

  [[noreturn]] void fail_setup(std::string const& what, int e) const {
    throw comm_error(0, "dparallel: tcp_rendezvous on rank 0: " + what + " at " + opts_.master_addr + ":" +
                            std::to_string(opts_.master_port) + ": " + detail::rdv::errno_text(e));
  }

  // Tells every connected peer, then throws on rank 0.
  [[noreturn]] void fail(std::vector<detail::rdv::fd_guard>& peers, int culprit, bool timed_out, std::string msg) {
    namespace rdv = detail::rdv;
    if (msg.size() > rdv::max_message) msg.resize(rdv::max_message);
    std::vector<std::byte> reply;
    rdv::put_u32(reply, rdv::magic);
    rdv::put_u32(reply, 1);
    rdv::put_u32(reply, static_cast<std::uint32_t>(culprit));
    rdv::put_u32(reply, timed_out ? 1 : 0);
    rdv::put_bytes(reply, std::as_bytes(std::span(msg.data(), msg.size())));
    auto const deadline = rdv::clock::now() + std::chrono::seconds(2);
    for (auto& p : peers) {
      std::string why;
      if (p.valid()) rdv::send_all(p.get(), reply.data(), reply.size(), deadline, why);
    }
    std::string const text = "dparallel: tcp_rendezvous on rank 0: " + msg;
    if (timed_out) throw timeout_error(culprit, text);
    throw comm_error(culprit, text);
  }

  rendezvous_options opts_;
  detail::rdv::fd_guard listen_;
  int port_ = 0;
};

/// A peer's side (rank > 0): connects to rank 0 (retrying until the timeout), says hello with its
/// blob, and returns every rank's blob.
inline std::vector<std::vector<std::byte>> rendezvous_client(rendezvous_options const& opts,
                                                             std::span<std::byte const> mine) {
  namespace rdv = detail::rdv;
  rdv::validate(opts, false, mine.size());
  if (opts.rank == 0)
    throw invalid_argument("dparallel: tcp_rendezvous: rendezvous_client runs on ranks > 0; rank 0 runs rendezvous_server");
  std::string const who = "dparallel: tcp_rendezvous on rank " + std::to_string(opts.rank) + ": ";
  rdv::addr_list const addrs(opts.master_addr, std::to_string(opts.master_port), false, opts.rank);
  auto const deadline = rdv::clock::now() + opts.timeout;

  rdv::fd_guard conn;
  std::string last_error = "no attempt";
  auto backoff = std::chrono::milliseconds(20);
  while (!conn.valid()) {
    for (addrinfo const* ai = addrs.head; ai != nullptr && !conn.valid(); ai = ai->ai_next) {
      rdv::fd_guard s(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (!s.valid()) {
        last_error = rdv::errno_text(errno);
        continue;
      }
      rdv::set_nonblocking(s.get());
      int rc = ::connect(s.get(), ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd pfd{s.get(), POLLOUT, 0};
        int const wait = std::min(rdv::ms_left(deadline), 2000);
        if (::poll(&pfd, 1, wait) > 0) {
          int err = 0;
          socklen_t len = sizeof err;
          ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          rc = err == 0 ? 0 : -1;
          if (err != 0) last_error = rdv::errno_text(err);
        } else {
          last_error = "connection attempt timed out";
          rc = -1;
        }
      } else if (rc != 0) {
        last_error = rdv::errno_text(errno);
      }
      if (rc == 0) conn = std::move(s);
    }
    if (conn.valid()) break;
    if (rdv::ms_left(deadline) == 0)
      throw timeout_error(0, who + "could not connect to rank 0 at " + rdv::where(opts) + " within " +
                                 std::to_string(opts.timeout.count()) + " ms (last error: " + last_error +
                                 "). Is rank 0 running, and do all ranks use the same MASTER_ADDR and MASTER_PORT?");
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(backoff, std::chrono::milliseconds(rdv::ms_left(deadline))));
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(1));
  }
  int one = 1;
  ::setsockopt(conn.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  std::vector<std::byte> hello;
  rdv::put_u32(hello, rdv::magic);
  rdv::put_u32(hello, rdv::version);
  rdv::put_u32(hello, static_cast<std::uint32_t>(opts.rank));
  rdv::put_u32(hello, static_cast<std::uint32_t>(opts.world_size));
  rdv::put_bytes(hello, mine);
  std::string why;
  auto const lost = [&](std::string const& step) {
    std::string msg = who + step + " rank 0 at " + rdv::where(opts) + " failed: " + why;
    if (why == "timed out")
      throw timeout_error(0, msg + " after " + std::to_string(opts.timeout.count()) +
                                 " ms (rank 0 waits until every rank has connected: are all WORLD_SIZE=" +
                                 std::to_string(opts.world_size) + " ranks started?)");
    throw comm_error(0, msg);
  };
  if (!rdv::send_all(conn.get(), hello.data(), hello.size(), deadline, why)) lost("saying hello to");

  std::uint32_t m = 0, status = 0;
  if (!rdv::recv_u32(conn.get(), m, deadline, why)) lost("waiting for the answer of");
  if (m != rdv::magic)
    throw comm_error(0, who + "the server at " + rdv::where(opts) +
                            " is not a dparallel rendezvous master (bad magic): check MASTER_ADDR and MASTER_PORT");
  if (!rdv::recv_u32(conn.get(), status, deadline, why)) lost("reading the answer of");
  if (status != 0) {
    std::uint32_t culprit = 0, timed_out = 0, len = 0;
    if (!rdv::recv_u32(conn.get(), culprit, deadline, why) || !rdv::recv_u32(conn.get(), timed_out, deadline, why) ||
        !rdv::recv_u32(conn.get(), len, deadline, why) || len > rdv::max_message)
      lost("reading the error of");
    std::string msg(len, '\0');
    if (len != 0 && !rdv::recv_all(conn.get(), msg.data(), len, deadline, why)) lost("reading the error of");
    std::string const text = who + "rank 0 reported: " + msg;
    if (timed_out != 0) throw timeout_error(static_cast<int>(culprit), text);
    throw comm_error(static_cast<int>(culprit), text);
  }
  std::uint32_t n = 0;
  if (!rdv::recv_u32(conn.get(), n, deadline, why)) lost("reading the answer of");
  if (n != static_cast<std::uint32_t>(opts.world_size))
    throw comm_error(0, who + "rank 0 answered with " + std::to_string(n) + " blobs, expected " +
                            std::to_string(opts.world_size));
  std::vector<std::vector<std::byte>> blobs(n);
  for (auto& b : blobs) {
    std::uint32_t len = 0;
    if (!rdv::recv_u32(conn.get(), len, deadline, why) || len > rdv::max_blob) lost("reading the answer of");
    b.resize(len);
    if (len != 0 && !rdv::recv_all(conn.get(), b.data(), len, deadline, why)) lost("reading the answer of");
  }
  return blobs;
}

/// Every rank contributes `mine` and receives every rank's blob (index = rank). Rank 0 listens at
/// opts.master_port, the others connect to opts.master_addr:opts.master_port. See the top of the file.
inline std::vector<std::vector<std::byte>> tcp_rendezvous(rendezvous_options const& opts,
                                                          std::span<std::byte const> mine) {
  detail::rdv::validate(opts, false, mine.size());
  if (opts.world_size == 1) return {std::vector<std::byte>(mine.begin(), mine.end())};
  if (opts.rank == 0) return rendezvous_server(opts).run(mine);
  return rendezvous_client(opts, mine);
}

DPARALLEL_NAMESPACE_END

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
// A connection that does not speak the protocol is dropped and does not count. Rank 0 serves all
// connections at once (poll): a connection that sends no hello (a port scanner, a health check)
// is dropped after 5 s without delaying the others, and on a timeout only the ranks that never
// said hello are blamed. The world size is at most max_rendezvous_world_size; rank 0 allocates
// per rank as ranks arrive. A peer that receives an announced length above the protocol's limits
// says what it read and the limit.
//
// Errors: invalid_argument for bad options (rank >= world size, port out of range, an address
// that does not resolve); timeout_error for a rank that never came (naming it) or a master that
// cannot be reached; comm_error for a wrong world size or duplicate rank (naming the peer).

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/rendezvous_io.hpp>
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
#include <map>
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

/// Largest world size tcp_rendezvous accepts (2^20 ranks): rank 0 holds one connection per rank
/// and allocates for each rank as it arrives, never for the declared world size up front.
inline constexpr int max_rendezvous_world_size = 1 << 20;

namespace detail::rdv {

/// How long a connection may take to send its whole hello before rank 0 drops it (a real rank
/// sends it at once; a port scanner or health check sends nothing). Others are served meanwhile.
inline constexpr std::chrono::seconds hello_timeout{5};
/// Most connections rank 0 holds that have not finished their hello.
inline constexpr std::size_t max_pending = 1024;

inline constexpr std::uint32_t magic = 0x44505256;  // "DPRV"
inline constexpr std::uint32_t version = 1;
inline constexpr std::uint32_t max_blob = 64u << 20;
inline constexpr std::uint32_t max_message = 1u << 16;

inline std::string where(rendezvous_options const& o) {
  return o.master_addr + ":" + std::to_string(o.master_port);
}

inline void validate(rendezvous_options const& o, bool server, std::size_t blob_size) {
  std::string const who = "dparallel: tcp_rendezvous on rank " + std::to_string(o.rank) + ": ";
  if (o.world_size < 1 || o.world_size > max_rendezvous_world_size)
    throw invalid_argument(who + "expected a world size in [1, " + std::to_string(max_rendezvous_world_size) +
                           "] (max_rendezvous_world_size), found " + std::to_string(o.world_size) +
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
  /// Connections are served concurrently: one that sends nothing (a port scanner, a health check)
  /// is dropped after detail::rdv::hello_timeout and delays no one.
  std::vector<std::vector<std::byte>> run(std::span<std::byte const> mine) {
    namespace rdv = detail::rdv;
    rdv::validate(opts_, true, mine.size());
    auto const n = static_cast<std::size_t>(opts_.world_size);
    auto const deadline = rdv::clock::now() + opts_.timeout;
    std::map<int, peer> peers;  // the ranks that said hello, allocated as they arrive
    peers.emplace(0, peer{rdv::fd_guard(), "rank 0", std::vector<std::byte>(mine.begin(), mine.end())});
    std::vector<pending> waiting;  // connections still sending their hello
    std::vector<std::string> ignored;

    while (peers.size() < n) {
      auto const now = rdv::clock::now();
      // Drop connections whose hello is overdue.
      for (std::size_t i = 0; i < waiting.size();) {
        if (waiting[i].hello_deadline <= now) {
          ignored.push_back(waiting[i].name + " (sent " + std::to_string(waiting[i].got) + " bytes of its hello in " +
                            std::to_string(rdv::hello_timeout.count()) + " s)");
          waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
      if (now >= deadline) fail_timeout(peers, ignored);
      auto wake = deadline;
      for (auto const& w : waiting) wake = std::min(wake, w.hello_deadline);
      std::vector<pollfd> fds;
      fds.push_back({listen_.get(), POLLIN, 0});
      for (auto const& w : waiting) fds.push_back({w.fd.get(), POLLIN, 0});
      int const left = std::max(1, rdv::ms_left(wake));
      if (::poll(fds.data(), static_cast<nfds_t>(fds.size()), left) <= 0) continue;
      // Hellos first (indices shift when one completes or fails), then new connections.
      for (std::size_t i = fds.size(); i-- > 1;) {
        if (fds[i].revents == 0) continue;
        pending& w = waiting[i - 1];
        std::string why;
        bool const done = read_hello(w, why);
        if (!why.empty()) {
          ignored.push_back(w.name + " (" + why + ")");
          waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i - 1));
          continue;
        }
        if (!done) continue;
        pending conn = std::move(w);
        waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i - 1));
        admit(peers, std::move(conn));
      }
      if ((fds[0].revents & POLLIN) != 0) accept_all(waiting, ignored);
    }

    std::vector<std::vector<std::byte>> blobs(n);
    for (auto& [r, p] : peers) blobs[static_cast<std::size_t>(r)] = std::move(p.blob);
    std::vector<std::byte> reply;
    rdv::put_u32(reply, rdv::magic);
    rdv::put_u32(reply, 0);
    rdv::put_u32(reply, static_cast<std::uint32_t>(n));
    for (auto const& b : blobs) rdv::put_bytes(reply, b);
    auto const send_deadline =
        rdv::clock::now() + std::min<std::chrono::milliseconds>(opts_.timeout, std::chrono::seconds(30));
    for (auto& [r, p] : peers) {
      if (r == 0) continue;
      std::string why;
      if (!rdv::send_all(p.fd.get(), reply.data(), reply.size(), send_deadline, why))
        throw comm_error(r, "dparallel: tcp_rendezvous on rank 0: could not send the result to rank " +
                                std::to_string(r) + " (" + p.from + "): " + why);
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

  struct peer {
    detail::rdv::fd_guard fd;
    std::string from;  // its address
    std::vector<std::byte> blob;
  };
  struct pending {
    pending(detail::rdv::fd_guard f, std::string n, detail::rdv::clock::time_point d)
        : fd(std::move(f)), name(std::move(n)), hello_deadline(d) {}
    detail::rdv::fd_guard fd;
    std::string name;
    detail::rdv::clock::time_point hello_deadline;
    unsigned char head[20] = {};  // magic, version, rank, world size, blob length
    std::size_t got = 0;          // bytes of the hello received
    std::vector<std::byte> blob;  // grows as the blob arrives
    [[nodiscard]] std::uint32_t field(int k) const noexcept {
      std::uint32_t be = 0;
      std::memcpy(&be, head + 4 * k, 4);
      return ntohl(be);
    }
  };

  void accept_all(std::vector<pending>& waiting, std::vector<std::string>& ignored) {
    namespace rdv = detail::rdv;
    for (;;) {
      sockaddr_storage sa{};
      socklen_t slen = sizeof sa;
      rdv::fd_guard conn(::accept(listen_.get(), reinterpret_cast<sockaddr*>(&sa), &slen));
      if (!conn.valid()) return;  // EAGAIN: none left (or a transient error: poll again)
      std::string name = rdv::peer_name(sa);
      if (waiting.size() >= rdv::max_pending) {
        ignored.push_back(name + " (more than " + std::to_string(rdv::max_pending) + " connections without a hello)");
        continue;
      }
      rdv::set_nonblocking(conn.get());
      waiting.emplace_back(std::move(conn), std::move(name), rdv::clock::now() + rdv::hello_timeout);
    }
  }

  // Reads what has arrived of a hello: true when it is complete; `why` set when the connection
  // does not speak the protocol or went away.
  static bool read_hello(pending& w, std::string& why) {
    namespace rdv = detail::rdv;
    for (;;) {
      std::size_t const head_size = sizeof w.head;
      std::size_t want = 0;
      void* dst = nullptr;
      if (w.got < head_size) {
        want = head_size - w.got;
        dst = w.head + w.got;
      } else {
        std::size_t const blob_len = w.field(4);
        std::size_t const have = w.got - head_size;
        if (have == blob_len) return true;
        want = std::min<std::size_t>(blob_len - have, 1 << 16);
        w.blob.resize(have + want);  // grows with what arrives, not with what is announced
        dst = w.blob.data() + have;
      }
      ssize_t const k = ::recv(w.fd.get(), dst, want, 0);
      if (k == 0) {
        why = "closed after " + std::to_string(w.got) + " bytes of its hello";
        return false;
      }
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          if (w.got >= head_size) w.blob.resize(w.got - head_size);
          return false;
        }
        why = rdv::errno_text(errno);
        return false;
      }
      std::size_t const before = w.got;
      w.got += static_cast<std::size_t>(k);
      if (before < 4 && w.got >= 4 && w.field(0) != rdv::magic) {
        why = "not a dparallel rendezvous hello";
        return false;
      }
      if (before < 8 && w.got >= 8 && w.field(1) != rdv::version) {
        why = "dparallel rendezvous protocol version " + std::to_string(w.field(1)) + ", expected " +
              std::to_string(rdv::version);
        return false;
      }
      if (before < head_size && w.got >= head_size && w.field(4) > rdv::max_blob) {
        why = "announced a blob of " + std::to_string(w.field(4)) + " bytes, more than the limit of " +
              std::to_string(rdv::max_blob);
        return false;
      }
    }
  }

  // A complete hello: checks it against the others (failing everyone on a conflict) and keeps it.
  void admit(std::map<int, peer>& peers, pending conn) {
    auto const r = static_cast<std::int32_t>(conn.field(2));
    auto const w = static_cast<std::int32_t>(conn.field(3));
    std::string const& name = conn.name;
    if (w != opts_.world_size)
      fail(peers, conn.fd, r, false,
           "rank " + std::to_string(r) + " (from " + name + ") was started with world size " + std::to_string(w) +
               ", but rank 0 with world size " + std::to_string(opts_.world_size) +
               ": every rank must be given the same WORLD_SIZE");
    if (r <= 0 || r >= opts_.world_size)
      fail(peers, conn.fd, r, false,
           r == 0 ? "a second rank 0 connected (from " + name +
                        "): rank 0 is the master itself; every rank needs a distinct RANK"
                  : "a peer (from " + name + ") announced rank " + std::to_string(r) + ", outside [1, " +
                        std::to_string(opts_.world_size) + "): check RANK and WORLD_SIZE");
    if (auto const it = peers.find(r); it != peers.end())
      fail(peers, conn.fd, r, false,
           "rank " + std::to_string(r) + " connected twice (from " + it->second.from + " and from " + name +
               "): every rank needs a distinct RANK below WORLD_SIZE=" + std::to_string(opts_.world_size));
    peers.emplace(r, peer{std::move(conn.fd), std::move(conn.name), std::move(conn.blob)});
  }

  [[noreturn]] void fail_timeout(std::map<int, peer>& peers, std::vector<std::string> const& ignored) {
    // Only ranks that never said hello are blamed; the ones here are waiting for them.
    std::vector<int> missing, present;
    int next = 0;
    for (auto const& [r, p] : peers) {
      for (; next < r && missing.size() < 16; ++next) missing.push_back(next);
      next = r + 1;
      present.push_back(r);
    }
    for (; next < opts_.world_size && missing.size() < 16; ++next) missing.push_back(next);
    std::size_t const absent = static_cast<std::size_t>(opts_.world_size) - peers.size();
    std::string text = ranks_text(missing);
    if (absent > missing.size()) text += " and " + std::to_string(absent - missing.size()) + " more";
    std::string here = present.size() <= 16 ? ranks_text(present) : std::to_string(present.size()) + " ranks";
    std::string msg = "rendezvous at " + where() + " timed out after " + std::to_string(opts_.timeout.count()) +
                      " ms: " + text + (absent == 1 ? " never connected (" : " never connected (") + here +
                      (present.size() == 1 ? " is" : " are") + " here). Start all " +
                      std::to_string(opts_.world_size) + " ranks with the same MASTER_ADDR and MASTER_PORT and "
                      "WORLD_SIZE=" + std::to_string(opts_.world_size) + ", or raise the timeout";
    if (!ignored.empty()) {
      msg += "; ignored " + std::to_string(ignored.size()) + " connection(s) that did not speak the protocol:";
      for (std::size_t i = 0; i < ignored.size() && i < 8; ++i) msg += " " + ignored[i];
      if (ignored.size() > 8) msg += " ...";
    }
    detail::rdv::fd_guard none;
    fail(peers, none, missing[0], true, msg);
  }

  // Tells every connected peer (and `extra`, the connection at fault), then throws on rank 0.
  [[noreturn]] void fail(std::map<int, peer>& peers, detail::rdv::fd_guard& extra, int culprit, bool timed_out,
                         std::string msg) {
    namespace rdv = detail::rdv;
    if (msg.size() > rdv::max_message) msg.resize(rdv::max_message);
    std::vector<std::byte> reply;
    rdv::put_u32(reply, rdv::magic);
    rdv::put_u32(reply, 1);
    rdv::put_u32(reply, static_cast<std::uint32_t>(culprit));
    rdv::put_u32(reply, timed_out ? 1 : 0);
    rdv::put_bytes(reply, std::as_bytes(std::span(msg.data(), msg.size())));
    auto const deadline = rdv::clock::now() + std::chrono::seconds(2);
    auto tell = [&](rdv::fd_guard const& fd) {
      std::string why;
      if (fd.valid()) rdv::send_all(fd.get(), reply.data(), reply.size(), deadline, why);
    };
    for (auto const& [r, p] : peers) tell(p.fd);
    tell(extra);
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
  auto const too_big = [&](char const* what, std::uint32_t len, std::uint32_t limit) {
    why = "it announced " + std::string(what) + " of " + std::to_string(len) + " bytes, more than the limit of " +
          std::to_string(limit) + " (is MASTER_PORT a dparallel rendezvous of the same version?)";
  };
  if (status != 0) {
    std::uint32_t culprit = 0, timed_out = 0, len = 0;
    if (!rdv::recv_u32(conn.get(), culprit, deadline, why) || !rdv::recv_u32(conn.get(), timed_out, deadline, why) ||
        !rdv::recv_u32(conn.get(), len, deadline, why))
      lost("reading the error of");
    if (len > rdv::max_message) {
      too_big("an error message", len, rdv::max_message);
      lost("reading the error of");
    }
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
  for (std::size_t r = 0; r < blobs.size(); ++r) {
    auto& b = blobs[r];
    std::uint32_t len = 0;
    if (!rdv::recv_u32(conn.get(), len, deadline, why)) lost("reading the answer of");
    if (len > rdv::max_blob) {
      too_big(("the blob of rank " + std::to_string(r)).c_str(), len, rdv::max_blob);
      lost("reading the answer of");
    }
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

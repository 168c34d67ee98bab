#pragma once
// rendezvous_server: rank 0's side of tcp_rendezvous (comm/rendezvous.hpp, where the protocol is
// described). It binds and listens when constructed, so the port is known (port 0: any free one)
// before a peer starts; run() serves every connection at once (poll), checks each hello and
// answers every peer with every rank's blob, or with the error that failed the rendezvous.

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/rendezvous_io.hpp>
#include <dparallel/comm/rendezvous_options.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>

#include <arpa/inet.h>
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
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

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
    auto const started = rdv::clock::now();
    auto const deadline = started + opts_.timeout;
    deadline_ = deadline;
    auto next_note = started + rdv::waiting_note_after;
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
      if (now >= next_note && next_note < deadline) {
        warn_to_stderr("tcp_rendezvous on rank 0 at " + where() + ": still waiting for " + absent_text(peers) +
                       " after " + std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - started).count()) +
                       " s (" + std::to_string(rdv::ms_left(deadline) / 1000) + " s left of the timeout)");
        next_note = deadline;  // once
      }
      auto wake = std::min(deadline, next_note);
      for (auto const& w : waiting) wake = std::min(wake, w.hello_deadline);
      std::vector<pollfd> fds;
      fds.push_back({listen_.get(), POLLIN, 0});
      // Within the budget of bytes held for unfinished hellos, every connection is read; past it,
      // only the ones still sending their fixed-size head (the others wait for room).
      bool const room = pending_bytes(waiting) < rdv::max_pending_bytes;
      for (auto const& w : waiting) fds.push_back({w.fd.get(), static_cast<short>(room || w.got < sizeof w.head ? POLLIN : 0), 0});
      int const left = std::max(1, rdv::ms_left(wake));
      if (::poll(fds.data(), static_cast<nfds_t>(fds.size()), left) <= 0) continue;
      // Hellos first (indices shift when one completes or fails), then new connections.
      for (std::size_t i = fds.size(); i-- > 1;) {
        if (fds[i].revents == 0) continue;
        pending& w = waiting[i - 1];
        std::string why;
        bool const done = read_hello(w, why, rdv::max_pending_bytes - std::min(rdv::max_pending_bytes, pending_bytes(waiting)));
        if (!why.empty()) {
          ignored.push_back(w.name + " (" + why + ")");
          waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i - 1));
          continue;
        }
        if (!done) continue;
        pending conn = std::move(w);
        waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i - 1));
        if (token_matches(conn, ignored)) admit(peers, std::move(conn));
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

  // The bytes of blobs held for connections that have not finished their hello.
  static std::size_t pending_bytes(std::vector<pending> const& waiting) noexcept {
    std::size_t total = 0;
    for (auto const& w : waiting) total += w.blob.size();
    return total;
  }

  // "rank 2" / "ranks 2, 5 and 7 (rank 0 and 1 more are here)": who has not said hello yet.
  [[nodiscard]] std::string absent_text(std::map<int, peer> const& peers) const {
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
    std::string const here = present.size() <= 16 ? ranks_text(present) : std::to_string(present.size()) + " ranks";
    return text + " (" + here + (present.size() == 1 ? " is" : " are") + " here)";
  }

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
  // At most `room` bytes of blob are read (the budget of all unfinished hellos).
  static bool read_hello(pending& w, std::string& why, std::size_t room = detail::rdv::max_hello_blob) {
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
        want = std::min<std::size_t>({blob_len - have, 1 << 16, room});
        if (want == 0) return false;  // no room: read on once other hellos finished or were dropped
        room -= want;
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
      if (before < head_size && w.got >= head_size && w.field(4) > rdv::max_hello_blob) {
        why = "announced a blob of " + std::to_string(w.field(4)) + " bytes, more than the limit of " +
              std::to_string(rdv::max_hello_blob);
        return false;
      }
    }
  }

  // A complete hello: checks it against the others (failing everyone on a conflict) and keeps it.
  // False (and the connection answered and dropped, the token never printed) when its hello does
  // not carry the job's token; otherwise strips the token from the blob.
  bool token_matches(pending& conn, std::vector<std::string>& ignored) const {
    namespace rdv = detail::rdv;
    std::uint32_t len = 0;
    bool ok = conn.blob.size() >= 4;
    if (ok) {
      std::uint32_t be = 0;
      std::memcpy(&be, conn.blob.data(), 4);
      len = ntohl(be);
      ok = len <= rdv::max_token && conn.blob.size() >= 4 + std::size_t{len};
    }
    if (ok) {
      // Compared in time independent of where the tokens differ.
      unsigned diff = len == opts_.token.size() ? 0u : 1u;
      for (std::size_t i = 0; i < len; ++i)
        diff |= static_cast<unsigned>(conn.blob[4 + i]) ^
                static_cast<unsigned char>(opts_.token.empty() ? 0 : opts_.token[i % opts_.token.size()]);
      ok = diff == 0;
    }
    if (ok) {
      conn.blob.erase(conn.blob.begin(), conn.blob.begin() + 4 + static_cast<std::ptrdiff_t>(len));
      return true;
    }
    std::string const msg = std::string("this connection's rendezvous token does not match rank 0's: every rank of "
                                        "the job must be given the same ") + rdv::token_variable;
    std::vector<std::byte> reply;
    rdv::put_u32(reply, rdv::magic);
    rdv::put_u32(reply, 1);
    rdv::put_u32(reply, 0);
    rdv::put_u32(reply, 0);
    rdv::put_bytes(reply, std::as_bytes(std::span(msg.data(), msg.size())));
    std::string why;
    rdv::send_all(conn.fd.get(), reply.data(), reply.size(), rdv::clock::now() + std::chrono::seconds(1), why);
    ignored.push_back(conn.name + " (a hello without the job's rendezvous token)");
    return false;
  }

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
    int first_missing = 0;
    while (peers.count(first_missing) != 0) ++first_missing;
    std::string msg = "rendezvous at " + where() + " timed out after " + std::to_string(opts_.timeout.count()) +
                      " ms: " + absent_text(peers);
    auto const never = msg.rfind(" (");
    msg.insert(never, " never connected");
    msg += ". Start all " + std::to_string(opts_.world_size) + " ranks with the same MASTER_ADDR and MASTER_PORT and "
           "WORLD_SIZE=" + std::to_string(opts_.world_size) + ", or raise the timeout";
    if (!ignored.empty()) {
      msg += "; ignored " + std::to_string(ignored.size()) + " connection(s) that did not speak the protocol:";
      for (std::size_t i = 0; i < ignored.size() && i < 8; ++i) msg += " " + ignored[i];
      if (ignored.size() > 8) msg += " ...";
    }
    detail::rdv::fd_guard none;
    fail(peers, none, first_missing, true, msg);
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
    if (!timed_out) {
      // The ranks that have not connected yet would otherwise retry until their timeout and then
      // say only that rank 0 cannot be reached: rank 0 answers them with this error as they come.
      std::vector<char> told(static_cast<std::size_t>(opts_.world_size), 0);
      told[0] = 1;
      for (auto const& [r, p] : peers) told[static_cast<std::size_t>(r)] = 1;
      if (culprit > 0 && culprit < opts_.world_size) told[static_cast<std::size_t>(culprit)] = 1;
      if (std::find(told.begin(), told.end(), 0) != told.end()) {
        warn_to_stderr("tcp_rendezvous on rank 0 failed: " + msg + ". Rank 0 answers the ranks still to come with "
                       "this error (for up to " + std::to_string(rdv::ms_left(deadline_) / 1000) + " s) before it throws");
        tell_latecomers(reply, told);
      }
    }
    if (timed_out) throw timeout_error(culprit, text);
    throw comm_error(culprit, text);
  }

  // After a failure: accepts the connections still to come until every rank was told or the
  // deadline, reads each hello (so that closing sends no reset) and answers it with `reply`.
  void tell_latecomers(std::vector<std::byte> const& reply, std::vector<char>& told) {
    namespace rdv = detail::rdv;
    std::vector<pending> waiting;
    std::vector<std::string> ignored;
    while (std::find(told.begin(), told.end(), 0) != told.end() && rdv::clock::now() < deadline_) {
      auto const now = rdv::clock::now();
      std::erase_if(waiting, [&](pending const& w) { return w.hello_deadline <= now; });
      std::vector<pollfd> fds;
      fds.push_back({listen_.get(), POLLIN, 0});
      bool const room = pending_bytes(waiting) < rdv::max_pending_bytes;
      for (auto const& w : waiting) fds.push_back({w.fd.get(), static_cast<short>(room || w.got < sizeof w.head ? POLLIN : 0), 0});
      auto wake = deadline_;
      for (auto const& w : waiting) wake = std::min(wake, w.hello_deadline);
      if (::poll(fds.data(), static_cast<nfds_t>(fds.size()), std::max(1, rdv::ms_left(wake))) <= 0) continue;
      for (std::size_t i = fds.size(); i-- > 1;) {
        if (fds[i].revents == 0) continue;
        pending& w = waiting[i - 1];
        std::string why;
        bool const done = read_hello(w, why, rdv::max_pending_bytes - std::min(rdv::max_pending_bytes, pending_bytes(waiting)));
        if (done && token_matches(w, ignored)) {
          auto const r = static_cast<std::int32_t>(w.field(2));
          std::string ignore;
          if (rdv::send_all(w.fd.get(), reply.data(), reply.size(), rdv::clock::now() + std::chrono::seconds(2), ignore) &&
              r > 0 && r < opts_.world_size)
            told[static_cast<std::size_t>(r)] = 1;
        }
        if (done || !why.empty()) waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(i - 1));
      }
      if ((fds[0].revents & POLLIN) != 0) accept_all(waiting, ignored);
    }
  }

  rendezvous_options opts_;
  detail::rdv::clock::time_point deadline_{};
  detail::rdv::fd_guard listen_;
  int port_ = 0;
};

DPARALLEL_NAMESPACE_END

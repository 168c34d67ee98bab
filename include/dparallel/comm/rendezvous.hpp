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
//   r -> 0: "DPRV", version, r, world size, length, then the token (length, bytes) and the blob
//   0 -> r: "DPRV", status 0, then world-size blobs (length, bytes), rank order
//        or "DPRV", status 1, the rank at fault, a timeout flag, the error message
// Rank 0 listens on every interface of MASTER_ADDR's address family at MASTER_PORT (as PyTorch's
// TCPStore does), accepts until all world size - 1 peers said hello or the timeout passed, and
// checks each hello: a peer with another world size, a rank outside [1, world size) and a rank
// that connects twice fail the whole rendezvous, and rank 0 sends its error to every connected
// peer, so all of them fail with the same message; after such a failure rank 0 keeps accepting
// and answers the ranks that connect later with that message, until every rank was told or the
// timeout passed. Peers retry connecting (rank 0 may start later) until the timeout, then fail
// with a timeout_error naming rank 0 and the last socket error. Either side says once on stderr,
// after 10 s, whom it still waits for. With a token (rendezvous_options::token, by default
// DPARALLEL_RENDEZVOUS_TOKEN), a hello without the same token is answered with an error and not
// counted; rank 0 never prints a token. Rank 0's error text is escaped (detail::printable) before
// a peer puts it in its exception.
// A connection that does not speak the protocol is dropped and does not count. Rank 0 serves all
// connections at once (poll): a connection that sends no hello (a port scanner, a health check)
// is dropped after 5 s without delaying the others, and on a timeout only the ranks that never
// said hello are blamed. The world size is at most max_rendezvous_world_size; rank 0 allocates
// per rank as ranks arrive, and holds at most detail::rdv::max_pending_bytes for all unfinished
// hellos together (past it, their blobs are read as others finish or are dropped). A peer that receives an announced length above the protocol's limits
// says what it read and the limit.
//
// Errors: invalid_argument for bad options (rank >= world size, port out of range, an address
// that does not resolve); timeout_error for a rank that never came (naming it) or a master that
// cannot be reached; comm_error for a wrong world size or duplicate rank (naming the peer).

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/rendezvous_io.hpp>
#include <dparallel/comm/rendezvous_options.hpp>
#include <dparallel/comm/rendezvous_server.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/detail/printable.hpp>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

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
  auto note_at = rdv::clock::now() + rdv::waiting_note_after;
  while (!conn.valid()) {
    if (auto const now = rdv::clock::now(); now >= note_at && rdv::ms_left(deadline) > 0) {
      warn_to_stderr("tcp_rendezvous on rank " + std::to_string(opts.rank) + ": still waiting for rank 0 at " +
                     rdv::where(opts) + " (last error: " + last_error + "; " +
                     std::to_string(rdv::ms_left(deadline) / 1000) + " s left of the timeout)");
      note_at = deadline;  // once
    }
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
  rdv::put_u32(hello, static_cast<std::uint32_t>(4 + opts.token.size() + mine.size()));  // the blob: token, then mine
  rdv::put_bytes(hello, std::as_bytes(std::span(opts.token.data(), opts.token.size())));
  hello.insert(hello.end(), mine.begin(), mine.end());
  std::string why;
  auto const lost = [&](std::string const& step) {
    if (why == "the connection was closed" || why == rdv::errno_text(ECONNRESET))
      why += " by rank 0 before it answered: its process ended (it died, was killed, or failed on its own: see "
             "rank 0's error)";
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
    // Escaped as file content is: the text comes from the network and must not act on a terminal.
    std::string const text = who + "rank 0 reported: " + detail::printable(msg, rdv::max_message);
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

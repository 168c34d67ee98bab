#pragma once
// Socket helpers of tcp_rendezvous (comm/rendezvous.hpp): an owning file descriptor, sends and
// receives bounded by a deadline, big-endian framing, address resolution and peer names.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace detail::rdv {

using clock = std::chrono::steady_clock;

inline std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

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

}  // namespace detail::rdv

DPARALLEL_NAMESPACE_END

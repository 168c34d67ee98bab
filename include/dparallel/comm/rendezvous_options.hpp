#pragma once
// What both sides of tcp_rendezvous (comm/rendezvous.hpp) share: where rank 0 listens and who is
// taking part (rendezvous_options), the protocol's constants and limits, and the check of the
// options that runs before any socket is opened.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

DPARALLEL_NAMESPACE_BEGIN

namespace detail::rdv {
/// The environment variable that holds the job's rendezvous token.
inline constexpr char const* token_variable = "DPARALLEL_RENDEZVOUS_TOKEN";
inline std::string token_from_environment() {
  char const* t = std::getenv(token_variable);
  return t == nullptr ? std::string() : std::string(t);
}
}  // namespace detail::rdv

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
  /// A secret every rank of the job shares (by default the environment variable
  /// DPARALLEL_RENDEZVOUS_TOKEN, read when the options are made): rank 0 admits only hellos that
  /// carry the same token, and never prints it. Empty (the default without the variable): any
  /// connection that says hello with a free rank is admitted and receives every rank's blob.
  std::string token = detail::rdv::token_from_environment();
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
/// Most bytes rank 0 holds for all unfinished hellos together (two blobs of the largest size):
/// past it, the connections sending blobs wait for room (hellos finish or are dropped after
/// hello_timeout), so connections that trickle large hellos cannot make rank 0 hold gigabytes.
inline constexpr std::size_t max_pending_bytes = std::size_t{128} << 20;
/// When a rendezvous that still waits for ranks says so (once) on stderr.
inline constexpr std::chrono::seconds waiting_note_after{10};

inline constexpr std::uint32_t magic = 0x44505256;  // "DPRV"
inline constexpr std::uint32_t version = 2;  // 2: the hello's blob starts with the token
inline constexpr std::uint32_t max_blob = 64u << 20;
inline constexpr std::uint32_t max_message = 1u << 16;
inline constexpr std::uint32_t max_token = 1u << 10;
/// Most bytes of a hello's blob on the wire: the token (length and bytes), then the blob.
inline constexpr std::uint32_t max_hello_blob = max_blob + 4 + max_token;

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
  if (o.token.size() > max_token)
    throw invalid_argument(who + "expected a rendezvous token (" + token_variable + ") of at most " +
                           std::to_string(max_token) + " bytes, found " + std::to_string(o.token.size()));
  if (blob_size > max_blob)
    throw invalid_argument(who + "expected a blob of at most " + std::to_string(max_blob) + " bytes, found " +
                           std::to_string(blob_size));
}

}  // namespace detail::rdv

DPARALLEL_NAMESPACE_END

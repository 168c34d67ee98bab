#pragma once
// The MPI engine's control channel and fault handling (see <dparallel/comm/mpi.hpp>, "Failures
// never hang"): point-to-point messages on a duplicate of the communicator carry ABORT notices,
// status queries after a timeout (whose answers name the rank at fault) and the EXIT handshake of
// failed groups. mpi_control_channel is the part of a communicator's state the progress thread
// uses for them; the state (mpi_comm_state) derives from it and supplies the two hooks.

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/mpi/detail/common.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {


inline constexpr int mpi_control_tag = 0x4450;
// closed: the sender's handle is gone after it issued the given number of collectives. Every rank
// sends it once and frees its communicators only after every live peer's has arrived (so that no
// message is left for a freed communicator whose context id MPI may give to a new one).
enum class mpi_msg : std::uint8_t { abort = 1, query = 2, status = 3, exit = 4, closed = 5 };

struct mpi_msg_writer {
  std::vector<std::byte> b;
  explicit mpi_msg_writer(mpi_msg type) { b.push_back(static_cast<std::byte>(type)); }
  mpi_msg_writer& u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
    return *this;
  }
  mpi_msg_writer& str(std::string const& s) {
    u64(s.size());
    for (char c : s) b.push_back(static_cast<std::byte>(c));
    return *this;
  }
};

struct mpi_msg_reader {
  std::vector<std::byte> const& b;
  std::size_t pos = 1;
  bool ok = true;
  std::uint64_t u64() {
    if (pos + 8 > b.size()) {
      ok = false;
      return 0;
    }
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(b[pos + static_cast<std::size_t>(i)]) << (8 * i);
    pos += 8;
    return v;
  }
  std::string str() {
    std::uint64_t const n = u64();
    if (!ok || n > b.size() - pos) {
      ok = false;
      return {};
    }
    std::string s(n, '\0');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(b[pos + i]);
    pos += n;
    return s;
  }
};

/// A peer's answer to a status query: where it stands in the sequence of collectives.
struct mpi_peer_status {
  std::uint64_t seq = 0, issued = 0, completed = 0;
  std::string at_seq, last, failure;
};

/// (P) The control channel of one communicator; every member runs on the progress thread.
class mpi_control_channel {
 public:
  mpi_control_channel(mpi_control_channel const&) = delete;
  mpi_control_channel& operator=(mpi_control_channel const&) = delete;

  [[nodiscard]] bool exit_done(mpi_clock::time_point now) const {
    if (!exiting_) return true;
    if (now >= exit_deadline_) return true;
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && !gone(j) && exit_from_[static_cast<std::size_t>(j)] == 0) return false;
    return true;
  }
  /// Whether every live peer's CLOSED has arrived (then the communicators may be freed).
  [[nodiscard]] bool close_done() const {
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && dead_[static_cast<std::size_t>(j)] == 0 && !closed_from_[static_cast<std::size_t>(j)])
        return false;
    return true;
  }

  /// After the handshake: whether this rank should call MPI_Abort itself, being the lowest rank
  /// among itself and the peers that said EXIT (the others wait to be ended by it, so that one
  /// rank, not all, reports the abort).
  [[nodiscard]] bool abort_leader() const {
    for (int j = 0; j < rank_; ++j)
      if (exit_from_[static_cast<std::size_t>(j)] != 0) return false;
    return true;
  }


 protected:
  explicit mpi_control_channel(mpi::options opts) : opts_(opts) {}
  virtual ~mpi_control_channel() = default;

  /// Fails the group with `f` (the first failure wins), telling the peers when `notify`.
  virtual void fail(mpi_failure f, bool notify) = 0;
  /// This rank's answer to a status query about collective `seq`.
  virtual mpi_peer_status status_for(std::uint64_t seq) = 0;

  void send_to(int dst, std::vector<std::byte> bytes) {
    sends_.push_back({std::move(bytes), MPI_REQUEST_NULL});
    auto& s = sends_.back();
    if (MPI_Isend(s.bytes.data(), static_cast<int>(s.bytes.size()), MPI_BYTE, dst, mpi_control_tag, control_,
                  &s.req) != MPI_SUCCESS)
      sends_.pop_back();  // the peer is unreachable: nothing more to do
  }
  void test_sends() {
    for (auto it = sends_.begin(); it != sends_.end();) {
      int flag = 0;
      if (MPI_Test(&it->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag != 0) it = sends_.erase(it);
      else ++it;
    }
  }

  // (P) Receives and handles every control message waiting.
  bool poll_control(mpi_clock::time_point now) {
    bool any = false;
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, mpi_control_tag, control_, &flag, &st) != MPI_SUCCESS || flag == 0) break;
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      std::vector<std::byte> buf(static_cast<std::size_t>(std::max(bytes, 0)));
      if (MPI_Recv(buf.data(), bytes, MPI_BYTE, st.MPI_SOURCE, mpi_control_tag, control_, MPI_STATUS_IGNORE) !=
          MPI_SUCCESS)
        break;
      any = true;
      if (!buf.empty()) handle(st.MPI_SOURCE, buf, now);
    }
    return any;
  }

  void handle(int from, std::vector<std::byte> const& buf, mpi_clock::time_point) {
    mpi_msg_reader in{buf};
    switch (static_cast<mpi_msg>(buf[0])) {
      case mpi_msg::abort: {
        auto const rank = static_cast<int>(in.u64());
        bool const timed_out = in.u64() != 0;
        std::string reason = in.str();
        if (in.ok) fail({rank, timed_out, std::move(reason)}, false);
        return;
      }
      case mpi_msg::query: {
        std::uint64_t const seq = in.u64();
        if (!in.ok) return;
        mpi_peer_status const s = status_for(seq);
        send_to(from, mpi_msg_writer(mpi_msg::status)
                          .u64(seq)
                          .u64(s.issued)
                          .u64(s.completed)
                          .str(s.at_seq)
                          .str(s.last)
                          .str(s.failure)
                          .b);
        return;
      }
      case mpi_msg::status: {
        mpi_peer_status s;
        s.seq = in.u64();
        s.issued = in.u64();
        s.completed = in.u64();
        s.at_seq = in.str();
        s.last = in.str();
        s.failure = in.str();
        if (in.ok && probe_.active && s.seq == probe_.seq) probe_.replies[from] = std::move(s);
        return;
      }
      case mpi_msg::closed: {
        std::uint64_t const issued = in.u64();
        if (in.ok && from >= 0 && from < size_) closed_from_[static_cast<std::size_t>(from)] = issued + 1;
        return;
      }
      case mpi_msg::exit: {
        bool const orphans = in.u64() != 0;
        if (in.ok && from >= 0 && from < size_) {
          exit_from_[static_cast<std::size_t>(from)] = 1;
          peer_orphans_ = peer_orphans_ || orphans;
        }
        return;
      }
    }
  }

  // (P) The running collective timed out: ask every peer where it is.
  void start_probe(std::uint64_t seq, comm_call const& call, std::chrono::milliseconds waited,
                   mpi_clock::time_point now) {
    probe_.active = true;
    probe_.seq = seq;
    probe_.call = call;
    probe_.waited = waited;
    probe_.deadline = now + opts_.probe_window;
    probe_.replies.clear();
    for (int j = 0; j < size_; ++j)
      if (j != rank_) send_to(j, mpi_msg_writer(mpi_msg::query).u64(probe_.seq).b);
  }

  // (P) Names the rank(s) at fault from the answers, fails the group and tells the peers.
  void conclude_probe() {
    std::vector<int> silent, behind, other_call, failed_peers, inside;
    std::vector<std::string> notes;
    std::string const mine = describe(probe_.call);
    std::string const seq = std::to_string(probe_.seq);
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      auto const it = probe_.replies.find(j);
      if (it == probe_.replies.end()) {
        silent.push_back(j);
        dead_[static_cast<std::size_t>(j)] = 1;
        continue;
      }
      mpi_peer_status const& s = it->second;
      std::string const rj = "rank " + std::to_string(j);
      if (!s.failure.empty()) {
        failed_peers.push_back(j);
        notes.push_back(rj + " had already failed: " + s.failure);
      } else if (s.issued < probe_.seq) {
        behind.push_back(j);
        notes.push_back(rj + " has issued only " + std::to_string(s.issued) + " collective" +
                        (s.issued == 1 ? "" : "s") + (s.last.empty() ? "" : " (the last: " + s.last + ")") +
                        ", so it never called #" + seq);
      } else if (!s.at_seq.empty() && s.at_seq != mine) {
        other_call.push_back(j);
        notes.push_back(rj + " called " + s.at_seq + " as #" + seq);
      } else {
        inside.push_back(j);
      }
    }
    if (!silent.empty())
      notes.insert(notes.begin(), describe_ranks(silent) + " did not answer a status query within " +
                                      std::to_string(opts_.probe_window.count()) +
                                      " ms: its process died or hangs outside dparallel");
    if (!inside.empty()) notes.push_back(describe_ranks(inside) + " called it too");
    int const culprit = !silent.empty()         ? silent[0]
                        : !behind.empty()       ? behind[0]
                        : !other_call.empty()   ? other_call[0]
                        : !failed_peers.empty() ? failed_peers[0]
                                                : rank_;
    std::string msg = "collective #" + seq + " (" + mine + ") did not complete within " +
                      std::to_string(probe_.waited.count()) + " ms on rank " + std::to_string(rank_);
    for (std::size_t k = 0; k < notes.size(); ++k) msg += (k == 0 ? ": " : "; ") + notes[k];
    if (notes.empty()) msg += " (no other rank)";
    msg += ". " + std::string(same_order_rule) +
           slow_rank_advice("rank " + std::to_string(culprit), true, "init_options::timeout, process_group::set_timeout");
    probe_.active = false;
    fail({culprit, true, std::move(msg)}, true);
  }

  struct probe_state {
    bool active = false;
    std::uint64_t seq = 0;
    comm_call call;
    std::chrono::milliseconds waited{};
    mpi_clock::time_point deadline;
    std::map<int, mpi_peer_status> replies;
  };
  struct pending_send {
    std::vector<std::byte> bytes;
    MPI_Request req;
  };

  mpi::options opts_;
  int rank_ = 0;
  int size_ = 1;
  MPI_Comm data_ = MPI_COMM_NULL;
  MPI_Comm control_ = MPI_COMM_NULL;
  std::list<pending_send> sends_;
  probe_state probe_;
  std::vector<char> dead_;
  std::vector<char> exit_from_;
  // Per peer: 0 until its CLOSED arrived, then 1 + the number of collectives it had issued.
  std::vector<std::uint64_t> closed_from_;
  /// Whether peer j is known dead or has closed its communicator: it reads no message any more.
  [[nodiscard]] bool gone(int j) const {
    return dead_[static_cast<std::size_t>(j)] != 0 || closed_from_[static_cast<std::size_t>(j)] != 0;
  }
  bool peer_orphans_ = false;
  bool exiting_ = false;
  mpi_clock::time_point exit_deadline_;
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

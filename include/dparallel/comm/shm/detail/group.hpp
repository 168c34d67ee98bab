#pragma once
// One rank's view of a shared-memory process group (see <dparallel/comm/shm.hpp>): the meeting
// points (barriers over the ranks' step counters in the segment), the group's sticky failure, and
// the checks every wait makes while it waits: the failure word, a rank that closed, a rank whose
// process is gone, the timeout.
//
// Barriers. Each rank counts the barriers it has arrived at (its slot's `step`). Arriving at
// barrier k stores k (release), bumps the header's epoch and wakes the sleepers; waiting for
// barrier k returns once every rank's step is >= k (acquire), so whatever a rank wrote into the
// segment before it arrived is visible to every rank that passed. A waiter spins within the spin
// budget (core/spin.hpp), then sleeps on the epoch with a futex, waking at least every few
// milliseconds to look for peers whose process has died.
//
// Failure. The first failure wins: a rank takes the failure word (0 -> 1), writes the rank at
// fault and the reason, then publishes it (2). It fails every pending and future collective of
// every rank; a failed group stays failed.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/shm/detail/arena.hpp>
#include <dparallel/comm/shm/detail/segment.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/spin.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

class shm_group {
 public:
  using clock = std::chrono::steady_clock;
  static constexpr std::uint64_t open = std::numeric_limits<std::uint64_t>::max();

  shm_group(std::unique_ptr<shm_segment> seg, int rank)
      : seg_(std::move(seg)),
        rank_(rank),
        n_(seg_->layout().n),
        arena_(*seg_, seg_->layout().arena_at(rank), seg_->layout().arena) {}
  shm_group(shm_group const&) = delete;
  shm_group& operator=(shm_group const&) = delete;
  ~shm_group() {
    if (on_release_ && failed()) on_release_(*this);
  }

  /// Called when the group is destroyed after it failed (the MPI switch: a failure that may keep
  /// a peer out of MPI_Finalize ends the job with MPI_Abort). Set before the group is shared.
  void on_failed_release(std::function<void(shm_group const&)> f) { on_release_ = std::move(f); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return n_; }
  [[nodiscard]] shm_segment& segment() const noexcept { return *seg_; }
  /// This rank's group memory (process_group::allocate).
  [[nodiscard]] shm_arena& arena() noexcept { return arena_; }
  [[nodiscard]] shm_arena const& arena() const noexcept { return arena_; }

  /// A subgroup's members in its parent (named in its errors); set before its first collective.
  void set_parent_ranks(std::vector<int> ranks) { parent_ranks_ = std::move(ranks); }

  /// Set-up: counts this rank in, then waits until every rank has mapped the segment (the last
  /// one unlinks its name). Throws timeout_error naming the ranks that never mapped it, or the
  /// group's failure; the name is unlinked either way.
  void join(std::chrono::milliseconds timeout) {
    seg_->slot(rank_).pidns = pidns_;
    seg_->slot(rank_).holds_lock = seg_->hold_liveness_lock(rank_) ? 1 : 0;
    shm_word(seg_->slot(rank_).pid).store(::getpid(), std::memory_order_release);
    auto const was = shm_word(seg_->header().mapped).fetch_add(1, std::memory_order_acq_rel);
    if (was + 1 == static_cast<std::uint64_t>(n_)) seg_->unlink();
    notify();
    auto const all_mapped = [&] {
      return shm_word(seg_->header().mapped).load(std::memory_order_acquire) >= static_cast<std::uint64_t>(n_);
    };
    auto const unmapped = [&] {
      std::vector<int> missing;
      for (int j = 0; j < n_; ++j)
        if (shm_word(seg_->slot(j).pid).load(std::memory_order_acquire) == 0) missing.push_back(j);
      if (missing.empty()) missing.push_back(rank_);
      return missing;
    };
    auto const deadline = deadline_after(timeout);
    // A rank missing for a while is said once on stderr, well before the timeout names it.
    auto const note_at = clock::now() + std::chrono::seconds(10);
    bool noted = false;
    bool ok = note_at < deadline && wait_for(all_mapped, note_at, [&] { noted = true; });
    if (!ok && noted && !failed()) {
      warn_to_stderr("shm: rank " + std::to_string(rank_) + " is still waiting for " + describe_ranks(unmapped()) +
                     " to map shared-memory segment " + seg_->name() + " (" + std::to_string(n_) + " ranks; " +
                     std::to_string(std::chrono::duration_cast<std::chrono::seconds>(deadline - clock::now()).count()) +
                     " s left of the timeout)");
    }
    if (!ok && !failed()) ok = wait_for(all_mapped, deadline, [&] {
      std::vector<int> const missing = unmapped();
      std::string const who = describe_ranks(missing);
      set_failure(missing[0], shm_fail_cause::timeout,
                  who + " did not map shared-memory segment " + seg_->name() +
                      " within " + std::to_string(timeout.count()) + " ms (rank " + std::to_string(rank_) +
                      " waited for it while setting up the group); every rank must create its group, and a rank "
                      "that is only slow needs a longer timeout");
    });
    if (ok) {
      seg_->disown();  // unlinked by the last rank to map it
      return;
    }
    seg_->unlink();
    auto const f = failure();
    std::string const msg = "dparallel: shm: rank " + std::to_string(rank_) + ": setting up the group failed: " + f.reason;
    if (f.timeout) throw timeout_error(f.rank, msg);
    throw comm_error(f.rank, msg);
  }

  /// Arrives at the next barrier of this rank and waits for every rank to arrive; false when the
  /// group failed (then failure() says why). `seq` and `call` name the collective in errors.
  bool barrier(std::uint64_t seq, comm_call const& call, std::chrono::milliseconds timeout) {
    std::uint64_t const k = ++step_;
    shm_word(seg_->slot(rank_).step).store(k, std::memory_order_release);
    notify();
    auto const arrived = [&] {
      for (int j = 0; j < n_; ++j)
        if (shm_word(seg_->slot(j).step).load(std::memory_order_acquire) < k) return false;
      return true;
    };
    return wait_for(arrived, deadline_after(timeout), [&] { fail_arrival(k, seq, call, timeout); }, seq);
  }

  /// Publishes this rank's descriptor of collective `seq` (before its first barrier); `where`: the
  /// offset of its buffer in its group memory, for the peers to use in place (0: none).
  void publish(std::uint64_t seq, comm_call const& c, std::size_t where = 0) {
    seg_->slot(rank_).calls[seq % 2] = shm_call_record{seq,
                                                       c.count,
                                                       c.total,
                                                       where,
                                                       c.root,
                                                       static_cast<std::uint8_t>(c.kind),
                                                       static_cast<std::uint8_t>(c.type),
                                                       static_cast<std::uint8_t>(c.op),
                                                       0};
  }

  /// After the first barrier of `seq`: rank j's buffer when it published one in its group memory
  /// (of `bytes` bytes, checked to lie in j's region), else null.
  [[nodiscard]] std::byte* buffer_of(int j, std::uint64_t seq, std::size_t bytes) const noexcept {
    auto const at = static_cast<std::size_t>(seg_->slot(j).calls[seq % 2].where);
    auto const& L = seg_->layout();
    if (at == 0 || at < L.arena_at(j) || at + bytes > L.arena_at(j + 1)) return nullptr;
    return seg_->at(at);
  }

  /// After the first barrier of `seq`: every rank compares every descriptor with rank 0's and
  /// fails the group alike when one differs. False on a mismatch.
  bool check(std::uint64_t seq) {
    comm_call const first = call_of(0, seq);
    for (int j = 1; j < n_; ++j) {
      comm_call const other = call_of(j, seq);
      if (!matches(first, other)) {
        set_failure(j, shm_fail_cause::reported, mismatch_reason(seq, first, j, other));
        return false;
      }
    }
    return true;
  }

  /// Fails the group (unless it failed already), naming `rank`.
  void abort(int rank, std::string const& why) {
    set_failure(rank, shm_fail_cause::reported, "rank " + std::to_string(rank) + " aborted the process group: " + why);
  }

  /// This rank issues no collective after `last_seq`.
  void close(std::uint64_t last_seq) {
    shm_word(seg_->slot(rank_).closed).store(last_seq, std::memory_order_release);
    notify();
  }

  [[nodiscard]] bool failed() const { return shm_word(seg_->header().fail_state).load(std::memory_order_acquire) != 0; }

  /// The group's failure (call when failed()).
  [[nodiscard]] comm_failure failure() const { return failure_and_cause().first; }

  /// The group's failure and its cause (call when failed()); a rank that died while it reported
  /// the failure counts as died.
  [[nodiscard]] std::pair<comm_failure, shm_fail_cause> failure_and_cause() const {
    shm_header& h = seg_->header();
    // The writer publishes within microseconds; one that died while writing leaves state 1.
    spin_until([&] { return shm_word(h.fail_state).load(std::memory_order_acquire) == 2; });
    auto const until = clock::now() + std::chrono::milliseconds(200);
    while (shm_word(h.fail_state).load(std::memory_order_acquire) != 2 && clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (shm_word(h.fail_state).load(std::memory_order_acquire) != 2)
      return {{0, false, "a rank died while it reported a failure of the process group"}, shm_fail_cause::died};
    char text[shm_reason_bytes];
    std::memcpy(text, h.fail_reason, sizeof text);
    text[sizeof text - 1] = '\0';
    auto const cause = static_cast<shm_fail_cause>(h.fail_cause);
    return {{h.fail_rank, cause == shm_fail_cause::timeout, text}, cause};
  }

  [[nodiscard]] std::exception_ptr error(std::uint64_t seq, comm_call const& call) const {
    return collective_error(rank_, describe(call), seq, subgroup_failure(failure(), parent_ranks_));
  }

 private:
  [[nodiscard]] comm_call call_of(int j, std::uint64_t seq) const {
    shm_call_record const& r = seg_->slot(j).calls[seq % 2];
    comm_call c;
    c.kind = static_cast<comm_kind>(r.kind);
    c.type = static_cast<dtype>(r.type);
    c.count = r.count;
    c.total = r.total;
    c.op = static_cast<reduce_op>(r.op);
    c.root = r.root;
    return c;
  }

  void notify() {
    shm_header& h = seg_->header();
    shm_word(h.epoch).fetch_add(1, std::memory_order_seq_cst);
    if (shm_word(h.sleepers).load(std::memory_order_seq_cst) != 0) shm_futex_wake_all(h.epoch);
  }

  void set_failure(int rank, shm_fail_cause cause, std::string const& reason) {
    shm_header& h = seg_->header();
    std::uint32_t expected = 0;
    if (!shm_word(h.fail_state).compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return;
    h.fail_rank = rank;
    h.fail_cause = static_cast<std::uint32_t>(cause);
    std::size_t const len = std::min(reason.size(), shm_reason_bytes - 1);
    std::memcpy(h.fail_reason, reason.data(), len);
    h.fail_reason[len] = '\0';
    shm_word(h.fail_state).store(2, std::memory_order_release);
    notify();
  }

  // Waits until ready() (true), or the group failed, or the deadline, a closed rank or a dead
  // process failed it (false; on_timeout() names the late ranks when nothing else explains it).
  template <class Ready, class OnTimeout>
  bool wait_for(Ready ready, clock::time_point deadline, OnTimeout on_timeout, std::uint64_t seq = 0) {
    shm_header& h = seg_->header();
    auto const settled = [&] { return ready() || failed(); };
    // Five times the spin budget (100 us by default): a process asleep on the futex wakes slower
    // than a thread on a condition variable of its own process (DDP over 2 processes on the
    // reference workload, gradients in group memory: 87.2k samples/s waiting 20 us, 89.0k waiting
    // 100 us, 88.8k waiting 500 us; thread ranks gain nothing from spinning longer).
    if (!spin_until(settled, 5 * spin_budget())) {
      auto next_check = clock::now();
      for (;;) {
        std::uint32_t const seen = shm_word(h.epoch).load(std::memory_order_seq_cst);
        shm_word(h.sleepers).fetch_add(1, std::memory_order_seq_cst);
        bool const done = settled();
        if (!done) shm_futex_wait(h.epoch, seen, std::chrono::milliseconds(2));
        shm_word(h.sleepers).fetch_sub(1, std::memory_order_seq_cst);
        if (done || settled()) break;
        auto const now = clock::now();
        if (now >= next_check) {
          if (peers_gone(seq)) break;
          next_check = now + std::chrono::milliseconds(5);
        }
        if (now >= deadline) {
          on_timeout();
          break;
        }
      }
    }
    if (ready()) return true;
    return false;
  }

  // A peer that closed before `seq` or whose process is gone: fails the group naming it.
  bool peers_gone(std::uint64_t seq) {
    for (int j = 0; j < n_; ++j) {
      if (j == rank_) continue;
      shm_rank_slot& s = seg_->slot(j);
      if (seq != 0) {
        auto const closed = shm_word(s.closed).load(std::memory_order_acquire);
        if (closed < seq) {
          set_failure(j, shm_fail_cause::reported,
                      finished_reason(j, "its process_group was destroyed or closed", closed, seq, rank_, ""));
          return true;
        }
      }
      auto const pid = shm_word(s.pid).load(std::memory_order_acquire);
      // A process of this PID namespace is probed by its id, one of another namespace by its
      // liveness lock (Liveness in shm/detail/segment.hpp); its pidns and lock were written before
      // its pid.
      if (pid == 0) continue;
      bool const here = s.pidns == pidns_;
      if (here ? process_gone(pid) : s.holds_lock == 1 && seg_->liveness_lock_released(j)) {
        set_failure(j, shm_fail_cause::died,
                    "rank " + std::to_string(j) + " (process " + std::to_string(pid) +
                        (here ? "" : " of another PID namespace") +
                        ") died or exited while the group was in use (rank " + std::to_string(rank_) +
                        " found it gone while it waited" +
                        (seq != 0 ? " in collective #" + std::to_string(seq) : std::string()) + ")");
        return true;
      }
    }
    return false;
  }

  void fail_arrival(std::uint64_t k, std::uint64_t seq, comm_call const& call, std::chrono::milliseconds timeout) {
    std::vector<int> missing;
    std::vector<int> present;
    for (int j = 0; j < n_; ++j)
      (shm_word(seg_->slot(j).step).load(std::memory_order_acquire) < k ? missing : present).push_back(j);
    if (missing.empty()) missing.push_back(rank_);
    set_failure(missing[0], shm_fail_cause::timeout,
                timeout_reason(missing, present, "did not reach collective #" + std::to_string(seq) + " (or its next step)",
                               "had reached it", timeout, rank_, call, "process_group::set_timeout"));
  }

  std::unique_ptr<shm_segment> seg_;
  int rank_;
  int n_;
  std::function<void(shm_group const&)> on_release_;
  std::vector<int> parent_ranks_;  // a subgroup's members in its parent; empty otherwise
  std::uint64_t step_ = 0;  // the communication thread's only
  std::uint64_t const pidns_ = pid_namespace_id();
  shm_arena arena_;
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// The state the thread ranks of one host process group share, and the protocol by which each
// rank's communication thread runs a collective over the other ranks' buffers in place.
//
// Protocol for the collective with sequence number `seq` (1, 2, ...), run by rank r's thread:
//  1. arrive: under the group mutex, publish (seq, the call, the buffers) and wait until every
//     rank has published `seq` (or the group failed, or a rank closed before `seq`, or the
//     timeout passed: then the group fails with a timeout_error naming the missing ranks);
//  2. check: every rank compares all calls with rank 0's; a difference fails the group with an
//     error showing both calls (every rank sees the same calls, so every rank fails);
//  3. compute: outside the mutex, rank r handles its stripes of every rank's buffers
//     (for_each_stripe: stripes of 64 KiB or more dealt out round robin);
//  4. depart: publish `seq` as done and wait until every rank has; only then is the work done,
//     so no rank reuses or releases a buffer another rank may still read or write.
// One published record per rank suffices: a rank can publish seq+1 only after every rank has
// departed seq, i.e. after every rank is done reading the records of seq (and once the group has
// failed, nobody publishes anything).
//
// Small messages (at most small_collective_bytes per rank) take a shorter path with one meeting
// instead of two: the rank that arrives last checks the calls, computes every rank's slice itself
// (the same arithmetic, element by element, as the ranks would: the same bits) and departs for
// everyone; the others only wait for that. Waking a thread costs more than moving a few KiB, so
// saving one meeting (one wake-up per rank) cuts the latency of a small collective. Whether a call is small depends only on what
// must match across ranks (kind, dtype, count), so matching calls take the same path, and a
// mismatch is caught on either path when the last rank arrives.
//
// Failure (abort, timeout, mismatch) is sticky: it fails every pending and future collective of
// every rank. A rank that fails a collective first waits until no rank is inside step 3, so no
// thread touches a buffer after a work that covers it has completed, failed or not.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/coalesced.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/detail/subgroup_plan.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/spin.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// The shared state of one host process group of `size()` thread ranks.
class host_group {
 public:
  using clock = std::chrono::steady_clock;
  static constexpr std::uint64_t open = std::numeric_limits<std::uint64_t>::max();

  /// `parent_ranks`: a subgroup's members in its parent (named in its errors); empty otherwise.
  explicit host_group(int world_size, std::vector<int> parent_ranks = {})
      : n_(world_size),
        parent_ranks_(std::move(parent_ranks)),
        posted_(static_cast<std::size_t>(world_size), 0),
        departed_(static_cast<std::size_t>(world_size), 0),
        closed_(static_cast<std::size_t>(world_size), open),
        busy_(static_cast<std::size_t>(world_size), 0),
        calls_(static_cast<std::size_t>(world_size)),
        bufs_(static_cast<std::size_t>(world_size)),
        lists_(static_cast<std::size_t>(world_size)) {}
  host_group(host_group const&) = delete;
  host_group& operator=(host_group const&) = delete;

  [[nodiscard]] int size() const noexcept { return n_; }

  /// Per-rank message size (bytes) up to which a collective takes the one-meeting path.
  static constexpr std::size_t small_collective_bytes = std::size_t{64} << 10;

  /// Runs rank r's collective number `seq` (steps 1-4 above); returns its failure or null.
  /// `list`: a *_coalesced call's tensors (call.parts of them), read in place of `a`
  /// (all_reduce, all_gather) or `b` (reduce_scatter).
  std::exception_ptr execute(int r, std::uint64_t seq, comm_call const& call, tensor_ref a, tensor_ref b,
                             std::chrono::milliseconds timeout, std::span<tensor_ref const> list = {}) {
    auto const ur = static_cast<std::size_t>(r);
    std::unique_lock lock(m_);
    if (failure_) return error_for(r, seq, call);

    // 1. arrive
    posted_[ur] = seq;
    calls_[ur] = call;
    bufs_[ur] = {a, b};
    lists_[ur] = list;
    auto const arrived = [&] { return all_reached(posted_, seq); };
    if (call.count * size_of(call.type) <= small_collective_bytes) return execute_small(lock, r, seq, call, timeout);
    notify();
    wait_until(lock, deadline_after(timeout),
               [&] { return failure_.has_value() || arrived() || first_closed_before(seq) >= 0; });
    if (!failure_) {
      if (!arrived()) {
        fail_arrival(r, seq, call, timeout);
      } else {
        check_match(seq);  // 2. check
      }
    }
    if (failure_) return give_up(lock, r, seq, call);

    // 3. compute. The records cannot change before every rank has departed (step 4), so they
    // are read in place, outside the mutex.
    if (!compute_unlocked(lock, r, call, r, r + 1)) return give_up(lock, r, seq, call);

    // 4. depart
    departed_[ur] = seq;
    notify();
    auto const departed = [&] { return all_reached(departed_, seq); };
    wait_until(lock, deadline_after(timeout), [&] { return failure_.has_value() || departed(); });
    if (departed()) return nullptr;  // complete on every rank, even if the group failed meanwhile
    if (!failure_) fail_timeout(r, seq, call, timeout, departed_, false);
    return give_up(lock, r, seq, call);
  }

  /// Fails every pending and future collective of every rank, naming `rank` and `why`.
  void abort(int rank, std::string const& why) {
    std::lock_guard lock(m_);
    set_failure(rank, false, "rank " + std::to_string(rank) + " aborted the process group: " + why);
  }

  /// The subgroup `index` of split number `id` of this group, whose members (parent ranks, in
  /// group order) are `members`: made by the first member to ask, shared with the others.
  std::shared_ptr<host_group> subgroup(std::uint64_t id, int index, std::vector<int> const& members) {
    std::lock_guard lock(m_);
    auto const key = std::pair(id, index);
    auto& entry = subgroups_[key];
    if (!entry.first) {
      entry.first = std::make_shared<host_group>(static_cast<int>(members.size()), members);
      entry.second = members.size();
    }
    auto g = entry.first;
    if (--entry.second == 0) subgroups_.erase(key);  // every member has it
    return g;
  }

  /// Rank `rank` will issue no collective after number `last_seq`: ranks that wait for it at a
  /// later one fail at once instead of at the timeout.
  void close(int rank, std::uint64_t last_seq) {
    {
      std::lock_guard lock(m_);
      closed_[static_cast<std::size_t>(rank)] = last_seq;
    }
    notify();
  }

 private:
  // The one-meeting path of a small collective (see the top of this file); `lock` is held and
  // rank r has published its record.
  std::exception_ptr execute_small(std::unique_lock<std::mutex>& lock, int r, std::uint64_t seq,
                                   comm_call const& call, std::chrono::milliseconds timeout) {
    auto const ur = static_cast<std::size_t>(r);
    if (all_reached(posted_, seq)) {  // the last to arrive: check, compute for all, depart for all
      check_match(seq);
      if (failure_) return give_up(lock, r, seq, call);
      if (!compute_unlocked(lock, r, call, 0, n_)) return give_up(lock, r, seq, call);
      std::fill(departed_.begin(), departed_.end(), seq);
      notify();
      return nullptr;
    }
    // Everyone else waits for the last one to finish: first for the peers to arrive, then (when
    // they all have) for the last one's computation, each with the timeout.
    auto const done = [&] { return departed_[ur] >= seq; };
    auto const arrived = [&] { return all_reached(posted_, seq); };
    wait_until(lock, deadline_after(timeout),
               [&] { return failure_.has_value() || done() || first_closed_before(seq) >= 0; });
    if (done()) return nullptr;
    if (!failure_ && arrived()) {
      wait_until(lock, deadline_after(timeout), [&] { return failure_.has_value() || done(); });
      if (done()) return nullptr;
      if (!failure_) fail_timeout(r, seq, call, timeout, departed_, false);
    }
    if (!failure_) fail_arrival(r, seq, call, timeout);
    std::exception_ptr e = give_up(lock, r, seq, call);
    return done() ? nullptr : e;  // the last rank finished while the group failed: the work is done
  }

  // Computes rank `first`..`last - 1`'s shares of the collective on rank r's thread, outside the
  // mutex (`lock` is released and taken back); false when that failed (the group then has failed).
  bool compute_unlocked(std::unique_lock<std::mutex>& lock, int r, comm_call const& call, int first, int last) {
    auto const ur = static_cast<std::size_t>(r);
    busy_[ur] = 1;
    lock.unlock();
    std::optional<std::string> compute_failure;  // nothing in compute() throws for valid calls
    try {
      for (int k = first; k < last; ++k) compute(k, call);
    } catch (std::exception const& e) {
      compute_failure = e.what();
    } catch (...) {
      compute_failure = "an exception not derived from std::exception";
    }
    lock.lock();
    busy_[ur] = 0;
    if (!compute_failure) return true;
    set_failure(r, false, "rank " + std::to_string(r) + " failed inside the collective: " + *compute_failure);
    return false;
  }

  // Wakes the waiters: every change of the shared state (made under the mutex) ends here.
  void notify() {
    epoch_.fetch_add(1, std::memory_order_release);
    cv_.notify_all();
  }

  // cv_.wait_until(lock, deadline, pred), spinning first (without the mutex) while the state
  // does not change, within the spin budget: a peer arriving soon is seen without a wake-up.
  template <class Pred>
  bool wait_until(std::unique_lock<std::mutex>& lock, clock::time_point deadline, Pred pred) {
    if (pred()) return true;
    auto const seen = epoch_.load(std::memory_order_relaxed);
    lock.unlock();
    bool const changed = spin_until([&] { return epoch_.load(std::memory_order_acquire) != seen; });
    lock.lock();
    if (changed && pred()) return true;
    return cv_.wait_until(lock, deadline, pred);
  }

  // Nobody failed the group, but not every rank arrived: a rank that closed, or a timeout.
  void fail_arrival(int r, std::uint64_t seq, comm_call const& call, std::chrono::milliseconds timeout) {
    int const j = first_closed_before(seq);
    if (j >= 0) {
      fail_closed(r, seq, call, j);
    } else {
      fail_timeout(r, seq, call, timeout, posted_, true);
    }
  }

  [[nodiscard]] bool all_reached(std::vector<std::uint64_t> const& v, std::uint64_t seq) const noexcept {
    return std::all_of(v.begin(), v.end(), [&](std::uint64_t s) { return s >= seq; });
  }
  [[nodiscard]] int first_closed_before(std::uint64_t seq) const noexcept {
    for (int j = 0; j < n_; ++j) {
      if (closed_[static_cast<std::size_t>(j)] < seq) return j;
    }
    return -1;
  }

  void set_failure(int rank, bool timeout, std::string reason) {
    if (!failure_) failure_ = comm_failure{rank, timeout, std::move(reason)};
    notify();
  }

  void fail_timeout(int r, std::uint64_t seq, comm_call const& call, std::chrono::milliseconds timeout,
                    std::vector<std::uint64_t> const& reached, bool arriving) {
    std::vector<int> missing;
    std::vector<int> present;
    for (int j = 0; j < n_; ++j) (reached[static_cast<std::size_t>(j)] < seq ? missing : present).push_back(j);
    if (missing.empty()) missing.push_back(r);  // cannot happen; keeps the message well-formed
    std::string const missed = (arriving ? "did not call" : "did not finish") + std::string(" collective #") +
                               std::to_string(seq);
    set_failure(missing[0], true,
                timeout_reason(missing, present, missed, arriving ? "had called it" : "had finished it", timeout, r,
                               call, "process_group::set_timeout, spawn_options::timeout"));
  }

  void fail_closed(int r, std::uint64_t seq, comm_call const& call, int j) {
    auto const issued = closed_[static_cast<std::size_t>(j)];
    // A known cause, found at once: comm_error (timeout_error is for a wait that ran out).
    set_failure(j, false,
                finished_reason(j, "its spawn function returned or its process_group was destroyed", issued, seq, r,
                                " in " + describe(call)));
  }

  void check_match(std::uint64_t seq) {
    for (int j = 1; j < n_; ++j) {
      if (!matches(calls_[0], calls_[static_cast<std::size_t>(j)])) {
        set_failure(j, false, mismatch_reason(seq, calls_[0], j, calls_[static_cast<std::size_t>(j)]));
        return;
      }
    }
  }

  /// Waits until no rank is inside a compute step, then builds rank r's error (lock held).
  std::exception_ptr give_up(std::unique_lock<std::mutex>& lock, int r, std::uint64_t seq, comm_call const& call) {
    cv_.wait(lock, [&] { return std::none_of(busy_.begin(), busy_.end(), [](char b) { return b != 0; }); });
    return error_for(r, seq, call);
  }

  [[nodiscard]] std::exception_ptr error_for(int r, std::uint64_t seq, comm_call const& call) const {
    return collective_error(r, describe(call), seq, subgroup_failure(*failure_, parent_ranks_));
  }

  /// Step 3 for rank r: its share of the collective, over every rank's buffers (the published
  /// records) in place. Allocates nothing for groups of up to 16 ranks.
  void compute(int r, comm_call const& call) const {
    std::size_t const esz = size_of(call.type);
    auto const at = [&](int j, int which, std::size_t elem) {
      return static_cast<char*>(bufs_[static_cast<std::size_t>(j)][static_cast<std::size_t>(which)].data()) +
             elem * esz;
    };
    constexpr int inline_ranks = 16;
    void const* src_inline[inline_ranks];
    void* dst_inline[inline_ranks];
    std::vector<void const*> src_heap;
    std::vector<void*> dst_heap;
    void const** srcs = src_inline;
    void** dsts = dst_inline;
    if (n_ > inline_ranks) {
      src_heap.resize(static_cast<std::size_t>(n_));
      dst_heap.resize(static_cast<std::size_t>(n_));
      srcs = src_heap.data();
      dsts = dst_heap.data();
    }
    auto const nn = static_cast<std::size_t>(n_);
    switch (call.kind) {
      case comm_kind::all_reduce:
        if (any_listed()) {
          compute_coalesced(r, call, srcs, dsts);
          return;
        }
        [[fallthrough]];
      case comm_kind::reduce: {
        for_each_stripe(call.count, n_, r, esz, [&](std::size_t lo, std::size_t hi) {
          for (int j = 0; j < n_; ++j) srcs[j] = at(j, 0, lo);
          std::size_t nd = 0;
          if (call.kind == comm_kind::reduce) {
            dsts[nd++] = at(call.root, 0, lo);
          } else {
            for (int j = 0; j < n_; ++j) dsts[nd++] = at(j, 0, lo);
          }
          reduce_bytes(call.type, std::span<void const* const>(srcs, nn), std::span<void* const>(dsts, nd), hi - lo,
                       call.op, n_);
        });
        return;
      }
      case comm_kind::broadcast: {
        for_each_stripe(call.count, n_, r, esz, [&](std::size_t lo, std::size_t hi) {
          char const* src = at(call.root, 0, lo);
          for (int j = 0; j < n_; ++j) {
            if (j != call.root) std::memcpy(at(j, 0, lo), src, (hi - lo) * esz);
          }
        });
        return;
      }
      case comm_kind::reduce_scatter:
        if (call.count != 0) compute_scatter(r, call, srcs, dsts);
        return;
      case comm_kind::all_gather:
        if (call.count != 0) compute_gather(r, call);
        return;
      case comm_kind::barrier: return;
    }
  }

  // Whether some rank passed a list of tensors (a *_coalesced call).
  [[nodiscard]] bool any_listed() const noexcept {
    return std::any_of(calls_.begin(), calls_.end(), [](comm_call const& c) { return c.parts != 0; });
  }

  // Rank j's array as a cursor: its list, or its buffer `which` (0: a, 1: b).
  [[nodiscard]] coalesced_cursor array_of(std::size_t j, int which, std::size_t esz) const noexcept {
    if (calls_[j].parts != 0) return coalesced_cursor(lists_[j], esz);
    return coalesced_cursor(std::span<tensor_ref const>(&bufs_[j][static_cast<std::size_t>(which)], 1), esz);
  }

  // One cursor per rank over its array `which`, without allocating for groups of up to 16 ranks.
  struct rank_cursors {
    std::array<coalesced_cursor, 16> inline_{};
    std::vector<coalesced_cursor> heap_;
    coalesced_cursor* at = nullptr;
  };
  void cursors_over(rank_cursors& c, int which, std::size_t esz) const {
    auto const nn = static_cast<std::size_t>(n_);
    c.at = c.inline_.data();
    if (nn > c.inline_.size()) {
      c.heap_.resize(nn);
      c.at = c.heap_.data();
    }
    for (std::size_t j = 0; j < nn; ++j) c.at[j] = array_of(j, which, esz);
  }

  /// compute() for an all_reduce in which some rank passed a list of tensors
  /// (all_reduce_coalesced): rank r's stripes of the array, in pieces that lie within one tensor
  /// on every rank, each summed in rank order as all_reduce sums (the same bits).
  void compute_coalesced(int r, comm_call const& call, void const** srcs, void** dsts) const {
    std::size_t const esz = size_of(call.type);
    auto const nn = static_cast<std::size_t>(n_);
    rank_cursors cursors;
    cursors_over(cursors, 0, esz);
    for_each_stripe(call.count, n_, r, esz, [&](std::size_t lo, std::size_t hi) {
      while (lo < hi) {
        std::size_t len = hi - lo;
        for (std::size_t j = 0; j < nn; ++j) {
          auto const [at, run] = cursors.at[j].locate(lo);
          dsts[j] = at;
          srcs[j] = at;
          len = std::min(len, run);
        }
        reduce_bytes(call.type, std::span<void const* const>(srcs, nn), std::span<void* const>(dsts, nn), len, call.op,
                     n_);
        lo += len;
      }
    });
  }

  /// compute() for a reduce_scatter, plain or with some rank's list (reduce_scatter_coalesced; a
  /// plain `in` is a list of one): block r of every rank's input array summed into rank r's `out`,
  /// in pieces that lie within one tensor on every rank, in rank order (the same bits either way).
  void compute_scatter(int r, comm_call const& call, void const** srcs, void** dsts) const {
    std::size_t const esz = size_of(call.type);
    auto const nn = static_cast<std::size_t>(n_);
    rank_cursors cursors;
    cursors_over(cursors, 1, esz);
    std::size_t const base = static_cast<std::size_t>(r) * call.count;
    auto* const out = static_cast<char*>(bufs_[static_cast<std::size_t>(r)][0].data());
    for (std::size_t lo = 0; lo < call.count;) {
      std::size_t len = call.count - lo;
      for (std::size_t j = 0; j < nn; ++j) {
        auto const [at, run] = cursors.at[j].locate(base + lo);
        srcs[j] = at;
        len = std::min(len, run);
      }
      dsts[0] = out + lo * esz;
      reduce_bytes(call.type, std::span<void const* const>(srcs, nn), std::span<void* const>(dsts, 1), len, call.op,
                   n_);
      lo += len;
    }
  }

  /// compute() for an all_gather, plain or with some rank's list (all_gather_coalesced, in place):
  /// rank r's block (of its list, or its `in`) copied into block r of every rank's array (its
  /// list, or its `out`), skipping a block already in place.
  void compute_gather(int r, comm_call const& call) const {
    std::size_t const esz = size_of(call.type);
    auto const ur = static_cast<std::size_t>(r);
    std::size_t const base = ur * call.count;
    std::size_t const from = calls_[ur].parts != 0 ? base : 0;  // a plain `in` is the block alone
    for (std::size_t j = 0; j < static_cast<std::size_t>(n_); ++j) {
      coalesced_cursor src = array_of(ur, 1, esz);
      coalesced_cursor dst = array_of(j, 0, esz);
      for (std::size_t lo = 0; lo < call.count;) {
        auto const [s, srun] = src.locate(from + lo);
        auto const [d, drun] = dst.locate(base + lo);
        std::size_t const len = std::min({srun, drun, call.count - lo});
        if (d != s) std::memcpy(d, s, len * esz);
        lo += len;
      }
    }
  }

  int n_;
  std::vector<int> parent_ranks_;  // a subgroup's members in its parent; empty otherwise
  std::mutex m_;
  // Subgroups being handed out: (split number, group index) -> (group, members yet to take it).
  std::map<std::pair<std::uint64_t, int>, std::pair<std::shared_ptr<host_group>, std::size_t>> subgroups_;
  std::condition_variable cv_;
  std::vector<std::uint64_t> posted_;    // last sequence number each rank published (0: none)
  std::vector<std::uint64_t> departed_;  // last sequence number each rank finished computing
  std::vector<std::uint64_t> closed_;    // last sequence number each rank will ever issue
  std::vector<char> busy_;               // rank is inside step 3
  std::vector<comm_call> calls_;
  std::vector<std::array<tensor_ref, 2>> bufs_;
  std::vector<std::span<tensor_ref const>> lists_;  // per rank: a *_coalesced call's tensors
  std::optional<comm_failure> failure_;
  std::atomic<std::uint64_t> epoch_{0};  // counts notify() calls (for spinning)
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

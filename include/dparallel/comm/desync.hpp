#pragma once
// Desync detection (a debug option, like TORCH_DISTRIBUTED_DEBUG=DETAIL): a communicator that
// wraps any process_group and, before each collective, gathers from every rank a fingerprint of
// the collective it is about to run (sequence number, operation, element counts, dtype, reduce op,
// root). When the fingerprints differ, no rank runs the collective: every rank's work fails with
// the same comm_error showing what every rank called, instead of a deadlock, a crash or silently
// wrong data in the engine underneath.
//
//   dparallel::process_group g = dparallel::with_desync_detection(group);   // or
//   dparallel::mpi::init_process_group({.desync_detection = true});         // or DPARALLEL_DESYNC_DETECTION=1
//
// Costs: one all_gather of 8 integers per collective, and the wrapper runs its collectives one
// after the other (each waits for the previous one), so it removes most overlap: use it to find a
// bug, not in production. A rank that never calls a collective at all is still reported by the
// engine's timeout. A mismatch fails the wrapper (sticky: later collectives fail too) but leaves
// the wrapped group healthy: every rank saw the same fingerprints and none of them ran the
// mismatched collective, so the engine has nothing in flight.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/detail/serial_worker.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {

/// The fingerprint of one collective, as exchanged between ranks.
struct desync_fingerprint {
  static constexpr std::int64_t magic = 0x4450'5359;  // "DPSY"
  static constexpr std::size_t words = 8;

  static std::array<std::int64_t, words> encode(std::uint64_t seq, comm_call const& c) {
    return {magic,
            static_cast<std::int64_t>(seq),
            static_cast<std::int64_t>(c.kind),
            static_cast<std::int64_t>(c.type),
            static_cast<std::int64_t>(c.count),
            static_cast<std::int64_t>(c.total),
            static_cast<std::int64_t>(c.op),
            static_cast<std::int64_t>(c.root)};
  }
  /// Decodes words [at, at + 8); nullopt for a malformed record.
  static std::optional<std::pair<std::uint64_t, comm_call>> decode(std::vector<std::int64_t> const& v, std::size_t at) {
    if (v[at] != magic || v[at + 2] < 0 || v[at + 2] > static_cast<std::int64_t>(comm_kind::barrier) ||
        v[at + 3] < 0 || v[at + 3] > static_cast<std::int64_t>(dtype::u8) || v[at + 6] < 0 || v[at + 6] > 1)
      return std::nullopt;
    comm_call c;
    c.kind = static_cast<comm_kind>(v[at + 2]);
    c.type = static_cast<dtype>(v[at + 3]);
    c.count = static_cast<std::size_t>(v[at + 4]);
    c.total = static_cast<std::size_t>(v[at + 5]);
    c.op = static_cast<reduce_op>(v[at + 6]);
    c.root = static_cast<int>(v[at + 7]);
    return std::pair{static_cast<std::uint64_t>(v[at + 1]), c};
  }
};

/// Compares the gathered fingerprints of collective `seq`; returns the mismatch report (null when
/// every rank called the same collective) and sets `culprit` to the first rank outside the
/// largest group of identical calls.
inline std::optional<std::string> desync_report(std::vector<std::int64_t> const& all, int n, std::uint64_t seq,
                                                int& culprit) {
  using fp = desync_fingerprint;
  std::vector<std::optional<std::pair<std::uint64_t, comm_call>>> calls;
  for (int j = 0; j < n; ++j) calls.push_back(fp::decode(all, static_cast<std::size_t>(j) * fp::words));
  auto const same = [&](int a, int b) {
    auto const& x = calls[static_cast<std::size_t>(a)];
    auto const& y = calls[static_cast<std::size_t>(b)];
    return x && y && x->first == y->first && matches(x->second, y->second);
  };
  // Classes of identical calls; the largest (first on ties) is "the others".
  std::vector<int> cls(static_cast<std::size_t>(n), -1);
  std::vector<std::vector<int>> members;
  for (int j = 0; j < n; ++j) {
    for (std::size_t k = 0; k < members.size() && cls[static_cast<std::size_t>(j)] < 0; ++k)
      if (same(members[k][0], j)) {
        cls[static_cast<std::size_t>(j)] = static_cast<int>(k);
        members[k].push_back(j);
      }
    if (cls[static_cast<std::size_t>(j)] < 0) {
      cls[static_cast<std::size_t>(j)] = static_cast<int>(members.size());
      members.push_back({j});
    }
  }
  if (members.size() == 1 && calls[0]) return std::nullopt;
  std::size_t major = 0;
  for (std::size_t k = 1; k < members.size(); ++k)
    if (members[k].size() > members[major].size()) major = k;
  std::vector<int> odd;
  for (int j = 0; j < n; ++j)
    if (cls[static_cast<std::size_t>(j)] != static_cast<int>(major)) odd.push_back(j);
  culprit = odd.empty() ? 0 : odd[0];

  std::string msg = "desync detected at collective #" + std::to_string(seq) + ": ";
  for (int j = 0; j < n; ++j) {
    auto const& c = calls[static_cast<std::size_t>(j)];
    msg += (j == 0 ? "" : "; ") + std::string("rank ") + std::to_string(j) + " called ";
    msg += c ? "#" + std::to_string(c->first) + " " + describe(c->second) : std::string("something unreadable");
  }
  msg += ". " + describe_ranks(odd) + (odd.size() == 1 ? " differs" : " differ") + " from " +
         (members[major].size() == 1 ? "rank " + std::to_string(members[major][0]) : describe_ranks(members[major])) +
         ". " + std::string(same_calls_rule);
  return msg;
}

}  // namespace detail

/// The desync-detecting communicator over `inner` (any process group). Satisfies
/// dparallel::communicator; share it through process_group (with_desync_detection does).
class desync_detector {
 public:
  /// Wraps `inner`; every rank of `inner` must wrap it (the checks are collectives).
  explicit desync_detector(process_group inner) : inner_(std::move(inner)) {
    dparallel::detail::require(inner_.valid(), "with_desync_detection: expected a process group, found an empty one");
    rank_ = inner_.rank();
    size_ = inner_.size();
  }
  desync_detector(desync_detector const&) = delete;
  desync_detector& operator=(desync_detector const&) = delete;

  /// Joins the worker. Collectives still pending abort the wrapped group first (their peers would
  /// otherwise wait for this rank until the timeout).
  ~desync_detector() {
    std::size_t const pending = worker_.pending();
    if (pending != 0) {
      try {
        inner_.abort("its desync detector was destroyed with " + std::to_string(pending) + " collective" +
                     (pending == 1 ? "" : "s") + " pending");
      } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to do in a destructor
      }
    }
    worker_.stop();
  }

  /// This rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of ranks.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The wrapped group's bound device (process_group::bound_device).
  [[nodiscard]] std::optional<device> bound_device() const { return inner_.bound_device(); }

  /// This rank's subgroup of a split (process_group::split): the wrapped group's subgroup, with
  /// desync detection too; empty when the rank is in none.
  process_group subgroup(dparallel::detail::subgroup_plan const& plan);

  /// all_reduce after the ranks' calls were compared (see communicator).
  work all_reduce(tensor_ref t, reduce_op op = reduce_op::sum) {
    return issue({dparallel::detail::comm_kind::all_reduce, t.dtype(), t.size(), t.size(), op, 0}, t, {});
  }
  /// reduce after the ranks' calls were compared.
  work reduce(tensor_ref t, int root, reduce_op op = reduce_op::sum) {
    return issue({dparallel::detail::comm_kind::reduce, t.dtype(), t.size(), t.size(), op, root}, t, {});
  }
  /// broadcast after the ranks' calls were compared.
  work broadcast(tensor_ref t, int root) {
    return issue({dparallel::detail::comm_kind::broadcast, t.dtype(), t.size(), t.size(), reduce_op::sum, root}, t,
                 {});
  }
  /// reduce_scatter after the ranks' calls were compared.
  work reduce_scatter(tensor_ref out, tensor_ref in, reduce_op op = reduce_op::sum) {
    return issue({dparallel::detail::comm_kind::reduce_scatter, out.dtype(), out.size(), in.size(), op, 0}, out, in);
  }
  /// all_gather after the ranks' calls were compared.
  work all_gather(tensor_ref out, tensor_ref in) {
    return issue({dparallel::detail::comm_kind::all_gather, in.dtype(), in.size(), out.size(), reduce_op::sum, 0}, out,
                 in);
  }
  /// barrier after the ranks' calls were compared.
  work barrier() { return issue(dparallel::detail::comm_call{}, {}, {}); }

  /// Aborts the wrapped group: every pending and future wait of every rank fails.
  void abort(std::string why) { inner_.abort(std::move(why)); }

  /// True: DDP over this group checks each step that the ranks step alike (detail/rank_checks.hpp).
  [[nodiscard]] bool detects_desync() const noexcept { return true; }

  /// The wrapped group's timeout.
  [[nodiscard]] std::chrono::milliseconds timeout() const { return inner_.timeout(); }
  /// Sets the wrapped group's timeout.
  void set_timeout(std::chrono::milliseconds t) { inner_.set_timeout(t); }
  /// The inner group's memory (process_group::allocate).
  [[nodiscard]] std::shared_ptr<std::byte> allocate(std::size_t bytes) const { return inner_.allocate(bytes); }
  /// Number of collectives this wrapper has finished.
  [[nodiscard]] std::uint64_t completed_ops() const noexcept { return worker_.completed(); }
  /// Blocks until every collective issued so far has finished (successfully or not).
  void drain() { worker_.drain(); }

  /// The wrapped group.
  [[nodiscard]] process_group const& inner() const noexcept { return inner_; }

 private:
  struct task {
    std::uint64_t seq = 0;
    dparallel::detail::comm_call call;
    tensor_ref a;
    tensor_ref b;
  };

  // Runs on the worker, under the caller's issue_order token (the forwarded collective is
  // ordered after the caller's GPU work, not after the worker's, which has none).
  work issue(dparallel::detail::comm_call const& c, tensor_ref a, tensor_ref b) {
    return worker_.submit([this, c, a, b](std::uint64_t seq) {
      if (auto failure = execute(task{seq, c, a, b})) std::rethrow_exception(failure);
    });
  }

  [[nodiscard]] std::exception_ptr failed_error(task const& t) const {
    return dparallel::detail::collective_error(rank_, dparallel::detail::describe(t.call), t.seq,
                                               {failure_->first, false, failure_->second});
  }

  // Runs one collective: the fingerprint exchange, then (when every rank agrees) the collective.
  std::exception_ptr execute(task const& t) {
    if (failure_) return failed_error(t);
    auto const mine = dparallel::detail::desync_fingerprint::encode(t.seq, t.call);
    std::vector<std::int64_t> m(mine.begin(), mine.end());
    std::vector<std::int64_t> all(m.size() * static_cast<std::size_t>(size_));
    try {
      inner_.all_gather(view(all), view(m)).wait();
    } catch (...) {
      inner_.drain();  // `m` and `all` must outlive the exchange
      return std::current_exception();
    }
    int culprit = 0;
    if (auto report = dparallel::detail::desync_report(all, size_, t.seq, culprit)) {
      failure_ = std::pair{culprit, std::move(*report)};
      return failed_error(t);
    }
    try {
      using kind = dparallel::detail::comm_kind;
      work w;
      switch (t.call.kind) {
        case kind::all_reduce: w = inner_.all_reduce(t.a, t.call.op); break;
        case kind::reduce: w = inner_.reduce(t.a, t.call.root, t.call.op); break;
        case kind::broadcast: w = inner_.broadcast(t.a, t.call.root); break;
        case kind::reduce_scatter: w = inner_.reduce_scatter(t.a, t.b, t.call.op); break;
        case kind::all_gather: w = inner_.all_gather(t.a, t.b); break;
        case kind::barrier: w = inner_.barrier(); break;
      }
      return w.wait_nothrow();
    } catch (...) {  // invalid arguments, rejected by the engine when issued
      return std::current_exception();
    }
  }

  process_group inner_;
  int rank_ = 0;
  int size_ = 1;
  std::optional<std::pair<int, std::string>> failure_;  // worker thread only
  dparallel::detail::serial_worker worker_;  // last: its thread runs jobs that use the members above
};

static_assert(communicator<desync_detector>);

/// `inner` behind desync detection (see the top of this file).
inline process_group with_desync_detection(process_group inner) {
  return process_group(std::make_shared<desync_detector>(std::move(inner)));
}

inline process_group desync_detector::subgroup(dparallel::detail::subgroup_plan const& plan) {
  process_group g = dparallel::detail::make_subgroup(inner_, plan);
  return g.valid() ? with_desync_detection(std::move(g)) : g;
}

DPARALLEL_NAMESPACE_END

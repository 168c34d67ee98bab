#pragma once
// What a rank asks of a collective, as the host-memory engines (thread ranks, shared memory, MPI)
// queue, compare across ranks and name in their errors: the kind, dtype, counts, op and root,
// and for the *_coalesced calls how many tensors the caller's list holds; and the reasons their
// failures give (a mismatch, a timeout, a rank that finished), worded once.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/call_checks.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

enum class comm_kind : std::uint8_t { all_reduce, reduce, broadcast, reduce_scatter, all_gather, barrier };

constexpr std::string_view kind_name(comm_kind k) noexcept {
  switch (k) {
    case comm_kind::all_reduce: return "all_reduce";
    case comm_kind::reduce: return "reduce";
    case comm_kind::broadcast: return "broadcast";
    case comm_kind::reduce_scatter: return "reduce_scatter";
    case comm_kind::all_gather: return "all_gather";
    case comm_kind::barrier: return "barrier";
  }
  return "?";
}

/// What one rank asked for: what must match across ranks, plus what error messages show.
struct comm_call {
  comm_kind kind = comm_kind::barrier;
  dtype type = dtype::f32;
  std::size_t count = 0;  // per-rank block: t.size(), reduce_scatter's out, all_gather's in
  std::size_t total = 0;  // reduce_scatter's in, all_gather's out (shown only)
  reduce_op op = reduce_op::sum;
  int root = 0;
  std::size_t parts = 0;  // a *_coalesced call: the number of tensors in its list (0: one buffer)

  [[nodiscard]] constexpr bool reduces() const noexcept {
    return kind == comm_kind::all_reduce || kind == comm_kind::reduce || kind == comm_kind::reduce_scatter;
  }
  [[nodiscard]] constexpr bool rooted() const noexcept {
    return kind == comm_kind::reduce || kind == comm_kind::broadcast;
  }
  /// Whether two ranks' calls are the same collective.
  [[nodiscard]] friend constexpr bool matches(comm_call const& a, comm_call const& b) noexcept {
    if (a.kind != b.kind) return false;
    if (a.kind == comm_kind::barrier) return true;
    // A collective and its *_coalesced form over as many elements match (any cut into tensors).
    return a.type == b.type && a.count == b.count && (!a.reduces() || a.op == b.op) &&
           (!a.rooted() || a.root == b.root);
  }
};

/// One collective queued by a rank's engine (host threads, shared memory, MPI): its sequence
/// number, what was called, its tensors, its timeout, and the promise its work completes.
struct comm_task {
  std::uint64_t seq = 0;
  comm_call call;
  tensor_ref a;
  tensor_ref b;
  std::chrono::milliseconds timeout{};
  work_promise done;
  std::span<tensor_ref const> list{};  // a *_coalesced call's tensors (the caller keeps them)
};

/// "all_reduce(1000 x F32, sum)", "broadcast(7 x I32, root 0)", "all_gather(out 21 x F32, in 7 x F32)".
inline std::string describe(comm_call const& c) {
  auto elems = [&](std::size_t n) { return std::to_string(n) + " x " + std::string(name_of(c.type)); };
  std::string s(kind_name(c.kind));
  switch (c.kind) {
    case comm_kind::all_reduce:
      if (c.parts != 0)
        return s + "_coalesced(" + elems(c.count) + " in " + std::to_string(c.parts) + " tensors, " +
               std::string(name_of(c.op)) + ")";
      return s + "(" + elems(c.count) + ", " + std::string(name_of(c.op)) + ")";
    case comm_kind::reduce:
      return s + "(" + elems(c.count) + ", " + std::string(name_of(c.op)) + ", root " + std::to_string(c.root) + ")";
    case comm_kind::broadcast: return s + "(" + elems(c.count) + ", root " + std::to_string(c.root) + ")";
    case comm_kind::reduce_scatter:
      if (c.parts != 0)
        return s + "_coalesced(out " + elems(c.count) + ", in " + elems(c.total) + " in " + std::to_string(c.parts) +
               " tensors, " + std::string(name_of(c.op)) + ")";
      return s + "(out " + elems(c.count) + ", in " + elems(c.total) + ", " + std::string(name_of(c.op)) + ")";
    case comm_kind::all_gather:
      if (c.parts != 0)
        return s + "_coalesced(" + elems(c.total) + " in " + std::to_string(c.parts) + " tensors, blocks of " +
               std::to_string(c.count) + ")";
      return s + "(out " + elems(c.total) + ", in " + elems(c.count) + ")";
    case comm_kind::barrier: return s + "()";
  }
  return s;
}

/// The call of a collective over a list of tensors read as one array, on an engine whose
/// `check(c, t, name)` refuses a tensor it cannot move and whose `reject(c, problem)` throws:
/// all_reduce_coalesced (`kind` all_reduce), reduce_scatter_coalesced (reduce_scatter into `out`,
/// the array holding `ranks` blocks of out.size() elements, `out` apart from every tensor of it)
/// or all_gather_coalesced (all_gather, in place: the array holds `ranks` blocks). Every tensor
/// is of tensor 0's dtype, and there is at least one.
template <class Check, class Reject>
comm_call coalesced_call(comm_kind kind, std::span<tensor_ref const> tensors, tensor_ref out, reduce_op op, int ranks,
                         Check&& check, Reject&& reject) {
  comm_call c{kind, tensors.empty() ? dtype::f32 : tensors[0].dtype(), 0, 0, op, 0, tensors.size()};
  if (tensors.empty()) reject(c, "expected at least one tensor, found an empty list");
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    if (tensors[k].dtype() != c.type)
      reject(c, "expected every tensor of " + std::string(name_of(c.type)) + " (tensor 0's), found tensor " +
                    std::to_string(k) + " of " + std::string(name_of(tensors[k].dtype())));
    check(c, tensors[k], "tensors[k]");
    c.total += tensors[k].size();
  }
  auto const n = static_cast<std::size_t>(ranks);
  switch (kind) {
    case comm_kind::reduce_scatter:
      check(c, out, "out");
      c.count = out.size();
      if (out.dtype() != c.type)
        reject(c, "expected `out` of the tensors' dtype " + std::string(name_of(c.type)) + ", found " +
                      std::string(name_of(out.dtype())));
      if (c.total != n * c.count)
        reject(c, "expected the tensors to hold size() * out.size() = " + std::to_string(n) + " * " +
                      std::to_string(c.count) + " = " + std::to_string(n * c.count) + " elements, found " +
                      std::to_string(c.total));
      for (std::size_t k = 0; k < tensors.size(); ++k)
        if (out.size() != 0 && !disjoint(out, tensors[k]))
          reject(c, "expected `out` apart from the tensors it reduces, found it overlapping tensor " + std::to_string(k));
      break;
    case comm_kind::all_gather:
      c.count = c.total / n;
      if (c.total % n != 0)
        reject(c, "expected the tensors to hold size() = " + std::to_string(n) + " blocks of as many elements, found " +
                      std::to_string(c.total) + " elements");
      break;
    default: c.count = c.total; break;
  }
  return c;
}

/// "rank 2", "ranks 2 and 4", "ranks 1, 2 and 4".
inline std::string describe_ranks(std::vector<int> const& ranks) {
  if (ranks.size() == 1) return "rank " + std::to_string(ranks[0]);
  std::string s = "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i != 0) s += i + 1 == ranks.size() ? " and " : ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// --- failure naming: the reasons every engine gives, worded once ------------------------------

/// The rule a failure of a collective ends with.
inline constexpr std::string_view same_order_rule = "Every rank must issue the same collectives in the same order";
/// The rule a mismatch ends with.
inline constexpr std::string_view same_calls_rule =
    "Every rank must issue the same collectives, with the same element counts, dtypes, roots and reduce ops, in the "
    "same order";

/// "; if rank 2 is only slow, raise the timeout (<remedy>)": what a timeout says last.
inline std::string slow_rank_advice(std::string const& who, bool one, std::string_view remedy) {
  return "; if " + who + (one ? " is" : " are") + " only slow, raise the timeout (" + std::string(remedy) + ")";
}

/// Rank 0 and rank j called collective #seq differently.
inline std::string mismatch_reason(std::uint64_t seq, comm_call const& first, int j, comm_call const& other) {
  return "mismatched collectives #" + std::to_string(seq) + ": rank 0 called " + describe(first) + " but rank " +
         std::to_string(j) + " called " + describe(other) + ". " + std::string(same_calls_rule);
}

/// `missing` (not empty) did not do `missed` ("did not call collective #3") within `timeout`,
/// while rank `me` waited for it in `call` and `present` `had` ("had called it").
inline std::string timeout_reason(std::vector<int> const& missing, std::vector<int> const& present,
                                  std::string const& missed, std::string_view had, std::chrono::milliseconds timeout,
                                  int me, comm_call const& call, std::string_view remedy) {
  std::string const who = describe_ranks(missing);
  std::string msg = who + " " + missed + " within " + std::to_string(timeout.count()) + " ms: rank " +
                    std::to_string(me) + " waited for it in " + describe(call);
  if (!present.empty()) msg += " (" + describe_ranks(present) + " " + std::string(had) + ")";
  return msg + ". " + std::string(same_order_rule) + slow_rank_advice(who, missing.size() == 1, remedy);
}

/// Rank j ended (`how`) after issuing `issued` collectives, so it never calls collective #seq,
/// which rank `me` waited for (`in`: " in <call>", or empty).
inline std::string finished_reason(int j, std::string_view how, std::uint64_t issued, std::uint64_t seq, int me,
                                   std::string const& in) {
  return "rank " + std::to_string(j) + " finished (" + std::string(how) + ") after issuing " + std::to_string(issued) +
         " collective" + (issued == 1 ? "" : "s") + ", so it will never call collective #" + std::to_string(seq) +
         ", which rank " + std::to_string(me) + " waited for" + in + ". " + std::string(same_order_rule);
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

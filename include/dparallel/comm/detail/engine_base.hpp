#pragma once
// The checked front every host-memory engine (thread ranks, shared memory, MPI) puts before its
// transport: the communicator's collective calls, each turned into the call's description
// (comm_call: what desync detection compares and every error shows), its arguments checked in
// one order, and a refusal that aborts the group before it throws. An engine derives from
// engine_base<Derived, Lists> (CRTP; Lists: it runs the *_coalesced collectives too, reading
// a list of tensors as one array) and keeps only its transport; docs/writing-engines.md says how.
//
// What Derived provides (looked up on the derived class; the defaults below apply otherwise):
//  - `int rank() const`, `int size() const`, `void abort(std::string why)`;
//  - `work issue(comm_call const&, tensor_ref a, tensor_ref b, std::span<tensor_ref const> list)`:
//    queue the checked collective (a: t / out, b: in; list: a *_coalesced call's tensors);
//  - `static constexpr std::string_view error_prefix`: what its invalid_argument messages begin with;
//  - `std::string device_problem(tensor_ref t, char const* name) const`: a view it cannot move;
//  - `std::string dtype_problem(comm_call const& c, tensor_ref t) const`: a reduction it refuses
//    (`t`: the reduced tensor, empty for a list); called only for reductions;
//  - optionally `std::string blocks_check(comm_call const&, tensor_ref small, tensor_ref big,
//    char const* small_name, char const* big_name) const` (default: blocks_problem);
// The order of the checks, for every engine: each tensor (device, then memory), the dtype and op
// of a reduction, the root of a rooted call, the blocks of reduce_scatter / all_gather.
//
// queued_collectives holds what the engines that run a rank's collectives on a communication
// thread of their own (thread ranks, shared memory) share: the ordered queue and its sequence
// numbers, the timeout, the count of finished collectives, and the rule at destruction (pending
// collectives abort the group, none closes the rank). The reasons a failure gives (a mismatch, a
// timeout, a rank that finished) are worded once in comm_call.hpp, for every engine.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/call_checks.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/task_queue.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

template <class Derived, bool Lists = false>
class engine_base {
 public:
  /// See dparallel::communicator: in place.
  work all_reduce(tensor_ref t, reduce_op op = reduce_op::sum) {
    comm_call const c{comm_kind::all_reduce, t.dtype(), t.size(), t.size(), op, 0};
    check_tensor(c, t, "t");
    check_call(c, t);
    return self().issue(c, t, {}, {});
  }
  /// See dparallel::communicator: in place onto `root`.
  work reduce(tensor_ref t, int root, reduce_op op = reduce_op::sum) {
    comm_call const c{comm_kind::reduce, t.dtype(), t.size(), t.size(), op, root};
    check_tensor(c, t, "t");
    check_call(c, t);
    return self().issue(c, t, {}, {});
  }
  /// See dparallel::communicator.
  work broadcast(tensor_ref t, int root) {
    comm_call const c{comm_kind::broadcast, t.dtype(), t.size(), t.size(), reduce_op::sum, root};
    check_tensor(c, t, "t");
    check_call(c, t);
    return self().issue(c, t, {}, {});
  }
  /// out: n elements; in: size()*n elements. out may be in's block rank() (in place) or disjoint from in.
  work reduce_scatter(tensor_ref out, tensor_ref in, reduce_op op = reduce_op::sum) {
    comm_call const c{comm_kind::reduce_scatter, out.dtype(), out.size(), in.size(), op, 0};
    check_tensor(c, out, "out");
    check_tensor(c, in, "in");
    check_call(c, out);
    check_blocks(c, out, in, "out", "in");
    return self().issue(c, out, in, {});
  }
  /// in: n elements; out: size()*n elements. in may be out's block rank() (in place) or disjoint from out.
  work all_gather(tensor_ref out, tensor_ref in) {
    comm_call const c{comm_kind::all_gather, in.dtype(), in.size(), out.size(), reduce_op::sum, 0};
    check_tensor(c, out, "out");
    check_tensor(c, in, "in");
    check_blocks(c, in, out, "in", "out");
    return self().issue(c, out, in, {});
  }
  /// See dparallel::communicator: completes once every rank has issued its barrier.
  work barrier() { return self().issue(comm_call{}, {}, {}, {}); }

  /// See process_group::all_reduce_coalesced: the tensors read as one array (the sums and bits
  /// of all_reduce of that array). `tensors` is read while the collective runs: keep it alive
  /// and unchanged until the work completes (so for the two below).
  work all_reduce_coalesced(std::span<tensor_ref const> tensors, reduce_op op = reduce_op::sum)
    requires Lists
  {
    return self().issue(listed(comm_kind::all_reduce, tensors, {}, op), {}, {}, tensors);
  }
  /// See process_group::reduce_scatter_coalesced: block rank() of every rank's array summed into
  /// `out` (the sums and bits of reduce_scatter).
  work reduce_scatter_coalesced(tensor_ref out, std::span<tensor_ref const> in, reduce_op op = reduce_op::sum)
    requires Lists
  {
    return self().issue(listed(comm_kind::reduce_scatter, in, out, op), out, {}, in);
  }
  /// See process_group::all_gather_coalesced: this rank's block of its array copied into the
  /// same block of every other rank's array.
  work all_gather_coalesced(std::span<tensor_ref const> tensors)
    requires Lists
  {
    return self().issue(listed(comm_kind::all_gather, tensors, {}, reduce_op::sum), {}, {}, tensors);
  }

 protected:
  engine_base() = default;

  /// Invalid arguments abort the group (its peers would otherwise wait for this rank until the
  /// timeout), then throw invalid_argument on the caller: "<prefix><kind> on rank R: <problem>".
  [[noreturn]] void reject(comm_call const& c, std::string const& problem) {
    std::string const msg = std::string(kind_name(c.kind)) + " on rank " + std::to_string(self().rank()) + ": " + problem;
    self().abort("invalid arguments to " + msg);
    throw invalid_argument(std::string(Derived::error_prefix) + msg);
  }

  /// The default check of reduce_scatter's / all_gather's blocks (see blocks_problem).
  [[nodiscard]] std::string blocks_check(comm_call const&, tensor_ref small, tensor_ref big, char const* small_name,
                                         char const* big_name) const {
    return blocks_problem(small, big, small_name, big_name, self().size(), self().rank());
  }

  /// device_problem's usual wording for an engine that moves host memory only.
  static std::string host_memory_problem(tensor_ref t, char const* name, std::string_view remedy) {
    if (t.device().kind == device_kind::host) return {};
    return std::string("expected `") + name + "` in host memory, found a view on " + to_string(t.device()) + "; " +
           std::string(remedy);
  }
  /// dtype_problem's wording for a dtype the engine does not reduce; `dtypes` lists those it does.
  static std::string unreducible(std::string_view engine, std::string_view dtypes, dtype t) {
    return "the " + std::string(engine) + " communicator reduces " + std::string(dtypes) + ", found " +
           std::string(name_of(t)) + "; convert the data, or use broadcast / all_gather, which move any dtype";
  }
  /// dtype_problem's wording for avg of a dtype that is not floating point (empty when it is).
  static std::string avg_problem(comm_call const& c) {
    if (c.op != reduce_op::avg || host_reducible(c.type)) return {};
    return "avg needs a floating-point dtype (F32, F64, F16, BF16), found " + std::string(name_of(c.type)) + "; use sum";
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  Derived const& self() const noexcept { return static_cast<Derived const&>(*this); }

  void check_tensor(comm_call const& c, tensor_ref t, char const* name) {
    std::string problem = self().device_problem(t, name);
    if (problem.empty()) problem = null_data_problem(t, name);
    if (!problem.empty()) reject(c, problem);
  }

  // What the engine refuses in a call, whatever its tensors' memory: its dtype and op, its root.
  void check_call(comm_call const& c, tensor_ref t) {
    if (c.reduces())
      if (auto const problem = self().dtype_problem(c, t); !problem.empty()) reject(c, problem);
    if (c.rooted())
      if (auto const problem = root_problem(c.root, self().size()); !problem.empty()) reject(c, problem);
  }

  void check_blocks(comm_call const& c, tensor_ref small, tensor_ref big, char const* small_name, char const* big_name) {
    auto const problem = self().blocks_check(c, small, big, small_name, big_name);
    if (!problem.empty()) reject(c, problem);
  }

  comm_call listed(comm_kind k, std::span<tensor_ref const> tensors, tensor_ref out, reduce_op op) {
    auto const c = coalesced_call(
        k, tensors, out, op, self().size(), [&](comm_call const& call, tensor_ref t, char const* name) { check_tensor(call, t, name); },
        [&](comm_call const& call, std::string const& problem) { reject(call, problem); });
    check_call(c, {});
    return c;
  }
};

/// The ordered queue of a rank's collectives and the thread that runs them (see the top of this
/// file). `Run` is the engine's `std::exception_ptr(comm_task&)`: the collective's transport.
class queued_collectives {
 public:
  template <class Run>
  queued_collectives(std::chrono::milliseconds timeout, Run run)
      : timeout_ms_(timeout.count()), queue_([this, run = std::move(run)](comm_task& t) mutable { finish(t, run(t)); }) {}
  queued_collectives(queued_collectives const&) = delete;
  queued_collectives& operator=(queued_collectives const&) = delete;

  /// Queues a checked collective with the next sequence number; `refuse(c)` (under the queue's
  /// mutex) may throw to refuse it first.
  template <class Refuse>
  work issue(comm_call const& c, tensor_ref a, tensor_ref b, std::span<tensor_ref const> list, Refuse&& refuse) {
    work_promise p;
    work w = p.get_work();
    queue_.push([&] {
      refuse(c);
      return comm_task{next_seq_++, c, a, b, timeout(), std::move(p), list};
    });
    return w;
  }

  /// The number of the last collective issued, read under the queue's mutex while `f()` runs.
  template <class F>
  std::uint64_t last_issued(F&& f) {
    return queue_.locked([&] {
      f();
      return next_seq_ - 1;
    });
  }

  /// At the engine's destruction, before its transport goes: with collectives pending,
  /// `abort(why)` (their peers could otherwise wait for this rank until the timeout); with none,
  /// `close(last)` (peers waiting for a later collective of this rank fail at once). Then joins the thread.
  template <class Abort, class Close>
  void stop(Abort&& abort, Close&& close) {
    auto const [pending, last] = queue_.locked([&] { return std::pair(queue_.pending(), next_seq_ - 1); });
    if (pending != 0) {
      abort("its communicator was destroyed with " + std::to_string(pending) + " collective" +
            (pending == 1 ? "" : "s") + " pending");
    } else {
      close(last);
    }
    queue_.stop();
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  /// `who`: the engine, named in the error ("host::communicator").
  void set_timeout(std::chrono::milliseconds t, std::string_view who) {
    require(t.count() > 0, [&] {
      return std::string(who) + "::set_timeout: expected a positive timeout, found " + std::to_string(t.count()) + " ms";
    });
    timeout_ms_.store(t.count(), std::memory_order_relaxed);
  }
  [[nodiscard]] std::uint64_t completed_ops() const noexcept { return completed_.load(std::memory_order_acquire); }
  void drain() {
    queue_.help_until_idle([] {});
  }
  void hold() { (void)queue_.hold_if_idle(); }
  void release() { queue_.release(); }

 private:
  // On the communication thread (or a draining caller), one collective at a time, in order.
  void finish(comm_task& t, std::exception_ptr failure) {
    // Not pending any more before anyone can see the work complete: a rank that waits for its
    // last work and then destroys its communicator must not find it still pending.
    queue_.retire([] {});
    completed_.fetch_add(1, std::memory_order_release);
    t.done.complete(std::move(failure));
  }

  std::atomic<std::int64_t> timeout_ms_;
  std::atomic<std::uint64_t> completed_{0};
  std::uint64_t next_seq_ = 1;  // under the queue's mutex
  task_queue<comm_task> queue_;  // last: its thread starts after the other members exist
};

/// Runs `f()` (the engine's transport for one collective) and returns its failure, or null;
/// whatever it throws becomes the collective's failure.
template <class F>
std::exception_ptr failure_of(F&& f) noexcept {
  try {
    return f();
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

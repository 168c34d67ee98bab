#pragma once
// Hierarchical process groups: an all-reduce that moves most data inside each node (over the
// node subgroup's engine: shared memory for processes of one node) and only one slice per rank
// across nodes. See make_hierarchical and docs/multi-process.md ("Hierarchical all-reduce").
//
// Structure. Every rank of the parent belongs to one node (detail::node_plan); all nodes have L
// ranks. node group = the ranks of this rank's node, in parent-rank order; cross group = the ranks
// with this rank's local rank, one per node, in node order. all_reduce of n elements, with
// m = ceil(n / L) (the array padded with zeros to L * m when L does not divide n):
//   1. reduce_scatter(sum) inside the node: local rank l gets slice l (elements [l*m, (l+1)*m))
//      summed over its node's ranks in parent-rank order;
//   2. all_reduce(sum) of that slice over the cross group: the node sums added in node order;
//   3. avg only: the slice times T(1) / T(parent size) (for f16 / bf16: in float, rounded once);
//   4. all_gather inside the node: every rank gets every slice.
// So element i ends as ((node 0's sum) + (node 1's sum) + ...) [* 1/size], each node's sum being
// ((its first rank's) + (its second rank's) + ...), every partial rounded to the element type:
// deterministic, and independent of the slice sizes. The other collectives are forwarded to the
// parent unchanged (their order is the parent's). Every collective runs on this communicator's
// worker thread, one at a time in the order issued.
//
// Device memory (an NCCL parent: tensors on the rank's GPU). This code never touches the
// elements, so it neither pads nor scales: the first L * floor(n / L) elements take steps 1, 2
// and 4, and the last n mod L elements (fewer than L) an all_reduce inside the node, then one
// across nodes, which adds in the same order (the node's ranks, then the node sums). avg is the
// engine's own: reduce_op::avg inside the node (the node sum times 1/L), then across nodes (the
// sum of the node averages times 1/nodes), so on device memory an average rounds twice. (How
// NCCL orders its additions is NCCL's business: on NCCL the order above is that of the steps,
// not of the additions inside one.)

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/comm/detail/node_plan.hpp>
#include <dparallel/comm/detail/serial_worker.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// How make_hierarchical finds each rank's node. The first that applies wins: `node_id` (this
/// rank's node, any number >= 0: ranks passing equal numbers share a node), `ranks_per_node`
/// (parent rank r is on node r / ranks_per_node), the environment variable
/// DPARALLEL_RANKS_PER_NODE (the same), and last the host name (the ranks of one machine share a
/// node, as MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) groups them). The overrides let one machine
/// run "2 nodes x 2 ranks" (tests, trials).
struct hierarchical_options {
  /// This rank's node; -1: not given.
  int node_id = -1;
  /// Ranks per node, counted in parent-rank order; 0: not given.
  int ranks_per_node = 0;
};

/// The hierarchical communicator of one rank (see the top of this file); satisfies
/// dparallel::communicator. Build it with make_hierarchical.
class hierarchical_communicator {
 public:
  /// A collective of `parent`: every rank calls it at the same point of its collectives. Throws
  /// the same invalid_argument on every rank when the nodes differ in size.
  hierarchical_communicator(process_group parent, hierarchical_options const& o) : parent_(std::move(parent)) {
    dparallel::detail::require(parent_.valid(), "make_hierarchical: expected a process group, found an empty one");
    int const per_node = o.ranks_per_node > 0 ? o.ranks_per_node : dparallel::detail::ranks_per_node_from_env();
    std::int64_t key = o.node_id >= 0 ? o.node_id
                             : per_node > 0 ? parent_.rank() / per_node
                                            : dparallel::detail::host_node_key();
    std::vector<std::int64_t> keys(static_cast<std::size_t>(parent_.size()));
    parent_.all_gather(view(keys), tensor_ref(&key, 1, dtype_v<std::int64_t>)).wait();
    plan_ = dparallel::detail::plan_nodes(keys, parent_.rank());
    node_ = parent_.split(plan_.node, parent_.rank());
    cross_ = parent_.split(plan_.local_rank, plan_.node);
  }
  hierarchical_communicator(hierarchical_communicator const&) = delete;
  hierarchical_communicator& operator=(hierarchical_communicator const&) = delete;

  /// Joins the worker. Collectives still pending abort the groups first (their peers would
  /// otherwise wait for this rank until the timeout).
  ~hierarchical_communicator() {
    if (worker_.pending() != 0) abort_all("its hierarchical communicator was destroyed with collectives pending");
    worker_.stop();
  }

  /// This rank: its parent rank.
  [[nodiscard]] int rank() const { return parent_.rank(); }
  /// The parent's size.
  [[nodiscard]] int size() const { return parent_.size(); }
  /// The parent's bound device (process_group::bound_device).
  [[nodiscard]] std::optional<device> bound_device() const { return parent_.bound_device(); }
  /// This rank's node, in [0, nodes()); nodes are numbered by their smallest parent rank.
  [[nodiscard]] int node() const noexcept { return plan_.node; }
  /// Number of nodes.
  [[nodiscard]] int nodes() const noexcept { return static_cast<int>(plan_.nodes.size()); }
  /// This rank's place in its node (nodes list their ranks in parent-rank order).
  [[nodiscard]] int local_rank() const noexcept { return plan_.local_rank; }
  /// The ranks of this node (a subgroup of the parent).
  [[nodiscard]] process_group const& node_group() const noexcept { return node_; }
  /// The ranks with this rank's local rank, one per node, in node order (a subgroup of the parent).
  [[nodiscard]] process_group const& cross_group() const noexcept { return cross_; }

  /// The hierarchical all-reduce described at the top of this file; F32, F64, F16 and BF16.
  work all_reduce(tensor_ref t, reduce_op op = reduce_op::sum) {
    (void)dparallel::detail::dispatch_reducible(t.dtype(), [](auto) { return 0; });  // rejects others now
    return issue([this, t, op] { hierarchical_all_reduce(t, op); });
  }
  /// Forwarded to the parent.
  work reduce(tensor_ref t, int root, reduce_op op = reduce_op::sum) {
    return issue([this, t, root, op] { parent_.reduce(t, root, op).wait(); });
  }
  /// Forwarded to the parent.
  work broadcast(tensor_ref t, int root) {
    return issue([this, t, root] { parent_.broadcast(t, root).wait(); });
  }
  /// Forwarded to the parent.
  work reduce_scatter(tensor_ref out, tensor_ref in, reduce_op op = reduce_op::sum) {
    return issue([this, out, in, op] { parent_.reduce_scatter(out, in, op).wait(); });
  }
  /// Forwarded to the parent.
  work all_gather(tensor_ref out, tensor_ref in) {
    return issue([this, out, in] { parent_.all_gather(out, in).wait(); });
  }
  /// Forwarded to the parent.
  work barrier() {
    return issue([this] { parent_.barrier().wait(); });
  }
  /// Aborts the parent, node and cross groups: every pending and future wait of every rank fails.
  void abort(std::string const& why) { abort_all(why); }

  /// The parent's timeout (the node and cross groups use the same).
  [[nodiscard]] std::chrono::milliseconds timeout() const { return parent_.timeout(); }
  /// Sets the timeout of the parent, node and cross groups.
  void set_timeout(std::chrono::milliseconds t) {
    parent_.set_timeout(t);
    node_.set_timeout(t);
    cross_.set_timeout(t);
  }
  /// Number of collectives this communicator has finished.
  [[nodiscard]] std::uint64_t completed_ops() const noexcept { return worker_.completed(); }
  /// Blocks until every collective issued so far has finished (successfully or not).
  void drain() { worker_.drain(); }

 private:
  void abort_all(std::string const& why) {
    for (auto const* g : {&parent_, &node_, &cross_}) {
      try {
        g->abort(why);
      } catch (...) {  // NOLINT(bugprone-empty-catch): an abort on a failed group has nothing to add
      }
    }
  }

  template <class F>
  work issue(F f) {
    return worker_.submit([f = std::move(f)](std::uint64_t) { f(); });
  }

  void hierarchical_all_reduce(tensor_ref t, reduce_op op) {
    if (t.device().kind != device_kind::host) {
      guarded([&] { device_all_reduce(t, op); });
      return;
    }
    auto const L = static_cast<std::size_t>(node_.size());
    std::size_t const n = t.size();
    std::size_t const m = (n + L - 1) / L;
    std::size_t const bytes = size_of(t.dtype());
    tensor_ref buf = t;
    if (m * L != n) {  // pad with zeros to L equal slices
      staging_.assign(m * L * bytes, std::byte{0});
      if (n != 0) std::memcpy(staging_.data(), t.data(), n * bytes);
      buf = tensor_ref(staging_.data(), m * L, t.dtype(), t.device());
    }
    auto* base = static_cast<std::byte*>(buf.data());
    tensor_ref const slice(base + static_cast<std::size_t>(node_.rank()) * m * bytes, m, t.dtype(), t.device());
    guarded([&] {
      node_.reduce_scatter(slice, buf, reduce_op::sum).wait();
      cross_.all_reduce(slice, reduce_op::sum).wait();
      if (op == reduce_op::avg) {
        dparallel::detail::dispatch_reducible(t.dtype(), [&](auto zero) {
          using T = decltype(zero);
          using A = dparallel::detail::accumulator_t<T>;
          A const scale = dparallel::detail::avg_scale<A>(size());
          T* x = static_cast<T*>(slice.data());
          for (std::size_t i = 0; i < m; ++i) x[i] = dparallel::detail::narrow<T>(dparallel::detail::widen(x[i]) * scale);
        });
      }
      node_.all_gather(buf, slice).wait();
    });
    if (buf.data() != t.data() && n != 0) std::memcpy(t.data(), staging_.data(), n * bytes);
  }

  // The all_reduce of a tensor in device memory (see the top of this file): no element is read
  // or written here.
  void device_all_reduce(tensor_ref t, reduce_op op) {
    auto const L = static_cast<std::size_t>(node_.size());
    std::size_t const m = t.size() / L;
    std::size_t const body = m * L;
    std::size_t const bytes = size_of(t.dtype());
    auto* base = static_cast<std::byte*>(t.data());
    if (m != 0) {
      tensor_ref const all(base, body, t.dtype(), t.device());
      tensor_ref const slice(base + static_cast<std::size_t>(node_.rank()) * m * bytes, m, t.dtype(), t.device());
      node_.reduce_scatter(slice, all, op).wait();
      cross_.all_reduce(slice, op).wait();
      node_.all_gather(all, slice).wait();
    }
    if (body != t.size()) {
      tensor_ref const tail(base + body * bytes, t.size() - body, t.dtype(), t.device());
      node_.all_reduce(tail, op).wait();
      cross_.all_reduce(tail, op).wait();
    }
  }

  // Runs the steps of one all_reduce; a failed step fails this rank's other groups too.
  template <class Steps>
  void guarded(Steps&& steps) {
    try {
      steps();
    } catch (...) {
      // A failed step fails this rank's other groups too, so that every rank fails within the
      // timeout (a peer in another node would otherwise wait for this rank's next step).
      std::string cause = "unknown error";
      try {
        throw;
      } catch (std::exception const& e) {
        cause = e.what();
      } catch (...) {  // NOLINT(bugprone-empty-catch): the cause stays unknown
      }
      abort_all("a step of its hierarchical all_reduce failed: " + cause);
      node_.drain();  // the buffers must outlive every step
      cross_.drain();
      throw;
    }
  }

  process_group parent_;
  dparallel::detail::node_plan plan_;
  process_group node_;
  process_group cross_;
  std::vector<std::byte> staging_;        // worker thread only
  dparallel::detail::serial_worker worker_;  // last: its thread runs jobs that use the members above
};

static_assert(communicator<hierarchical_communicator>);

/// A process group over the ranks of `parent` whose all_reduce is hierarchical: reduce_scatter
/// inside each node, all_reduce of each slice across nodes, all_gather inside the node (the exact
/// order of the additions is at the top of comm/hierarchical.hpp); the other collectives are the
/// parent's. Ranks and size are the parent's. A collective of `parent` (it exchanges the node
/// keys and splits the parent twice): every rank calls it at the same point of its collectives;
/// nodes of different sizes throw the same invalid_argument on every rank. `o` says how nodes
/// are found (hierarchical_options). The group has no subgroups of its own (split the parent).
inline process_group make_hierarchical(process_group parent, hierarchical_options const& o = {}) {
  return process_group(std::make_shared<hierarchical_communicator>(std::move(parent), o));
}

DPARALLEL_NAMESPACE_END

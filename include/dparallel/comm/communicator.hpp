#pragma once
// The communicator concept every engine satisfies (host threads, shared memory, MPI, NCCL), and
// process_group: a cheap, copyable, type-erased handle to any of them.
//
// Contract of every engine (each rank holds its own communicator of one group):
// - collectives are asynchronous: a call enqueues the collective on the rank's communication
//   thread or stream and returns a work at once; they run in the order issued;
// - collectives match across ranks by their sequence number: every rank must issue the same
//   collectives (same op, element count, dtype, root, reduce_op) in the same order;
// - buffers are modified in place and must stay valid, and untouched by the caller, until the
//   work is complete (also when the caller gives up on it: abort() then drain() first);
// - a peer that does not arrive within the timeout, an abort() on any rank and a mismatched
//   collective make the waits of every rank fail with a comm_error naming the rank at fault.

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/subgroup_plan.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/buffer.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

class process_group;

namespace detail {
/// Every rank of `parent` calls it with the same plan (but its own place): its engine's subgroup
/// (for wrappers such as the desync detector, which build theirs on their inner group's).
process_group make_subgroup(process_group const& parent, subgroup_plan const& plan);
}  // namespace detail

/// How a reduction combines the ranks' values. `avg` is the sum (in rank order) followed by one
/// multiplication by T(1) / T(world size), so it is as deterministic as `sum`.
enum class reduce_op : std::uint8_t { sum, avg };

constexpr std::string_view name_of(reduce_op op) noexcept { return op == reduce_op::sum ? "sum" : "avg"; }

/// What a type must provide to be a communicator: one rank's endpoint of a process group.
/// - all_reduce(t, op): in place; every rank ends with the reduction of all ranks' t;
/// - reduce(t, root, op): in place; the reduction lands in root's t (other ranks' t unchanged);
/// - broadcast(t, root): every rank's t becomes root's t;
/// - reduce_scatter(out, in, op): in has size()*n elements, out n; rank r's out is the reduction
///   of every rank's in[r*n, (r+1)*n);
/// - all_gather(out, in): in has n elements, out size()*n; out[r*n, (r+1)*n) is rank r's in;
/// - barrier(): completes once every rank has issued it;
/// - abort(why): every pending and future wait of every rank fails, naming this rank and `why`.
template <class C>
concept communicator = requires(C& c, tensor_ref t, tensor_ref u, int root, reduce_op op) {
  { c.rank() } -> std::same_as<int>;
  { c.size() } -> std::same_as<int>;
  { c.all_reduce(t, op) } -> std::same_as<work>;
  { c.reduce(t, root, op) } -> std::same_as<work>;
  { c.broadcast(t, root) } -> std::same_as<work>;
  { c.reduce_scatter(t, u, op) } -> std::same_as<work>;
  { c.all_gather(t, u) } -> std::same_as<work>;
  { c.barrier() } -> std::same_as<work>;
  c.abort(std::string("why"));
};

namespace detail {

/// The virtual interface behind process_group: one virtual call per collective, never per element.
class communicator_interface {
 public:
  virtual ~communicator_interface() = default;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  virtual work all_reduce(tensor_ref t, reduce_op op) = 0;
  virtual work reduce(tensor_ref t, int root, reduce_op op) = 0;
  virtual work broadcast(tensor_ref t, int root) = 0;
  virtual work reduce_scatter(tensor_ref out, tensor_ref in, reduce_op op) = 0;
  virtual work all_gather(tensor_ref out, tensor_ref in) = 0;
  virtual work barrier() = 0;
  virtual void abort(std::string why) = 0;
  [[nodiscard]] virtual std::chrono::milliseconds timeout() const = 0;
  virtual void set_timeout(std::chrono::milliseconds t) = 0;
  [[nodiscard]] virtual std::uint64_t completed_ops() const = 0;
  virtual void drain() = 0;
  virtual void hold() = 0;
  virtual void release() = 0;
  [[nodiscard]] virtual bool coalesces_in_place() const = 0;
  [[nodiscard]] virtual bool detects_desync() const = 0;
  virtual work all_reduce_coalesced(std::span<tensor_ref const> tensors, reduce_op op) = 0;
  virtual work reduce_scatter_coalesced(tensor_ref out, std::span<tensor_ref const> in, reduce_op op) = 0;
  virtual work all_gather_coalesced(std::span<tensor_ref const> tensors) = 0;
  virtual std::shared_ptr<std::byte> allocate(std::size_t bytes) = 0;
  /// Every parent rank calls it with the same plan (but its own place): this rank's subgroup,
  /// empty when it is in none.
  virtual process_group subgroup(subgroup_plan const& plan) = 0;
  [[nodiscard]] virtual std::optional<device> bound_device() const = 0;
};

/// Wraps a communicator C. Members C may lack (timeout, set_timeout, completed_ops, drain, hold,
/// release, gpu or bound_device) get neutral stand-ins: a stored timeout, 0 completed operations,
/// a drain that returns at once, a hold and release that do nothing, no bound device.
template <communicator C>
class communicator_model final : public communicator_interface {
 public:
  explicit communicator_model(std::shared_ptr<C> c) : c_(std::move(c)) {}

  [[nodiscard]] int rank() const override { return c_->rank(); }
  [[nodiscard]] int size() const override { return c_->size(); }
  work all_reduce(tensor_ref t, reduce_op op) override { return c_->all_reduce(t, op); }
  work reduce(tensor_ref t, int root, reduce_op op) override { return c_->reduce(t, root, op); }
  work broadcast(tensor_ref t, int root) override { return c_->broadcast(t, root); }
  work reduce_scatter(tensor_ref out, tensor_ref in, reduce_op op) override { return c_->reduce_scatter(out, in, op); }
  work all_gather(tensor_ref out, tensor_ref in) override { return c_->all_gather(out, in); }
  work barrier() override { return c_->barrier(); }
  void abort(std::string why) override { c_->abort(std::move(why)); }
  [[nodiscard]] std::chrono::milliseconds timeout() const override {
    if constexpr (requires { c_->timeout(); }) {
      return std::chrono::milliseconds(c_->timeout());
    } else {
      return timeout_;
    }
  }
  void set_timeout(std::chrono::milliseconds t) override {
    if constexpr (requires { c_->set_timeout(t); }) {
      c_->set_timeout(t);
    } else {
      timeout_ = t;
    }
  }
  [[nodiscard]] std::uint64_t completed_ops() const override {
    if constexpr (requires { c_->completed_ops(); }) {
      return static_cast<std::uint64_t>(c_->completed_ops());
    } else {
      return 0;
    }
  }
  void drain() override {
    if constexpr (requires { c_->drain(); }) c_->drain();
  }
  void hold() override {
    if constexpr (requires { c_->hold(); }) c_->hold();
  }
  void release() override {
    if constexpr (requires { c_->release(); }) c_->release();
  }
  // The engine has all three *_coalesced collectives.
  static constexpr bool lists = requires(C& c, std::span<tensor_ref const> t, tensor_ref o) {
    c.all_reduce_coalesced(t, reduce_op::sum);
    c.reduce_scatter_coalesced(o, t, reduce_op::sum);
    c.all_gather_coalesced(t);
  };
  [[nodiscard]] bool coalesces_in_place() const override { return lists; }
  [[nodiscard]] bool detects_desync() const override {
    if constexpr (requires { c_->detects_desync(); }) return c_->detects_desync();
    else return false;
  }
  std::shared_ptr<std::byte> allocate(std::size_t bytes) override {
    if constexpr (requires { { c_->allocate(bytes) } -> std::same_as<std::shared_ptr<std::byte>>; }) {
      if (auto p = c_->allocate(bytes)) return p;
    }
    auto owner = std::make_shared<buffer<std::byte>>(bytes);
    return std::shared_ptr<std::byte>(owner, owner->data());
  }
  work all_reduce_coalesced(std::span<tensor_ref const> tensors, reduce_op op) override {
    if constexpr (lists) return c_->all_reduce_coalesced(tensors, op);
    else refuse_lists("all_reduce_coalesced", "all_reduce");
  }
  work reduce_scatter_coalesced(tensor_ref out, std::span<tensor_ref const> in, reduce_op op) override {
    if constexpr (lists) return c_->reduce_scatter_coalesced(out, in, op);
    else refuse_lists("reduce_scatter_coalesced", "reduce_scatter");
  }
  work all_gather_coalesced(std::span<tensor_ref const> tensors) override {
    if constexpr (lists) return c_->all_gather_coalesced(tensors);
    else refuse_lists("all_gather_coalesced", "all_gather");
  }
  process_group subgroup(subgroup_plan const& plan) override;
  [[nodiscard]] std::optional<device> bound_device() const override {
    if constexpr (requires { { c_->gpu() } -> std::convertible_to<device>; }) {
      return device(c_->gpu());
    } else if constexpr (requires { { c_->bound_device() } -> std::convertible_to<std::optional<device>>; }) {
      return c_->bound_device();
    } else {
      return std::nullopt;
    }
  }

 private:
  [[noreturn]] static void refuse_lists(char const* what, char const* plain) {
    throw invalid_argument(std::string("dparallel: process_group::") + what +
                           ": this group's engine moves one buffer at a time (coalesces_in_place() is false); " + plain +
                           " a buffer holding the tensors");
  }

  std::shared_ptr<C> c_;
  std::chrono::milliseconds timeout_ = std::chrono::seconds(300);
};

}  // namespace detail

/// A copyable handle to one rank's communicator, whatever its engine; copies share it (the last
/// copy destroyed releases the communicator, which joins its thread). The members mirror the
/// communicator concept, plus the timeout and a few observers. A default-constructed group is
/// empty: every member but valid() throws invalid_argument.
///
/// One thread at a time should issue a rank's collectives (their order is the matching order);
/// work handles may be waited on from any thread.
class process_group {
 public:
  process_group() = default;

  /// Shares ownership of `c`.
  template <communicator C>
  explicit process_group(std::shared_ptr<C> c) {
    dparallel::detail::require(c != nullptr, "process_group: expected a communicator, found a null pointer");
    impl_ = std::make_shared<detail::communicator_model<C>>(std::move(c));
  }

  /// False for a default-constructed (empty) group.
  [[nodiscard]] bool valid() const noexcept { return impl_ != nullptr; }

  /// This rank, in [0, size()).
  [[nodiscard]] int rank() const { return get().rank(); }
  /// Number of ranks in the group.
  [[nodiscard]] int size() const { return get().size(); }

  /// In place: every rank ends with the reduction of all ranks' `t` (see communicator).
  work all_reduce(tensor_ref t, reduce_op op = reduce_op::sum) const { return get().all_reduce(t, op); }
  /// In place: the reduction of all ranks' `t` lands in rank `root`'s `t`.
  work reduce(tensor_ref t, int root, reduce_op op = reduce_op::sum) const { return get().reduce(t, root, op); }
  /// Every rank's `t` becomes rank `root`'s `t`.
  work broadcast(tensor_ref t, int root) const { return get().broadcast(t, root); }
  /// `out` has n elements, `in` size()*n; `out` may be in's block rank() (in place) or disjoint from `in`.
  work reduce_scatter(tensor_ref out, tensor_ref in, reduce_op op = reduce_op::sum) const {
    return get().reduce_scatter(out, in, op);
  }
  /// `in` has n elements, `out` size()*n; `in` may be out's block rank() (in place) or disjoint from `out`.
  work all_gather(tensor_ref out, tensor_ref in) const { return get().all_gather(out, in); }
  /// Completes once every rank has issued it.
  work barrier() const { return get().barrier(); }
  /// Every pending and future wait on every rank fails with a comm_error naming this rank and `why`.
  void abort(std::string why) const { get().abort(std::move(why)); }

  /// How long a collective of this rank waits for its peers before failing with timeout_error.
  [[nodiscard]] std::chrono::milliseconds timeout() const { return get().timeout(); }
  /// Applies to the collectives this rank issues after the call.
  void set_timeout(std::chrono::milliseconds t) {
    dparallel::detail::require(t.count() > 0, "process_group::set_timeout: expected a positive timeout, found " +
                                                  std::to_string(t.count()) + " ms");
    get().set_timeout(t);
  }
  /// Number of collectives this rank has finished (successfully or not).
  [[nodiscard]] std::uint64_t completed_ops() const { return get().completed_ops(); }
  /// The color of split's ranks that join no subgroup (as MPI_UNDEFINED).
  static constexpr int no_group = -1;

  /// Splits the group as MPI_Comm_split: the ranks that pass the same `color` (>= 0) form one
  /// subgroup, ranked by `key`, then by their rank here; a rank passing no_group gets an empty
  /// process_group. A collective of this group: every rank calls it at the same point of its
  /// collectives (after its earlier collectives were issued; it waits for an exchange of the
  /// requests, so mismatched requests throw the same invalid_argument on every rank, and this
  /// group stays usable). A subgroup has its own timeout (this group's, copied), sequence of
  /// collectives and failure: a failure inside it fails its members only, naming the rank at
  /// fault in group numbering followed by its parent rank. Subgroups whose members are
  /// disjoint run their collectives concurrently. The engine builds it (host: shared memory of
  /// this process; shm: a new segment; MPI: MPI_Comm_split). See docs/multi-process.md.
  [[nodiscard]] process_group split(int color, int key = 0) const;
  /// The subgroup of the parent ranks `ranks` (group rank i is ranks[i], in the order given):
  /// every rank of this group calls it with the same list (checked: a different list throws the
  /// same invalid_argument on every rank); ranks not in the list get an empty process_group.
  /// Otherwise as split.
  [[nodiscard]] process_group new_group(std::vector<int> const& ranks) const;

  /// Blocks until every collective this rank issued has finished, successfully or not; never
  /// rethrows their failures. Use it before freeing the buffers of works nobody will wait on
  /// (after abort(), when giving up: the pending collectives then fail at once).
  void drain() const { get().drain(); }

  /// A hint for a caller that issues a few collectives and then only waits for them: those issued
  /// from now on may stay queued, for the next drain() to run them on the calling thread (no
  /// hand-off to a communication thread); release() hands them back. Wait for them with drain()
  /// (or release() first): until one of the two, their works may not complete. Engines without
  /// such a thread ignore it (the host engine has one).
  void hold() const { get().hold(); }
  /// Ends a hold().
  void release() const { get().release(); }

  /// Whether the *_coalesced collectives below are available: the engine reads and writes a list
  /// of tensors as one array without a buffer of its own (the host engine of thread ranks reads
  /// them in place; the shared-memory engine copies them into its segment and the results out).
  [[nodiscard]] bool coalesces_in_place() const { return get().coalesces_in_place(); }
  /// Whether the group compares every rank's collectives before running them (desync detection,
  /// comm/desync.hpp): DDP then also checks, each step, that the ranks step alike (batch sizes,
  /// sampler epochs).
  [[nodiscard]] bool detects_desync() const { return get().detects_desync(); }
  /// all_reduce of `tensors` read as one array (their elements one after the other), in place: the
  /// same results, bit for bit, as an all_reduce of a buffer holding them. Every rank's array has
  /// the same number of elements of one dtype, cut into tensors as each rank likes: it matches a
  /// peer's all_reduce_coalesced or plain all_reduce of as many elements (a difference in count,
  /// dtype or op fails the group, as a mismatched collective does). The list is read while the
  /// collective runs: keep it alive and unchanged until the work completes (so for the two
  /// below). DDP uses it for its buckets where the engine has it (no copies into bucket storage
  /// and back); engines without it throw invalid_argument (so do the two below).
  work all_reduce_coalesced(std::span<tensor_ref const> tensors, reduce_op op = reduce_op::sum) const {
    return get().all_reduce_coalesced(tensors, op);
  }
  /// reduce_scatter from `in` read as one array of size() blocks of out.size() elements: `out`
  /// gets block rank() of the reduction, bit for bit what reduce_scatter of a buffer holding the
  /// tensors gives. `out` must lie apart from the tensors. It matches a peer's
  /// reduce_scatter_coalesced or plain reduce_scatter of as many elements. ZeRO-1 reduces its
  /// buckets this way (the gradients, and a few zeros of padding, without bucket storage).
  work reduce_scatter_coalesced(tensor_ref out, std::span<tensor_ref const> in,
                                reduce_op op = reduce_op::sum) const {
    return get().reduce_scatter_coalesced(out, in, op);
  }
  /// all_gather in place over `tensors` read as one array of size() equal blocks: this rank's
  /// block rank() is its input, and every rank's array ends holding every block. It matches a
  /// peer's all_gather_coalesced or plain all_gather of as many elements. ZeRO-1 gathers the
  /// updated parameters this way (straight into the parameters).
  work all_gather_coalesced(std::span<tensor_ref const> tensors) const { return get().all_gather_coalesced(tensors); }

  /// `bytes` zeroed bytes of host memory, 64-byte aligned, for buffers this group's collectives
  /// take (as NCCL's ncclMemAlloc, or PyTorch's symmetric memory). On a shared-memory group (shm,
  /// or MPI on one node) it lies in the group's segment (shm::options::arena_bytes per rank): an
  /// all_reduce or reduce of a buffer that every rank allocated here reads and writes the ranks'
  /// buffers in place instead of copying them through the segment, the speed of thread ranks
  /// (the same bits either way). Elsewhere, and when the segment is full, ordinary memory. The
  /// memory stays valid after the group is gone. E.g. a model's gradients allocated here, with
  /// gradient_as_bucket_view, are all-reduced without a copy. See docs/multi-process.md.
  [[nodiscard]] std::shared_ptr<std::byte> allocate(std::size_t bytes) const { return get().allocate(bytes); }

  /// The device this rank's collectives are bound to: an NCCL rank's GPU (the communicator's
  /// gpu()), whatever the launch chose; empty for engines that take memory anywhere (host, shared
  /// memory, MPI). DDP takes it as its default device (an explicit options::local_device must be on it).
  [[nodiscard]] std::optional<device> bound_device() const { return get().bound_device(); }

 private:
  [[nodiscard]] detail::communicator_interface& get() const {
    dparallel::detail::require(impl_ != nullptr,
                               "process_group: this handle is empty (default-constructed); obtain one from "
                               "host::make_group, spawn's rank_context or another engine");
    return *impl_;
  }
  std::vector<std::int64_t> exchange_request(std::int64_t kind, std::int64_t a, std::int64_t b,
                                             std::int64_t count) const {
    std::vector<std::int64_t> mine{detail::subgroup_magic, kind, a, b, count};
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size()));
    get().all_gather(view(all), view(mine)).wait();
    return all;
  }

  friend process_group detail::make_subgroup(process_group const& parent, detail::subgroup_plan const& plan);
  std::shared_ptr<detail::communicator_interface> impl_;
};

inline process_group detail::make_subgroup(process_group const& parent, subgroup_plan const& plan) {
  return parent.get().subgroup(plan);
}

inline process_group process_group::split(int color, int key) const {
  auto const all = exchange_request(detail::subgroup_kind_split, color, key, 0);
  return get().subgroup(detail::plan_split(all, rank(), size(), no_group));
}

inline process_group process_group::new_group(std::vector<int> const& ranks) const {
  auto const all = exchange_request(detail::subgroup_kind_new_group, detail::rank_list_hash(ranks),
                                    ranks.empty() ? -1 : ranks.front(), static_cast<std::int64_t>(ranks.size()));
  return get().subgroup(detail::plan_new_group(all, ranks, rank(), size()));
}

template <communicator C>
process_group detail::communicator_model<C>::subgroup(subgroup_plan const& plan) {
  if constexpr (requires { { c_->subgroup(plan) } -> std::same_as<process_group>; }) {
    return c_->subgroup(plan);
  } else {
    throw invalid_argument("dparallel: process_group::split / new_group: this group's communicator has no "
                           "subgroups (the host, shared-memory and MPI engines and the desync wrapper have them)");
  }
}

static_assert(communicator<process_group>);

DPARALLEL_NAMESPACE_END

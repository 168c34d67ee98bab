#pragma once
// ZeRO stage 1's reduce policy: DDP's bucketed reduction, overlapped with backward, where each
// bucket is reduce-scattered instead of all-reduced, so that each rank ends the step with its own
// shard of the averaged gradient (see zero_redundancy_optimizer, which updates that shard).

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/bucketed_reduce.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace policy {

/// Bucketed reduce-scatter of the gradients (ZeRO stage 1; the reduce policy of ddp_zero1).
///
/// The buckets, their order, the one-time rebuild in the order the gradients became ready,
/// grad_ready, no_sync accumulation and the plan check across ranks are bucketed_all_reduce's.
/// Bucket b holds `elements` gradients; its storage is padded with zeros to
/// `padded_elements(elements, N)` (a multiple of the world size N) and split into N shards of
/// `shard_elements(b)`: rank r owns elements [r * shard_elements(b), (r + 1) * shard_elements(b))
/// of the bucket (the tail of the last shards may be padding; a bucket of fewer than N elements
/// leaves some ranks a shard of padding only).
///
/// - The first synchronised step all-reduces, exactly as DDP (the bucket plan is rebuilt after
///   it), writes the averaged gradients to the model and copies this rank's shards of them into
///   the gradient shards.
/// - Every later synchronised step reduce-scatters each full bucket into this rank's gradient
///   shard (reduce_op::avg, the same rank-order sum and scale as DDP's all-reduce on the host and
///   MPI engines: the same bits), while backward goes on; the model's gradients are then left as
///   this rank's step function computed them (not averaged). On an engine with
///   process_group::reduce_scatter_coalesced (thread ranks, shared memory), a step whose function
///   marked no gradient ready and that accumulated nothing reduce-scatters each bucket from the
///   list of its gradients and a few zeros of padding: no copy into bucket storage.
/// - The bucket storage is free between steps: zero_redundancy_optimizer all-gathers the
///   updated parameters through it. Where those all-gathers run on into the next step
///   (zero_options::overlap_gather), the optimizer sets a stage guard: it is called before a
///   gradient is first written into a bucket's storage, and completes (or refuses) that bucket's
///   gather first.
///
/// Memory per rank: DDP's bucket storage (plus padding: fewer than N elements per bucket) and
/// one gradient shard per bucket (1/N of the parameters). gradient_as_bucket_view is refused
/// (the buckets need padding, which the gradients' own memory does not have).
class bucketed_reduce_scatter : public bucketed_reduce<false, bucketed_reduce_scatter> {
  using base = bucketed_reduce<false, bucketed_reduce_scatter>;
  friend base;

 public:
  /// Each rank keeps only its shard of the averaged gradients: module()'s own gradients are not
  /// the average, so whole-model optimizers and clip_grad_norm refuse such a wrapper.
  static constexpr bool shards_gradients = true;

  /// Elements of a bucket of `elements` gradients once padded for `world` ranks: the next
  /// multiple of `world` (0 stays 0).
  [[nodiscard]] static constexpr std::size_t padded_elements(std::size_t elements, int world) noexcept {
    auto const n = static_cast<std::size_t>(world < 1 ? 1 : world);
    return (elements + n - 1) / n * n;
  }

  /// Checks the options, plans the buckets and checks that every rank planned the same.
  template <class Set>
  void on_construct(Set& s) {
    detail::require(!s.opts.gradient_as_bucket_view,
                    "ZeRO-1 (bucketed_reduce_scatter) on rank " + std::to_string(s.rank()) +
                        ": expected options::gradient_as_bucket_view = false, found true; the reduce-scatter needs "
                        "bucket storage padded to a multiple of the world size, which the gradients' own memory "
                        "does not have");
    base::on_construct(s);
  }

  /// Prepares this step's buckets (none under no_sync). Throws invalid_argument when the gradient
  /// shards of the last synchronised step were not used by a zero_redundancy_optimizer: an update
  /// of module() written by hand reads gradients that are not the average, and the ranks diverge.
  template <class Set>
  void begin_step(Set& s) {
    if (reductions_ != consumed_)
      throw invalid_argument(
          "dparallel: ZeRO-1 (ddp_zero1) on rank " + std::to_string(s.rank()) +
          ": the previous synchronised step's gradient shards were not used by a zero_redundancy_optimizer; after a "
          "ZeRO-1 step each rank holds only its shard of the averaged gradient (module()'s gradients are its own, "
          "not averaged), so an update written by hand makes the ranks diverge: call opt.step(lr) of a "
          "dparallel::zero_redundancy_optimizer over this wrapper after every synchronised step, or use "
          "parallel<Model, dparallel::ddp> for a hand-written update");
    scatter_now_ = this->rebuilt_;
    base::begin_step(s);
  }

  /// This rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The number of ranks the buckets are split over.
  [[nodiscard]] int world_size() const noexcept { return world_; }
  /// Elements of each rank's shard of bucket `b`: padded_elements / world_size().
  [[nodiscard]] std::size_t shard_elements(std::size_t b) const { return shard_elements_.at(b); }
  /// The first element of this rank's shard inside bucket `b`: rank() * shard_elements(b).
  [[nodiscard]] std::size_t shard_offset(std::size_t b) const {
    return static_cast<std::size_t>(rank_) * shard_elements(b);
  }
  /// The elements of this rank's shard of bucket `b` that are gradients (the rest is padding).
  [[nodiscard]] std::size_t shard_valid(std::size_t b) const {
    std::size_t const lo = shard_offset(b), e = this->layout_.plan.at(b).elements;
    return lo >= e ? 0 : std::min(shard_elements(b), e - lo);
  }
  /// This rank's shard of bucket `b`'s averaged gradient, after a synchronised step.
  [[nodiscard]] tensor_ref grad_shard(std::size_t b) const {
    return tensor_ref(shards_.at(b).get(), shard_elements(b), this->layout_.plan[b].dtype, device_);
  }
  /// Bucket `b`'s whole padded storage (free between steps).
  [[nodiscard]] tensor_ref bucket_storage(std::size_t b) const {
    auto const& spec = this->layout_.plan.at(b);
    return tensor_ref(this->layout_.buckets.at(b).storage.get(), padded_elements(spec.elements, world_), spec.dtype,
                      device_);
  }
  /// Synchronised steps reduced so far (the gradient shards are fresh when it grew).
  [[nodiscard]] std::uint64_t reductions() const noexcept { return reductions_; }
  /// zero_redundancy_optimizer::step() tells it that it used the gradient shards of the last
  /// synchronised step; the next step() refuses to run until then.
  void shards_consumed() noexcept { consumed_ = reductions_; }
  /// Bumped by every bucket plan (at construction, and once by the rebuild after the first step).
  [[nodiscard]] std::uint64_t plan_generation() const noexcept { return plans_; }
  /// Called with (bucket, unused) before a synchronised step writes a gradient into the bucket's
  /// storage (unused: the parameter took no part in the step); empty: nothing to check. Set by
  /// zero_redundancy_optimizer while its all-gathers may still be in flight.
  void set_stage_guard(std::function<void(std::size_t, bool)> guard) { guard_ = std::move(guard); }
  /// Bytes of gradient-shard storage this rank holds.
  [[nodiscard]] std::size_t grad_shard_bytes() const noexcept {
    std::size_t n = 0;
    for (std::size_t b = 0; b < shard_elements_.size(); ++b)
      n += shard_elements_[b] * size_of(this->layout_.plan[b].dtype);
    return n;
  }

 private:
  // After every plan: one zeroed gradient shard per bucket.
  template <class Set>
  void on_plan(Set& s) {
    using backend = typename Set::backend_type;
    rank_ = s.rank();
    world_ = s.world_size();
    device_ = s.devices[0];
    shard_elements_.clear();
    shards_.clear();
    pads_.clear();
    for (auto const& b : this->layout_.plan) {
      std::size_t const m = padded_elements(b.elements, world_) / static_cast<std::size_t>(world_);
      shard_elements_.push_back(m);
      shards_.push_back(backend::allocate(device_, m * size_of(b.dtype)));
      std::size_t const pad = padded_elements(b.elements, world_) - b.elements;
      pads_.push_back(pad == 0 ? nullptr : backend::allocate(device_, pad * size_of(b.dtype)));  // zeroed; never written
    }
    ++plans_;
  }

  // A synchronised bucket whose gradients are all staged: all-reduce until the plan is final
  // (the first step), reduce-scatter into this rank's shard after.
  template <class Set>
  work launch_bucket(Set& s, std::size_t b, tensor_ref whole) {
    if (!scatter_now_) return s.group.all_reduce(whole, reduce_op::avg);
    if (whole.size() == 0) return work{};  // every rank has the same plan: none issues it
    return s.group.reduce_scatter(grad_shard(b), bucket_storage(b), reduce_op::avg);
  }

  // A bucket whose gradients are read in place (on an engine with the *_coalesced collectives):
  // the list of its gradients, then its padding, reduce-scattered without bucket storage.
  template <class Set>
  work launch_list(Set& s, std::size_t b, std::vector<tensor_ref> const& list) {
    if (list.empty()) return work{};  // every rank has the same plan: none issues it
    return s.group.reduce_scatter_coalesced(grad_shard(b), list, reduce_op::avg);
  }

  // The zeros that pad bucket b to a multiple of the world size, after its gradients.
  void pad_list(std::size_t b, std::vector<tensor_ref>& list) const {
    std::size_t const pad = padded_elements(this->layout_.plan[b].elements, world_) - this->layout_.plan[b].elements;
    if (pad != 0) list.emplace_back(pads_[b].get(), pad, this->layout_.plan[b].dtype, device_);
  }

  [[nodiscard]] bool scattering() const noexcept { return scatter_now_; }

  void before_stage(std::size_t b, bool unused) {
    if (guard_) guard_(b, unused);
  }

  // After a synchronised step (and the rebuild): when it all-reduced, the model holds the
  // averaged gradients; copy this rank's shards of them.
  template <class Set>
  void reduced(Set& s) {
    using ops = typename Set::backend_type::immediate;
    if (!scatter_now_) {
      for (std::size_t b = 0; b < this->layout_.plan.size(); ++b) {
        auto const& spec = this->layout_.plan[b];
        std::size_t const lo = shard_offset(b), hi = lo + shard_valid(b);
        tensor_ref const shard = grad_shard(b);
        for (std::size_t k = 0; k < spec.params.size(); ++k) {
          std::size_t const first = spec.offsets[k], last = first + this->layout_.counts[spec.params[k]];
          std::size_t const a = std::max(first, lo), z = std::min(last, hi);
          if (a >= z) continue;
          ops::copy(shard.subview(a - lo, z - a), s.grads[0][spec.params[k]].subview(a - first, z - a));
        }
      }
    }
    ++reductions_;
  }

  std::vector<std::size_t> shard_elements_;
  std::vector<std::shared_ptr<std::byte>> shards_;  // from Backend::allocate
  std::vector<std::shared_ptr<std::byte>> pads_;    // per bucket: its padding's zeros (null: none)
  device device_{};
  int rank_ = 0;
  int world_ = 1;
  bool scatter_now_ = false;  // this step reduce-scatters (the plan was rebuilt before it)
  std::uint64_t reductions_ = 0;
  std::uint64_t consumed_ = 0;  // reductions_ when zero_redundancy_optimizer last used the shards
  std::uint64_t plans_ = 0;
  std::function<void(std::size_t, bool)> guard_;  // set_stage_guard
};

}  // namespace policy
DPARALLEL_NAMESPACE_END

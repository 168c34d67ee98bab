#pragma once
// The communication-hook slot of DDP's bucketed all-reduce (PyTorch's register_comm_hook): a
// hook replaces the plain average of each gradient bucket by its own reduction (compression,
// low-rank approximation, ...). Built-in hooks: policy/compress_hooks.hpp (fp16_compress,
// bf16_compress). See docs/comm-hooks.md.
//
// A hook is a callable `hook(state, group, bucket) -> bucket_future`, registered with its state:
//   ddp.reducer().register_comm_hook(dparallel::compress_state{}, dparallel::bf16_compress);
// For each bucket, as soon as its gradients are ready (so it overlaps backward like the default),
// the reducer calls the hook on the step's thread with this rank's bucket (`bucket.data`, which
// the hook may overwrite), and the hook starts its collectives on `group` and returns at once. When
// the step's function has returned, the reducer waits for every bucket's work, then, bucket by
// bucket in launch order, runs the future's continuation (which may start and wait for further
// collectives: every rank runs the same continuations in the same order) and takes its result:
// a view of the bucket's reduced values, of the bucket's dtype and element count (checked: an
// invalid_argument otherwise), copied into the bucket unless it is the bucket itself. The result
// must be what every rank agrees on (an average over the ranks, for the gradients to stay in sync).
// Under no_sync nothing is reduced and the hook is not called; the first synchronised step hands
// it the weighted mean of the accumulated gradients, as the default all-reduce gets it.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// What a communication hook is given: one gradient bucket of this rank.
struct grad_bucket {
  /// The bucket's position in launch order (0 is reduced first); stable from step to step while
  /// the reducer keeps its plan (it re-plans once, after the first synchronised step).
  std::size_t index = 0;
  /// This rank's gradients of the bucket, one flat array (the hook may overwrite it; it is the
  /// gradients' own memory with options::gradient_as_bucket_view).
  tensor_ref data;
  /// The parameters whose gradients the bucket holds (indices into the model's parameter list).
  std::span<std::size_t const> params;
  /// Where parameter params[k]'s gradient starts in `data`, in elements.
  std::span<std::size_t const> offsets;
  /// Every parameter's element count, indexed by parameter (sizes[params[k]] is slot k's).
  std::span<std::size_t const> sizes;
};

/// A hook's reduced bucket, possibly still in flight: a work to wait for, then a continuation
/// that yields the view holding the result.
class bucket_future {
 public:
  /// No result (what a default-constructed future gives: invalid as a hook's answer).
  bucket_future() = default;
  /// Already reduced: `result` holds the bucket's reduced values.
  explicit bucket_future(tensor_ref result) : result_(result), has_result_(true) {}
  /// In flight: `result` holds the reduced values once `w` completed.
  bucket_future(work w, tensor_ref result) : work_(std::move(w)), result_(result), has_result_(true) {}
  /// In flight, with a continuation: once `w` completed, `then()` runs on the reducer's thread
  /// (every bucket's in launch order) and returns the view holding the reduced values; it may
  /// start and wait for more collectives.
  bucket_future(work w, std::function<tensor_ref()> then) : work_(std::move(w)), then_(std::move(then)) {}

  /// The collective(s) to wait for before the continuation.
  [[nodiscard]] work const& pending() const noexcept { return work_; }
  /// Waits (rethrowing a failed collective), runs the continuation once, returns the result.
  tensor_ref get() {
    work_.wait();
    if (then_) {
      result_ = then_();
      has_result_ = true;
      then_ = nullptr;
    }
    detail::require(has_result_, "DDP communication hook: the hook returned an empty bucket_future; expected a "
                                 "view of the reduced bucket (or a work and a continuation that yields one)");
    return result_;
  }

 private:
  work work_;
  std::function<tensor_ref()> then_;
  tensor_ref result_;
  bool has_result_ = false;
};

/// A communication hook for state type State: `hook(state, group, bucket)` starts the bucket's
/// reduction over `group` and returns its bucket_future (see the top of policy/comm_hook.hpp).
template <class Hook, class State>
concept comm_hook = std::move_constructible<Hook> && std::move_constructible<State> &&
                    requires(Hook& h, State& s, process_group const& g, grad_bucket const& b) {
                      { h(s, g, b) } -> std::same_as<bucket_future>;
                    };

namespace detail {

/// The reducer's side of the slot: the registered hook (type-erased, with its state) and each
/// bucket's future of the step in flight.
class hook_slot {
 public:
  /// Installs `hook` with `state` (replacing any earlier hook and its state).
  template <class State, class Hook>
  void set(State state, Hook hook) {
    auto st = std::make_shared<State>(std::move(state));
    fn_ = [st, h = std::move(hook)](process_group const& g, grad_bucket const& b) mutable { return h(*st, g, b); };
    futures_.clear();
  }
  /// Whether a hook is installed.
  [[nodiscard]] bool active() const noexcept { return static_cast<bool>(fn_); }

  /// Calls the hook for bucket `index` (this rank's values in `data`); the work to wait for.
  work launch(process_group const& g, std::size_t index, tensor_ref data, bucket_spec const& spec,
              std::span<std::size_t const> sizes) {
    if (futures_.size() <= index) futures_.resize(index + 1);
    futures_[index] = fn_(g, grad_bucket{index, data, spec.params, spec.offsets, sizes});
    return futures_[index].pending();
  }

  /// Bucket `index`'s reduced values (its continuation run), checked against the bucket `data`.
  tensor_ref result(std::size_t index, tensor_ref data, int rank) {
    require(index < futures_.size(), "DDP communication hook: no hook call is pending for bucket " +
                                         std::to_string(index));
    tensor_ref const r = std::exchange(futures_[index], bucket_future{}).get();
    require(r.dtype() == data.dtype() && r.size() == data.size(), [&] {
      return "DDP communication hook on rank " + std::to_string(rank) + ": bucket " + std::to_string(index) + " holds " +
             std::to_string(data.size()) + " x " + std::string(name_of(data.dtype())) + ", the hook returned " +
             std::to_string(r.size()) + " x " + std::string(name_of(r.dtype())) +
             "; expected the reduced bucket, of the bucket's dtype and size";
    });
    require(r.size() == 0 || r.data() != nullptr, [&] {
      return "DDP communication hook on rank " + std::to_string(rank) + ": bucket " + std::to_string(index) +
             ": the hook returned a view with no memory";
    });
    return r;
  }

 private:
  std::function<bucket_future(process_group const&, grad_bucket const&)> fn_;
  std::vector<bucket_future> futures_;
};

}  // namespace detail

DPARALLEL_NAMESPACE_END

#pragma once
// DDP's reducer: gradients copied into buckets as they become ready, each full bucket reduced
// across the process group while backward goes on, results written back when the step ends.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/buckets.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/replicate.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace policy {

/// Bucketed gradient reduction across the ranks of a process group (one local replica per rank).
///
/// - Buckets follow plan_buckets(): reverse parameter order, options::first_bucket_cap_mb for the
///   first and options::bucket_cap_mb for the others; after the first synchronised step they are
///   rebuilt once in the order the gradients became ready (rank 0's order, broadcast, so every
///   rank agrees).
/// - step_context::grad_ready(i) copies gradient i into its bucket; a bucket whose gradients are
///   all ready is reduced at once (buckets start strictly in order, so collectives match across
///   ranks). Buckets still pending when the step function returns are flushed then.
/// - The result is averaged over the world (ToRoot: reduced onto rank 0 only; the other ranks keep
///   their local gradients).
/// - Under no_sync, gradients are accumulated locally (weighted by each step's batch size); the
///   next synchronised step reduces the weighted mean of everything accumulated.
template <bool ToRoot>
class bucketed_reduce {
 public:
  /// The current bucket plan, in launch order.
  [[nodiscard]] std::vector<bucket_spec> const& buckets() const noexcept { return buckets_; }

  template <class Set>
  void on_construct(Set& s) {
    detail::require(s.group.valid(), "bucketed reduce: expected a process group (use the DDP constructor)");
    plan(s, reverse_order(s.params[0].size()));
  }

  template <class Set>
  void begin_step(Set& s) {
    std::size_t const n = s.params[0].size();
    detail::require(n == counts_.size(), "DDP: the model has " + std::to_string(n) +
                                             " parameters now, expected the " + std::to_string(counts_.size()) +
                                             " it had when the wrapper was built");
    ready_.assign(n, false);
    seen_order_.clear();
    used_hook_ = false;
    next_bucket_ = 0;
    for (std::size_t b = 0; b < buckets_.size(); ++b) pending_[b] = buckets_[b].params.size();
    works_.assign(buckets_.size(), work{});
    first_accumulation_ = accumulated_ == 0;
  }

  template <class Set>
  void grad_ready(Set& s, int, std::size_t i) {
    detail::require(i < ready_.size(), "grad_ready: expected a parameter index below " +
                                           std::to_string(ready_.size()) + ", found " + std::to_string(i));
    detail::require(!ready_[i], "grad_ready: parameter " + std::to_string(i) +
                                    " was marked ready twice in one step (rank " + std::to_string(s.group.rank()) +
                                    ")");
    used_hook_ = true;
    mark(s, i, false);
  }

  template <class Set>
  void finish(Set& s) {
    s.streams[0]->enqueue([this, &s] { finalize(s); });
  }

 private:
  template <class Set>
  void plan(Set& s, std::vector<std::size_t> const& order) {
    using backend = typename Set::backend_type;
    auto const& params = s.params[0];
    counts_.clear();
    std::vector<dtype> dtypes;
    for (auto const& p : params) {
      counts_.push_back(p.size());
      dtypes.push_back(p.dtype());
    }
    auto const mib = [](double m) { return static_cast<std::size_t>(std::llround(m * 1024.0 * 1024.0)); };
    detail::require(s.opts.bucket_cap_mb > 0 && s.opts.first_bucket_cap_mb > 0,
                    "DDP: expected bucket_cap_mb and first_bucket_cap_mb > 0, found " +
                        std::to_string(s.opts.bucket_cap_mb) + " and " + std::to_string(s.opts.first_bucket_cap_mb));
    buckets_ = plan_buckets(counts_, dtypes, order, mib(s.opts.first_bucket_cap_mb), mib(s.opts.bucket_cap_mb));
    bucket_of_.assign(params.size(), 0);
    slot_of_.assign(params.size(), 0);
    storage_.clear();
    accum_.clear();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      for (std::size_t k = 0; k < buckets_[b].params.size(); ++k) {
        bucket_of_[buckets_[b].params[k]] = b;
        slot_of_[buckets_[b].params[k]] = k;
      }
      storage_.push_back(backend::allocate(s.devices[0], buckets_[b].elements * size_of(buckets_[b].dtype)));
    }
    pending_.assign(buckets_.size(), 0);
    works_.assign(buckets_.size(), work{});
  }

  static tensor_ref view_in(std::shared_ptr<std::byte> const& m, bucket_spec const& b, std::size_t slot,
                            std::size_t count) {
    return tensor_ref(m.get() + b.offsets[slot] * size_of(b.dtype), count, b.dtype);
  }

  // Gradient i is final for this step: stage it in its bucket (or accumulate it under no_sync).
  template <class Set>
  void mark(Set& s, std::size_t i, bool unused) {
    using ops = typename Set::backend_type::immediate;
    ready_[i] = true;
    seen_order_.push_back(i);
    std::size_t const b = bucket_of_[i];
    auto const& spec = buckets_[b];
    tensor_ref const grad = s.grads[0][i];
    double const n = static_cast<double>(s.batch);
    if (!s.sync) {
      if (accum_.size() != storage_.size()) allocate_accum(s);
      tensor_ref const acc = view_in(accum_[b], spec, slot_of_[i], counts_[i]);
      if (first_accumulation_) ops::zero(acc);
      if (!unused) ops::add_scaled(acc, grad, n);
    } else {
      tensor_ref const dst = view_in(storage_[b], spec, slot_of_[i], counts_[i]);
      if (accumulated_ == 0) {
        if (unused) ops::zero(dst);
        else ops::copy(dst, grad);
      } else {  // the weighted mean of the accumulated steps and this one
        tensor_ref const acc = view_in(accum_[b], spec, slot_of_[i], counts_[i]);
        ops::copy(dst, acc);
        if (!unused) ops::add_scaled(dst, grad, n);
        ops::scale(dst, 1.0 / (static_cast<double>(accumulated_) + n));
      }
      if (--pending_[b] == 0) launch_ready(s);
    }
  }

  template <class Set>
  void allocate_accum(Set& s) {
    using backend = typename Set::backend_type;
    accum_.clear();
    for (auto const& b : buckets_) accum_.push_back(backend::allocate(s.devices[0], b.elements * size_of(b.dtype)));
  }

  template <class Set>
  void launch_ready(Set& s) {
    while (next_bucket_ < buckets_.size() && pending_[next_bucket_] == 0) {
      auto const& spec = buckets_[next_bucket_];
      tensor_ref const whole(storage_[next_bucket_].get(), spec.elements, spec.dtype);
      works_[next_bucket_] = ToRoot ? s.group.reduce(whole, 0, reduce_op::avg) : s.group.all_reduce(whole, reduce_op::avg);
      ++next_bucket_;
    }
  }

  // Runs on the replica's stream after the step function: flush, wait, write back, rebuild once.
  template <class Set>
  void finalize(Set& s) {
    using ops = typename Set::backend_type::immediate;
    std::size_t const n = ready_.size();
    if (used_hook_) {
      std::vector<std::size_t> unused;
      for (std::size_t i = 0; i < n; ++i)
        if (!ready_[i]) unused.push_back(i);
      if (!unused.empty() && !s.opts.find_unused_parameters) {
        std::string list;
        for (std::size_t k = 0; k < unused.size() && k < 16; ++k) list += (k ? ", " : "") + std::to_string(unused[k]);
        if (unused.size() > 16) list += ", ...";
        throw invalid_argument("dparallel: DDP on rank " + std::to_string(s.group.rank()) +
                               ": the step called grad_ready() but never for parameter(s) " + list +
                               "; expected every parameter to be marked ready (a parameter not used in this "
                               "step?): call grad_ready for it or set options::find_unused_parameters = true");
      }
      for (std::size_t i : unused) mark(s, i, true);
    } else {
      for (std::size_t k = n; k-- > 0;) mark(s, k, false);  // backward order
    }
    if (!s.sync) {
      accumulated_ += s.batch;
      first_accumulation_ = false;
      return;
    }
    accumulated_ = 0;
    for (auto const& w : works_) w.wait();
    if (!ToRoot || s.group.rank() == 0) {
      for (std::size_t i = 0; i < n; ++i) {
        auto const& spec = buckets_[bucket_of_[i]];
        ops::copy(s.grads[0][i], view_in(storage_[bucket_of_[i]], spec, slot_of_[i], counts_[i]));
      }
    }
    if (!rebuilt_) {
      rebuilt_ = true;
      // Rank 0's observed order decides for everyone (ranks may observe different orders).
      std::vector<std::int64_t> order(seen_order_.begin(), seen_order_.end());
      try {
        s.group.broadcast(view(order), 0).wait();
      } catch (...) {
        s.group.drain();  // `order` must outlive the collective
        throw;
      }
      std::vector<std::size_t> o(order.begin(), order.end());
      plan(s, o);
    }
  }

  std::vector<bucket_spec> buckets_;
  std::vector<std::size_t> counts_, bucket_of_, slot_of_, pending_, seen_order_;
  std::vector<bool> ready_;
  std::vector<std::shared_ptr<std::byte>> storage_, accum_;  // from Backend::allocate
  std::vector<work> works_;
  std::size_t next_bucket_ = 0;
  std::size_t accumulated_ = 0;  // samples accumulated under no_sync since the last synced step
  bool first_accumulation_ = true;
  bool used_hook_ = false;
  bool rebuilt_ = false;
};

using bucketed_all_reduce = bucketed_reduce<false>;
using bucketed_reduce_to_root = bucketed_reduce<true>;

}  // namespace policy
DPARALLEL_NAMESPACE_END

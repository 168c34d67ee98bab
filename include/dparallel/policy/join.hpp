#pragma once
// Uneven inputs for DDP (PyTorch's Join / DDP.join()) and sample-weighted averaging: the small
// collective that each synchronised step starts with, and what follows from it. See docs/join.md.
//
// With options::uneven_inputs or average_mode::samples, every synchronised step (and every
// shadow step of a rank inside join()) first all-gathers, from every rank, two integers: whether
// the rank is still stepping (1) or has joined (0), and the samples it saw since its last
// synchronised step (no_sync steps included; 0 for a joined rank with nothing accumulated). Each
// rank then knows, in the same exact integers as every other:
// - A, the ranks still stepping; when A = 0 and no rank has samples, every rank has joined and
//   join() returns (its shadow steps end);
// - C, the ranks with samples (they contribute), N, the samples of the step over all ranks;
// - its weight: before the group's average (sum over the ranks times 1/world), each rank's
//   gradient is multiplied by world/C (average_mode::ranks: the mean over the contributing
//   ranks) or by world * n_r / N (average_mode::samples: the one-device gradient over the N
//   samples); a rank without samples contributes zeros. Both factors are exactly 1 when every
//   rank contributes the same, so the default path keeps its bits;
// - the root of the buffer broadcast (the lowest rank still stepping) and the rank that stepped
//   last, whose parameters and buffers join() broadcasts when every rank has joined, so that the
//   replicas end identical (the joined ranks did not run their optimizer).
// Buffer averaging (options::average_buffers) uses the same weights over the ranks still
// stepping, after the step's gradients are reduced.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/replicate.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// Whether the options ask for the per-step control collective of policy/join.hpp.
inline bool join_control_enabled(options const& o) noexcept {
  return o.uneven_inputs || o.average == average_mode::samples;
}

/// Whether `t` is a dtype that buffer averaging averages (floating point).
inline bool averaged_buffer(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::f16 || t == dtype::bf16;
}

/// One DDP wrapper's side of policy/join.hpp: whether this rank has joined, the samples it
/// accumulated under no_sync, and the rank that stepped last.
class join_control {
 public:
  /// Whether this rank is inside join() (its steps are shadow steps).
  bool joined = false;

  /// Before a step's collectives: runs the control collective (synchronised steps, when enabled)
  /// and sets s.join. Returns false when every rank has joined and no rank has samples: the
  /// shadow steps are over (a stepping rank always gets true).
  template <class Set>
  bool begin(Set& s) {
    s.join = join_step{};
    s.join.active = s.world_size();
    if (!s.sync || !join_control_enabled(s.opts) || !s.group.valid()) return true;
    std::int64_t const mine_samples = static_cast<std::int64_t>(accumulated_ + s.batch);
    std::vector<std::int64_t> mine{joined ? 0 : 1, mine_samples};
    all_.resize(2 * static_cast<std::size_t>(s.world_size()));
    s.group.all_gather(view(all_), view(mine)).wait();
    int active = 0, contributing = 0, root = -1;
    std::int64_t total = 0;
    for (int r = 0; r < s.world_size(); ++r) {
      std::int64_t const a = all_[2 * static_cast<std::size_t>(r)], n = all_[2 * static_cast<std::size_t>(r) + 1];
      if (a != 0) {
        ++active;
        if (root < 0) root = r;
        last_ = r;
      }
      if (n > 0) ++contributing;
      total += n;
    }
    s.join.active = active;
    s.join.root = root < 0 ? 0 : root;
    if (active == 0 && contributing == 0) return false;
    double const world = static_cast<double>(s.world_size());
    if (mine_samples == 0) s.join.scale = 0.0;
    else if (s.opts.average == average_mode::samples)
      s.join.scale = world * static_cast<double>(mine_samples) / static_cast<double>(total);
    else s.join.scale = world / static_cast<double>(contributing);
    return true;
  }

  /// After a step was planned: counts the samples of a no_sync step, forgets them after a
  /// synchronised one; with options::average_buffers, enqueues the buffers' average on the
  /// rank's stream (after the gradients' reduction, which is enqueued before it).
  template <class Set>
  void end(Set& s) {
    if (!s.sync) {
      accumulated_ += s.batch;
      return;
    }
    accumulated_ = 0;
    if (s.opts.average_buffers && s.world_size() > 1 && !s.bufs[0].empty())
      s.streams[0]->enqueue([this, &s] { average_buffers(s); });
  }

  /// The rank that was stepping last (the highest one of the last step that had any): after
  /// join(), its parameters and buffers are every rank's.
  [[nodiscard]] int last_stepping() const noexcept { return last_; }

  /// Forgets the rank that stepped last (a new round of uneven steps starts).
  void restart() noexcept {
    joined = false;
    last_ = 0;
  }

 private:
  // Floating-point buffers: this rank's times its weight among the ranks still stepping
  // (world/A, or 0 when it has joined), averaged over the group; other dtypes: broadcast.
  template <class Set>
  void average_buffers(Set& s) const {
    using ops = typename Set::backend_type::immediate;
    int const active = s.join.active;
    if (active == 0) return;
    double const scale = joined ? 0.0 : static_cast<double>(s.world_size()) / static_cast<double>(active);
    std::vector<work> pending;
    std::vector<tensor_ref> others;
    for (auto const& b : s.bufs[0]) {
      if (!averaged_buffer(b.dtype())) {
        others.push_back(b);
        continue;
      }
      if (scale == 0.0) ops::zero(b);
      else if (scale != 1.0) ops::scale(b, scale);
      pending.push_back(s.group.all_reduce(b, reduce_op::avg));
    }
    try {
      for (auto const& w : pending) w.wait();
    } catch (...) {
      s.group.drain();
      throw;
    }
    if (!others.empty()) broadcast_from_root(s.group, others, s.join.root);
  }

  std::vector<std::int64_t> all_;
  std::size_t accumulated_ = 0;
  int last_ = 0;
};

/// parallel::join(): shadow steps (no samples, zero contributions, the same collectives as a
/// stepping rank's synchronised step) until every rank has joined, then every rank takes the
/// parameters and buffers of the rank that stepped last. `begin_streams()` opens each shadow step
/// as a step's first call (the backend's begin_step on every stream: parallel.hpp).
template <class Set, class Replicate, class Reduce, class BeginStreams>
void run_join(Set& s, Replicate& replicate, Reduce& reduce, join_control& control, BeginStreams&& begin_streams) {
  require(s.opts.uneven_inputs, "DDP join() on rank " + std::to_string(s.rank()) +
                                    ": expected options::uneven_inputs = true (on every rank: it adds the small "
                                    "collective by which the ranks learn who has joined), found it false");
  control.joined = true;
  bool const sync = s.sync;
  s.sync = true;  // a shadow step is a synchronised step, even inside no_sync()
  try {
    for (;;) {
      s.refresh_views();
      s.batch = 0;
      s.shard_sizes.assign(s.size(), 0);
      s.shard_offsets.assign(s.size(), 0);
      begin_streams();
      if (!control.begin(s)) break;
      try {
        replicate.before_step(s);
        reduce.begin_step(s);
        reduce.finish(s);
        control.end(s);
      } catch (...) {
        try {
          s.streams[0]->synchronize();  // the queued work refers to the wrapper's state
        } catch (...) {  // NOLINT(bugprone-empty-catch): the exception in flight is the one to report
        }
        throw;
      }
      s.streams[0]->synchronize();
    }
    std::vector<tensor_ref> all = s.params[0];
    all.insert(all.end(), s.bufs[0].begin(), s.bufs[0].end());
    broadcast_from_root(s.group, all, control.last_stepping());
  } catch (...) {
    s.sync = sync;
    control.restart();
    throw;
  }
  s.sync = sync;
  control.restart();
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

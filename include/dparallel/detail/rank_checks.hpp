#pragma once
// Checks DDP makes at construction beyond counts, sizes and dtypes (policy/replicate.hpp):
// - every rank declares the same parameter shapes (parameter_shapes(), when the model has it), as
//   PyTorch compares shapes: [4, 6] on one rank and [6, 4] on another hold as many elements but
//   would average transposed layouts;
// - no two live DDP wrappers of one process share parameter memory: thread ranks that wrap the
//   SAME model object (built before spawn) would each apply every update;
// - under desync detection, every step: the ranks' batch sizes and sampler epochs (step_agreement).

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/epoch_note.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/options.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/detail/typed_scratch.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <ranges>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// The model's parameter shapes: declared ones when it has parameter_shapes(), else each
/// parameter as a 1-D tensor of its size.
template <class M>
std::vector<std::vector<std::int64_t>> parameter_shapes_of(M& m) {
  std::vector<std::vector<std::int64_t>> out;
  auto add = [&](auto&& shapes) {
    for (auto&& s : shapes) {
      std::vector<std::int64_t> shape;
      for (auto d : s) shape.push_back(static_cast<std::int64_t>(d));
      out.push_back(std::move(shape));
    }
  };
  if constexpr (member_parameter_shapes<M>) add(m.parameter_shapes());
  else if constexpr (traits_parameter_shapes<M>) add(model_traits<M>::parameter_shapes(m));
  else
    for (auto const& t : parameter_refs(m)) out.push_back({static_cast<std::int64_t>(t.size())});
  return out;
}

inline std::string shape_text(std::int64_t const* dims, std::size_t n) {
  std::string s = "[";
  for (std::size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

/// Verifies that every rank declares rank 0's parameter shapes; a collective. The same error is
/// raised on every rank, naming the first rank and parameter that differ (`label(i)`: how the
/// error names parameter i, as parameter_label does).
template <class Label>
void verify_shapes_across_ranks(process_group const& g, std::vector<std::vector<std::int64_t>> const& shapes,
                                Label const& label) {
  // Encoding: per parameter its rank (number of dimensions), then its dimensions.
  std::vector<std::int64_t> mine;
  for (auto const& s : shapes) {
    mine.push_back(static_cast<std::int64_t>(s.size()));
    mine.insert(mine.end(), s.begin(), s.end());
  }
  auto const world = static_cast<std::size_t>(g.size());
  std::vector<std::int64_t> len{static_cast<std::int64_t>(mine.size())}, lens(world);
  g.all_gather(view(lens), view(len)).wait();
  std::size_t longest = 0;
  for (auto l : lens) longest = std::max(longest, static_cast<std::size_t>(l));
  if (longest == 0) return;
  mine.resize(longest, -1);
  std::vector<std::int64_t> all(longest * world);
  g.all_gather(view(all), view(mine)).wait();
  std::int64_t const* base = all.data();
  for (std::size_t r = 1; r < world; ++r) {
    std::int64_t const* other = all.data() + r * longest;
    std::size_t at = 0;
    for (std::size_t p = 0; at < static_cast<std::size_t>(lens[0]); ++p) {
      auto const n = static_cast<std::size_t>(base[at]);
      bool const same = at < static_cast<std::size_t>(lens[r]) && other[at] == base[at] &&
                        std::equal(base + at + 1, base + at + 1 + n, other + at + 1);
      require(same, [&] {
        std::string theirs = "no shape";
        if (at < static_cast<std::size_t>(lens[r]) && other[at] >= 0 &&
            at + 1 + static_cast<std::size_t>(other[at]) <= longest)
          theirs = "shape " + shape_text(other + at + 1, static_cast<std::size_t>(other[at]));
        return "DDP: rank " + std::to_string(r) + " declares " + theirs + " for parameter " + label(p) +
               ", expected rank 0's " + shape_text(base + at + 1, n) +
               " (parameter_shapes()); equal sizes with other shapes would average different layouts: every rank "
               "must build the same model";
      });
      at += 1 + n;
    }
  }
}

/// The parameter memory of the live DDP wrappers of this process, so that a second wrapper of the
/// same model object (two thread ranks sharing one model) is caught at construction.
class parameter_registry {
 public:
  struct entry {
    std::vector<tensor_ref> params;
    int rank;
  };
  /// Keeps the entry registered while the returned handle lives.
  using handle = std::shared_ptr<void>;

  static parameter_registry& instance() {
    static parameter_registry r;
    return r;
  }

  /// Registers `params` for `rank`; throws invalid_argument when one overlaps a parameter of a
  /// live wrapper (naming both ranks, and the parameter as `label(i)` does).
  template <class Label>
  handle add(std::vector<tensor_ref> params, int rank, Label const& label) {
    std::lock_guard lock(m_);
    for (auto const& e : entries_) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        for (auto const& q : e.params) {
          require(!overlaps(params[i], q), [&] {
            return "DDP on rank " + std::to_string(rank) + ": parameter " + label(i) +
                   " shares memory with a parameter of the model that rank " + std::to_string(e.rank) +
                   " wrapped in this process; every rank needs a model of its own: build it inside the function "
                   "spawn() runs (thread ranks wrapping one model object would each apply every update)";
          });
        }
      }
    }
    auto it = entries_.insert(entries_.end(), entry{std::move(params), rank});
    return handle(nullptr, [this, it](void*) {
      std::lock_guard held(m_);
      entries_.erase(it);
    });
  }

 private:
  std::mutex m_;
  std::list<entry> entries_;
};

/// DDP under desync detection (process_group::detects_desync): each step, before its other
/// collectives, the ranks all-gather their batch size and their sampler's epoch (the thread's last
/// distributed_sampler epoch, core/epoch_note.hpp). Different epochs are an error on every rank (a
/// rank that forgot set_epoch reads the previous epoch's order again: samples read twice, others
/// never); different batch sizes, averaged with equal weights as PyTorch does but almost always a
/// mistake, are one warning through options::warning_sink (not with average_mode::samples, which
/// weighs them). Off without desync detection, and with options::uneven_inputs (joined ranks run
/// other collectives).
class step_agreement {
 public:
  /// At construction: whether to check.
  template <class Set>
  void enable(Set const& s) {
    on_ = s.group.detects_desync() && s.world_size() > 1 && !s.opts.uneven_inputs;
  }
  /// Before a step's collectives, on every rank: exchanges and compares.
  template <class Set>
  void check(Set& s) {
    if (!on_) return;
    auto const world = static_cast<std::size_t>(s.world_size());
    mine_.assign({static_cast<std::int64_t>(s.batch), static_cast<std::int64_t>(sampler_epoch_note())});
    all_.resize(2 * world);
    s.group.all_gather(view(all_), view(mine_)).wait();
    bool epochs_differ = false, batches_differ = false;
    std::int64_t known = 0;
    for (std::size_t r = 0; r < world; ++r) {
      batches_differ = batches_differ || all_[2 * r] != all_[0];
      std::int64_t const e = all_[2 * r + 1];
      if (e == 0) continue;  // no sampler on that rank's thread
      epochs_differ = epochs_differ || (known != 0 && e != known);
      known = e;
    }
    if (epochs_differ)
      throw invalid_argument("dparallel: DDP on rank " + std::to_string(s.rank()) +
                             ": the ranks' samplers are on different epochs (" + listing(world, 1, true) +
                             "); a rank that does not call distributed_sampler::set_epoch(epoch) reads the previous "
                             "epoch's order again, so some samples are read twice and others never: call it on every "
                             "rank, with the same epoch, before each epoch");
    if (batches_differ && !warned_ && s.opts.average == average_mode::ranks && s.opts.warning_sink) {
      warned_ = true;
      s.opts.warning_sink("DDP on rank " + std::to_string(s.rank()) + ": the ranks feed different batch sizes (" +
                          listing(world, 0, false) +
                          "); their gradients are averaged with equal weights, as PyTorch does, so a sample of a "
                          "smaller batch weighs more: give every rank the same batch size, or set "
                          "options::average = average_mode::samples (said once)");
    }
  }

 private:
  std::string listing(std::size_t world, std::size_t field, bool epoch) const {
    std::string out;
    for (std::size_t r = 0; r < world; ++r) {
      std::int64_t const v = all_[2 * r + field];
      out += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + ": ";
      if (!epoch) out += std::to_string(v) + " samples";
      else out += v == 0 ? std::string("no sampler") : "epoch " + std::to_string(v - 1);
    }
    return out;
  }

  bool on_ = false;
  bool warned_ = false;
  std::vector<std::int64_t> mine_, all_;
};

/// Runs DDP's construction collectives (`collectives`): a failure among them (a rank that never
/// built its wrapper, or built it at another point of the program) is raised again, of the same
/// type and naming the same rank, as the constructor's failure rather than as the collective's.
template <class F>
void as_ddp_constructor(int rank, F&& collectives) {
  auto const context = [rank](char const* what) {
    return "dparallel: DDP's constructor (distributed_data_parallel(model, group)) on rank " + std::to_string(rank) +
           " failed in the collectives that compare the ranks' models and broadcast rank 0's: every rank must "
           "construct its DDP wrapper, at the same point of the program; " +
           without_prefix(what);
  };
  try {
    collectives();
  } catch (timeout_error const& e) {
    throw timeout_error(e.rank(), context(e.what()));
  } catch (comm_error const& e) {
    throw comm_error(e.rank(), context(e.what()));
  }
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

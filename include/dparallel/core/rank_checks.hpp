#pragma once
// Checks DDP makes at construction beyond counts, sizes and dtypes (policy/replicate.hpp):
// - every rank declares the same parameter shapes (parameter_shapes(), when the model has it), as
//   PyTorch compares shapes: [4, 6] on one rank and [6, 4] on another hold as many elements but
//   would average transposed layouts;
// - no two live DDP wrappers of one process share parameter memory: thread ranks that wrap the
//   SAME model object (built before spawn) would each apply every update.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
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
/// raised on every rank, naming the first rank and parameter that differ.
inline void verify_shapes_across_ranks(process_group const& g, std::vector<std::vector<std::int64_t>> const& shapes) {
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
        return "DDP: rank " + std::to_string(r) + " declares " + theirs + " for parameter " + std::to_string(p) +
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
  /// live wrapper (naming both ranks).
  handle add(std::vector<tensor_ref> params, int rank) {
    std::lock_guard lock(m_);
    for (auto const& e : entries_) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        for (auto const& q : e.params) {
          require(!overlaps(params[i], q), [&] {
            return "DDP on rank " + std::to_string(rank) + ": parameter " + std::to_string(i) +
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

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// The uneven-inputs training of the Join tests (test_join, tests/mpi/test_mpi): rank r runs
// steps[r] steps on batches of batch[r] samples, then join(); and its one-device reference.
#include "models.hpp"

#include <dparallel/dparallel.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace test::join {

using model = test::chunked<float>;

/// Who runs how much: rank r takes steps[r] steps of batch[r] samples.
struct uneven_plan {
  std::vector<int> steps;
  std::vector<std::size_t> batch;
  /// Samples of one step over every rank (the rows each step's data set holds).
  [[nodiscard]] std::size_t rows() const {
    std::size_t n = 0;
    for (auto b : batch) n += b;
    return n;
  }
  /// Where rank r's rows start in a step's data set.
  [[nodiscard]] std::size_t offset(int r) const {
    std::size_t n = 0;
    for (int q = 0; q < r; ++q) n += batch[static_cast<std::size_t>(q)];
    return n;
  }
  /// The number of steps of the rank that runs longest.
  [[nodiscard]] int longest() const {
    int n = 0;
    for (int s : steps) n = s > n ? s : n;
    return n;
  }
};

/// Step k's data set (every rank's rows, in rank order).
inline test::dataset<float> step_data(uneven_plan const& p, int k) {
  return test::dataset<float>::make(p.rows(), model().dim, static_cast<std::uint64_t>(300 + k), false);
}

/// What a run leaves: the gradients after each step this rank took, then the parameters and
/// buffers once join() returned.
struct uneven_result {
  std::vector<std::vector<double>> grads;
  std::vector<double> params;
  std::vector<float> stats;
};

constexpr float lr = 0.05f;

/// This rank's part of the uneven training on `g`, then join() (with options::uneven_inputs).
inline uneven_result train_uneven(dparallel::process_group const& g, uneven_plan const& p, dparallel::options opts,
                                  bool overlap) {
  model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(7 + g.rank()));  // rank 0's wins at construction
  bool const join = opts.uneven_inputs;
  dparallel::distributed_data_parallel<model> ddp(m, g, std::move(opts));
  uneven_result out;
  auto const r = static_cast<std::size_t>(g.rank());
  for (int k = 0; k < p.steps[r]; ++k) {
    auto const d = step_data(p, k);
    auto const mine = dparallel::slice_batch(d.all(), p.offset(g.rank()), p.offset(g.rank()) + p.batch[r]);
    ddp.step(mine, [&](model& x, test::samples<float> s, dparallel::step_context& ctx) {
      x.forward_backward(s, overlap ? &ctx : nullptr);
    });
    out.grads.push_back(test::flat(m, true));
    m.sgd(lr);
  }
  if (join) ddp.join();  // without uneven_inputs, the ranks must take the same steps
  out.params = test::flat(m, false);
  out.stats = m.stats;
  return out;
}

/// One device: at each step, the union of the samples of the ranks still stepping.
inline uneven_result train_union(uneven_plan const& p) {
  model m({3, 5, 1, 8, 2, 4}, 7);
  uneven_result out;
  for (int k = 0; k < p.longest(); ++k) {
    auto const d = step_data(p, k);
    std::vector<float> x, y;
    for (int r = 0; r < static_cast<int>(p.steps.size()); ++r) {
      if (p.steps[static_cast<std::size_t>(r)] <= k) continue;
      std::size_t const o = p.offset(r), n = p.batch[static_cast<std::size_t>(r)];
      x.insert(x.end(), d.x.begin() + static_cast<std::ptrdiff_t>(o * d.dim),
               d.x.begin() + static_cast<std::ptrdiff_t>((o + n) * d.dim));
      y.insert(y.end(), d.y.begin() + static_cast<std::ptrdiff_t>(o), d.y.begin() + static_cast<std::ptrdiff_t>(o + n));
    }
    test::samples<float> const s{dparallel::tensor_view<const float>(x.data(), x.size(), y.size()), dparallel::view(y)};
    m.forward_backward(s);
    out.grads.push_back(test::flat(m, true));
    m.sgd(lr);
  }
  out.params = test::flat(m, false);
  return out;
}

}  // namespace test::join

#pragma once
// The model and data of the communication-hook tests (test_comm_hooks, test_powersgd).
#include "models.hpp"

#include <dparallel/dparallel.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace test::hooks {


/// A model whose parameters and gradients are each one flat buffer in parameter order (what
/// gradient_as_bucket_view wants); the gradient of element j is mean_i (w_j * y_i - x_ij) * 37,
/// computed last parameter first, each marked ready when done.
struct pull_model {
  std::vector<std::size_t> sizes{40, 300, 7, 1000, 20};
  std::size_t dim = 1367;
  std::vector<float> w, g;
  explicit pull_model(std::uint64_t seed = 5) : w(dim), g(dim) {
    test::rng r{seed};
    for (auto& x : w) x = static_cast<float>(r.uniform() * 4 - 2);
  }
  [[nodiscard]] std::vector<dparallel::tensor_view<float>> views(std::vector<float>& v) const {
    std::vector<dparallel::tensor_view<float>> out;
    std::size_t o = 0;
    for (std::size_t n : sizes) {
      out.emplace_back(v.data() + o, n);
      o += n;
    }
    return out;
  }
  std::vector<dparallel::tensor_view<float>> parameters() { return views(w); }
  std::vector<dparallel::tensor_view<float>> gradients() { return views(g); }

  void forward_backward(test::samples<float> const& s, dparallel::step_context* ctx = nullptr) {
    std::size_t const n = s.x.rows();
    std::size_t end = dim;
    for (std::size_t p = sizes.size(); p-- > 0;) {
      for (std::size_t j = end - sizes[p]; j < end; ++j) {
        float acc = 0;
        for (std::size_t i = 0; i < n; ++i) acc += w[j] * s.y[i] - s.x[i * dim + j];
        g[j] = acc / static_cast<float>(n) * 37.0f;
      }
      end -= sizes[p];
      if (ctx != nullptr) ctx->grad_ready(p);
    }
  }
  void sgd(float lr) {
    for (std::size_t j = 0; j < dim; ++j) w[j] -= lr * g[j];
  }
};

inline dparallel::options small_buckets() {
  return {.bucket_cap_mb = 800.0 / (1024 * 1024), .first_bucket_cap_mb = 40.0 / (1024 * 1024)};
}

constexpr std::size_t per_rank = 4;  // samples per rank and step
constexpr int steps = 6;             // step 3 runs under no_sync; steps 0, 1, 2, 4, 5 synchronise

inline test::dataset<float> batch_of(int step, int world) {
  return test::dataset<float>::make(per_rank * static_cast<std::size_t>(world), pull_model().dim,
                                    static_cast<std::uint64_t>(70 + step), false);
}
inline test::samples<float> rank_part(test::dataset<float> const& d, int rank) {
  auto const r = static_cast<std::size_t>(rank);
  return dparallel::slice_batch(d.all(), r * per_rank, (r + 1) * per_rank);
}

}  // namespace test::hooks

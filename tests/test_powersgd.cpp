// The powersgd communication hook (policy/powersgd.hpp) on thread ranks, against a dense
// reference written here: the same algorithm over whole matrices (each rank's bucket as a padded
// square matrix, error feedback, warm start, P = M Q summed over the ranks, Gram-Schmidt,
// Q = M^T P averaged, M' = P Q^T), computed on the test thread in double from the same random Q.
// Also: the first start_iter steps are the plain average, bitwise; runs repeat bit for bit; a rank
// of 0 or beyond the matrix fails every rank with an error naming the bound.
#include "hook_models.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/policy/powersgd.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

namespace dpl = dparallel;
using namespace test::hooks;

namespace {

/// What the ranks saw: gradients after each synchronised step, and rank 0's final bucket plan.
struct run {
  std::vector<std::vector<std::vector<float>>> grads;  // [rank][step]
  std::vector<dpl::bucket_spec> plan;
};

run train(int world, dpl::powersgd_state state, bool hooked = true) {
  run out;
  out.grads.resize(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    pull_model m;
    dpl::distributed_data_parallel<pull_model> ddp(m, rank.group(), small_buckets());
    if (hooked) ddp.reducer().register_comm_hook(state, dpl::powersgd);
    for (int step = 0; step < 5; ++step) {
      ddp.step(rank_part(batch_of(step, world), rank.rank()),
               [](pull_model& r, test::samples<float> s, dpl::step_context& ctx) { r.forward_backward(s, &ctx); });
      out.grads[static_cast<std::size_t>(rank.rank())].push_back(m.g);
      m.sgd(0.01f);
    }
    if (rank.rank() == 0) out.plan = ddp.reducer().buckets();
  });
  return out;
}

using matrix = std::vector<double>;  // row-major

void gram_schmidt(matrix& a, std::size_t rows, std::size_t cols) {
  for (std::size_t j = 0; j < cols; ++j) {
    double norm = 0;
    for (std::size_t i = 0; i < rows; ++i) norm += a[i * cols + j] * a[i * cols + j];
    norm = std::sqrt(norm);
    for (std::size_t i = 0; i < rows && norm > 0; ++i) a[i * cols + j] /= norm;
    for (std::size_t k = j + 1; k < cols; ++k) {
      double dot = 0;
      for (std::size_t i = 0; i < rows; ++i) dot += a[i * cols + j] * a[i * cols + k];
      for (std::size_t i = 0; i < rows; ++i) a[i * cols + k] -= dot * a[i * cols + j];
    }
  }
}

/// The dense reference of train(): every step's averaged gradient, the buckets laid out as `plan`
/// (the plan the reducer uses from step 1 on; step 0, before start_iter, is uncompressed anyway).
std::vector<std::vector<float>> reference(int world, dpl::powersgd_state const& st, std::vector<dpl::bucket_spec> const& plan) {
  auto const uw = static_cast<std::size_t>(world);
  pull_model m;
  std::vector<std::size_t> starts;  // each parameter's offset in the flat gradient
  std::size_t o = 0;
  for (std::size_t s : m.sizes) {
    starts.push_back(o);
    o += s;
  }
  std::vector<std::vector<matrix>> error(plan.size(), std::vector<matrix>(uw));
  std::vector<matrix> q_prev(plan.size());
  std::vector<std::vector<float>> out;
  std::size_t const r = st.rank;
  for (int step = 0; step < 5; ++step) {
    std::vector<std::vector<float>> local(uw);
    for (std::size_t k = 0; k < uw; ++k) {
      pull_model one = m;
      one.forward_backward(rank_part(batch_of(step, world), static_cast<int>(k)));
      local[k] = one.g;
    }
    std::vector<float> avg(m.dim, 0.0f);
    if (static_cast<std::size_t>(step) < st.start_iter) {
      for (std::size_t j = 0; j < m.dim; ++j) {
        float sum = local[0][j];
        for (std::size_t k = 1; k < uw; ++k) sum += local[k][j];
        avg[j] = sum * (1.0f / static_cast<float>(world));
      }
    } else {
      for (std::size_t b = 0; b < plan.size(); ++b) {
        std::size_t const n = plan[b].elements;
        std::size_t side = 0;
        while (side * side < n) ++side;
        std::vector<matrix> mk(uw, matrix(side * side, 0.0));
        for (std::size_t k = 0; k < uw; ++k) {
          for (std::size_t s = 0; s < plan[b].params.size(); ++s) {
            std::size_t const p = plan[b].params[s];
            for (std::size_t e = 0; e < m.sizes[p]; ++e) mk[k][plan[b].offsets[s] + e] = local[k][starts[p] + e];
          }
          if (st.error_feedback && !error[b][k].empty())
            for (std::size_t i = 0; i < side * side; ++i) mk[k][i] += error[b][k][i];
        }
        matrix q = q_prev[b];
        if (!st.warm_start || q.empty()) {
          q.assign(side * r, 0.0);
          for (std::size_t i = 0; i < side * r; ++i)
            q[i] = dpl::detail::powersgd_random(st.seed, b, static_cast<std::uint64_t>(step), i);
          gram_schmidt(q, side, r);
        }
        matrix p(side * r, 0.0);
        for (std::size_t k = 0; k < uw; ++k)
          for (std::size_t i = 0; i < side; ++i)
            for (std::size_t j = 0; j < r; ++j)
              for (std::size_t l = 0; l < side; ++l) p[i * r + j] += mk[k][i * side + l] * q[l * r + j];
        gram_schmidt(p, side, r);
        matrix qn(side * r, 0.0);
        for (std::size_t k = 0; k < uw; ++k)
          for (std::size_t l = 0; l < side; ++l)
            for (std::size_t j = 0; j < r; ++j)
              for (std::size_t i = 0; i < side; ++i) qn[l * r + j] += mk[k][i * side + l] * p[i * r + j] / static_cast<double>(world);
        q_prev[b] = qn;
        matrix approx(side * side, 0.0);
        for (std::size_t i = 0; i < side; ++i)
          for (std::size_t l = 0; l < side; ++l)
            for (std::size_t j = 0; j < r; ++j) approx[i * side + l] += p[i * r + j] * qn[l * r + j];
        for (std::size_t k = 0; k < uw && st.error_feedback; ++k) {
          error[b][k].assign(side * side, 0.0);
          for (std::size_t i = 0; i < side * side; ++i) error[b][k][i] = mk[k][i] - approx[i];
        }
        for (std::size_t s = 0; s < plan[b].params.size(); ++s) {
          std::size_t const prm = plan[b].params[s];
          for (std::size_t e = 0; e < m.sizes[prm]; ++e)
            avg[starts[prm] + e] = static_cast<float>(approx[plan[b].offsets[s] + e]);
        }
      }
    }
    out.push_back(avg);
    m.g = avg;
    m.sgd(0.01f);
  }
  return out;
}

double rel_diff(std::vector<float> const& a, std::vector<float> const& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace

TEST_CASE("powersgd equals a dense reference of the algorithm; the first start_iter steps are the plain average",
          "[host][ddp][hooks][powersgd]") {
  for (int world : {2, 3}) {
    for (std::size_t rank : {std::size_t{1}, std::size_t{2}}) {
      for (bool feedback : {false, true}) {
        for (bool warm : {false, true}) {
          dpl::powersgd_state st{.rank = rank, .start_iter = 2, .error_feedback = feedback, .warm_start = warm, .seed = 9};
          auto const got = train(world, st);
          auto const plain = train(world, st, false);
          auto const want = reference(world, st, got.plan);
          INFO("world " << world << ", rank " << rank << ", error feedback " << feedback << ", warm start " << warm);
          for (std::size_t k = 0; k < got.grads.size(); ++k) {
            for (std::size_t t = 0; t < want.size(); ++t) {
              INFO("rank " << k << ", step " << t);
              CHECK(got.grads[k][t] == got.grads[0][t]);  // every rank the same bits
              if (t < 2) CHECK(std::memcmp(got.grads[k][t].data(), plain.grads[k][t].data(), 4 * plain.grads[k][t].size()) == 0);
              CHECK(rel_diff(got.grads[k][t], want[t]) <= 1e-4);
            }
          }
          // Compression is real: a rank-r approximation differs from the plain average.
          CHECK(rel_diff(got.grads[0][2], plain.grads[0][2]) > 1e-3);
          auto const again = train(world, st);
          CHECK(again.grads == got.grads);  // deterministic given the seed
        }
      }
    }
  }
}

TEST_CASE("powersgd with rank 0 or a rank beyond the matrix fails every rank, saying the bound",
          "[host][ddp][hooks][powersgd][error]") {
  CHECK_THROWS_WITH(train(2, dpl::powersgd_state{.rank = 0, .start_iter = 1}),
                    Catch::Contains("powersgd: expected a rank between 1 and") && Catch::Contains("found 0"));
  // The first bucket of small_buckets() holds parameter 4 (20 elements): a 5 x 5 matrix.
  CHECK_THROWS_WITH(train(2, dpl::powersgd_state{.rank = 6, .start_iter = 1}),
                    Catch::Contains("powersgd: expected a rank between 1 and 5 (bucket 0: 20 elements, a 5 x 5 matrix), found 6"));
}

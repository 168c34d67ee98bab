// 16-bit reductions (F16, BF16) on the host: every result element equals the F32 computation of
// the widened inputs in the documented order, rounded once to nearest even, bit for bit.
//  - the host communicator on 2, 3 and 4 thread ranks: all_reduce (sum, avg; the one-meeting
//    path for short messages and the sliced path for long ones), reduce, reduce_scatter, with
//    infinities, NaNs, subnormals and sums beyond the 16-bit range among the inputs;
//  - the host backend's DataParallel kernels: weighted_sum (CUDA's pairwise order and float
//    weights: the reference is host::weighted_sum over F32 copies), scale, add_scaled.
// The ranks only record what they computed; every assertion runs on the test thread.
#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

namespace {

/// `n` 16-bit values for rank `rank`: ordinary values of a wide range, with an infinity on rank 0
/// and its opposite on rank 1 at some elements (their sum is NaN), NaNs, subnormals, and values
/// near the top of the range (f16: sums overflow to infinity).
template <class H>
std::vector<H> inputs(int rank, std::size_t n, unsigned seed) {
  std::mt19937 g(seed * 131 + static_cast<unsigned>(rank));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  float const big = std::is_same_v<H, dp::f16> ? 60000.0f : 3e38f;
  std::vector<H> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    float x = u(g) * (i % 3 == 0 ? 1000.0f : 1.0f);
    if (i % 17 == 2) x = u(g) > 0 ? big : -big;
    if (i % 29 == 4) x = u(g) * 1e-6f;  // f16 subnormals
    if (i % 31 == 6 && rank == 0) x = std::numeric_limits<float>::infinity();
    if (i % 31 == 6 && rank == 1) x = -std::numeric_limits<float>::infinity();
    if (i % 37 == 8 && rank == 1) x = std::numeric_limits<float>::quiet_NaN();
    v[i] = H(x);
  }
  return v;
}

/// The reference: element i of the reduction of `per_rank` (rank order, float), times 1.0f / n
/// for avg, rounded once.
template <class H>
std::vector<H> reference(std::vector<std::vector<H>> const& per_rank, std::size_t first, std::size_t count, bool avg) {
  std::vector<H> out(count);
  float const scale = 1.0f / static_cast<float>(per_rank.size());
  for (std::size_t i = 0; i < count; ++i) {
    float acc = static_cast<float>(per_rank[0][first + i]);
    for (std::size_t k = 1; k < per_rank.size(); ++k) acc += static_cast<float>(per_rank[k][first + i]);
    out[i] = H(avg ? acc * scale : acc);
  }
  return out;
}

/// Index of the first element whose bits differ (or -1).
template <class H>
long first_difference(std::vector<H> const& a, std::vector<H> const& b) {
  if (a.size() != b.size()) return -2;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].bits != b[i].bits) return static_cast<long>(i);
  return -1;
}

template <class H>
void check_communicator(int world) {
  auto const uw = static_cast<std::size_t>(world);
  // 40000 x 2 bytes = 80 KB per rank: beyond the one-meeting path's 64 KiB, so the ranks slice it.
  for (std::size_t len : {std::size_t{1}, std::size_t{17}, std::size_t{300}, std::size_t{5000}, std::size_t{40000}}) {
    for (bool avg : {false, true}) {
      auto const op = avg ? dp::reduce_op::avg : dp::reduce_op::sum;
      std::vector<std::vector<H>> in(uw), all_reduced(uw), reduced(uw), scattered(uw);
      for (int r = 0; r < world; ++r) in[static_cast<std::size_t>(r)] = inputs<H>(r, len * uw, static_cast<unsigned>(len));
      std::size_t const block = len;  // reduce_scatter: each rank gets `len` of len * world
      dp::spawn(world, [&](dp::rank_context& ctx) {
        auto const r = static_cast<std::size_t>(ctx.rank());
        auto& a = all_reduced[r];
        a = in[r];
        ctx.group().all_reduce(dp::view(a), op).wait();
        auto& b = reduced[r];
        b = in[r];
        ctx.group().reduce(dp::view(b), world - 1, op).wait();
        auto& c = scattered[r];
        c.assign(block, H{});
        ctx.group().reduce_scatter(dp::view(c), dp::view(in[r]), op).wait();
      });
      auto const whole = reference(in, 0, len * uw, avg);
      INFO(world << " ranks, " << len * uw << " elements, avg " << avg);
      for (std::size_t r = 0; r < uw; ++r) {
        INFO("rank " << r);
        CHECK(first_difference(all_reduced[r], whole) == -1);
        CHECK(first_difference(reduced[r], r + 1 == uw ? whole : in[r]) == -1);
        CHECK(first_difference(scattered[r], reference(in, r * block, block, avg)) == -1);
      }
    }
  }
}

/// F32 copies of 16-bit values (exact).
template <class H>
std::vector<float> widened(std::vector<H> const& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}
template <class H>
std::vector<H> rounded(std::vector<float> const& v) {
  std::vector<H> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = H(v[i]);
  return out;
}

template <class H>
void check_backend_kernels() {
  for (std::size_t len : {std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{300}, std::size_t{1000}}) {
    for (std::size_t m = 1; m <= 9; ++m) {
      INFO(m << " sources of " << len);
      std::vector<std::vector<H>> src(m);
      std::vector<std::vector<float>> src32(m);
      std::vector<dp::tensor_ref> refs, refs32;
      std::vector<double> w;
      for (std::size_t k = 0; k < m; ++k) {
        src[k] = inputs<H>(static_cast<int>(k), len, static_cast<unsigned>(m + len));
        src32[k] = widened(src[k]);
        w.push_back(0.1 + 0.37 * static_cast<double>(k));  // not exact in float: rounded like CUDA's
      }
      for (std::size_t k = 0; k < m; ++k) {
        refs.push_back(dp::view(src[k]));
        refs32.push_back(dp::view(src32[k]));
      }
      std::vector<H> got(len);
      std::vector<float> want32(len);
      dp::host::weighted_sum(dp::view(got), refs, w);
      dp::host::weighted_sum(dp::view(want32), refs32, w);
      CHECK(first_difference(got, rounded<H>(want32)) == -1);
      // In place: the destination is the first source.
      auto in_place = src[0];
      refs[0] = dp::view(in_place);
      dp::host::weighted_sum(dp::view(in_place), refs, w);
      CHECK(first_difference(in_place, got) == -1);
    }
    auto x = inputs<H>(0, len, 5);
    auto y = inputs<H>(1, len, 6);
    auto x32 = widened(x), y32 = widened(y);
    dp::host::scale(dp::view(x), 0.3);
    dp::host::scale(dp::view(x32), 0.3);
    CHECK(first_difference(x, rounded<H>(x32)) == -1);
    x32 = widened(x);
    dp::host::add_scaled(dp::view(x), dp::view(y), -1.7);
    dp::host::add_scaled(dp::view(x32), dp::view(y32), -1.7);
    CHECK(first_difference(x, rounded<H>(x32)) == -1);
  }
}

}  // namespace

TEST_CASE("host communicator: F16 sums and averages are the F32 rank-order result rounded once",
          "[half][host][comm]") {
  for (int world : {2, 3, 4}) check_communicator<dp::f16>(world);
}

TEST_CASE("host communicator: BF16 sums and averages are the F32 rank-order result rounded once",
          "[half][host][comm]") {
  for (int world : {2, 3, 4}) check_communicator<dp::bf16>(world);
}

TEST_CASE("host backend kernels: 16-bit weighted_sum, scale and add_scaled are the F32 result rounded once",
          "[half][host]") {
  check_backend_kernels<dp::f16>();
  check_backend_kernels<dp::bf16>();
}

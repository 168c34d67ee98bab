// clip_grad_norm: PyTorch's semantics against a plain reference, on one device, DP and DDP, and
// the sharded form (ZeRO-1: each rank holds a piece) against the unsharded computation.
#include "models.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/optim/clip.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;
using model = test::chunked<float>;

namespace {

double const inf = std::numeric_limits<double>::infinity();

/// torch.nn.utils.clip_grad_norm_ written plainly over one flat vector: the norm (f64
/// accumulation, in order), then x * f32(max_norm / (norm + 1e-6)) when that is below 1.
double reference_clip(std::vector<float>& g, double max_norm, double norm_type) {
  double norm = 0;
  for (float x : g) norm = norm_type == 2 ? norm + double(x) * double(x) : std::max(norm, std::fabs(double(x)));
  if (norm_type == 2) norm = std::sqrt(norm);
  double const coef = max_norm / (norm + 1e-6);
  if (coef < 1)
    for (float& x : g) x = x * static_cast<float>(coef);
  return norm;
}

std::vector<float> flat_grads(model& m) {
  std::vector<float> out;
  for (auto& g : m.g) out.insert(out.end(), g.begin(), g.end());
  return out;
}

model with_gradients(std::uint64_t seed, float scale = 1.0f) {
  model m({3, 5, 1, 8, 2, 4}, seed);
  m.forward_backward(test::dataset<float>::make(9, m.dim, seed, false).all());
  for (auto& g : m.g)
    for (float& x : g) x *= scale;
  return m;
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("clip_grad_norm follows PyTorch: total norm, coefficient, only when above max_norm", "[optim][clip]") {
  for (double type : {2.0, inf}) {
    for (double max_norm : {0.0, 0.01, 0.5, 1e6}) {
      INFO("norm_type " << type << ", max_norm " << max_norm);
      model m = with_gradients(3, 4.0f);
      auto want = flat_grads(m);
      double const want_norm = reference_clip(want, max_norm, type);
      double const norm = optim::clip_grad_norm(m, max_norm, {.norm_type = type});
      CHECK(norm == want_norm);
      CHECK(same_bits(flat_grads(m), want));
      CHECK(norm > 0);
    }
  }
  // Below max_norm nothing changes; an empty list has norm 0.
  model m = with_gradients(4);
  auto const before = flat_grads(m);
  CHECK(optim::clip_grad_norm(m, 1e9) > 0);
  CHECK(same_bits(flat_grads(m), before));
  CHECK(optim::clip_grad_norm(std::span<dpl::tensor_ref const>(), 1.0) == 0.0);
}

TEST_CASE("clip_grad_norm on DP's master and DDP's ranks equals one device's", "[optim][clip][dp][ddp]") {
  // Exact data: DP's and DDP's (2 ranks) reduced gradients are bitwise the one-device gradient.
  auto const data = test::dataset<float>::make(8, model().dim, 21, true);
  model one;
  one.forward_backward(data.all());
  for (auto& g : one.g)
    for (float& x : g) x *= 0.25f;  // exact: the reduced gradients stay bitwise the one-device ones
  auto want = flat_grads(one);
  double const want_norm = reference_clip(want, 0.5, 2.0);

  model master;
  dpl::data_parallel<model> dp(master, dpl::host::devices(2));
  dp.step(data.all(), [](model& r, test::samples<float> s) {
    r.forward_backward(s);
    for (auto& g : r.g)
      for (float& x : g) x *= 0.25f;  // exact: the reduced gradients stay bitwise the one-device ones
  });
  CHECK(optim::clip_grad_norm(dp, 0.5) == want_norm);
  CHECK(same_bits(flat_grads(master), want));

  std::vector<std::vector<float>> got(2);
  std::vector<double> norms(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model m;
    dpl::distributed_data_parallel<model> ddp(m, rank.group());
    auto const lo = static_cast<std::size_t>(rank.rank()) * 4;
    ddp.step(dpl::slice_batch(data.all(), lo, lo + 4), [](model& r, test::samples<float> s) {
      r.forward_backward(s);
      for (auto& g : r.g)
        for (float& x : g) x *= 0.25f;  // exact: the reduced gradients stay bitwise the one-device ones
    });
    norms[static_cast<std::size_t>(rank.rank())] = optim::clip_grad_norm(ddp, 0.5);
    got[static_cast<std::size_t>(rank.rank())] = flat_grads(m);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(norms[static_cast<std::size_t>(r)] == want_norm);
    CHECK(same_bits(got[static_cast<std::size_t>(r)], want));
  }
}

TEST_CASE("sharded clipping (one collective) equals the unsharded computation", "[optim][clip][zero]") {
  model full = with_gradients(7, 3.0f);
  auto const all = flat_grads(full);  // 23 elements
  for (int world = 1; world <= 4; ++world) {
    for (double type : {2.0, inf}) {
      INFO("ranks " << world << ", norm_type " << type);
      auto want = all;
      double const want_norm = reference_clip(want, 0.25, type);
      // Uneven shards that cut through tensors; with 4 ranks one shard is empty.
      std::vector<std::size_t> cut = {0};
      for (int r = 1; r < world; ++r) cut.push_back(world == 4 && r == 2 ? cut.back() : all.size() * r / world + 1);
      cut.push_back(all.size());
      std::vector<double> norms(static_cast<std::size_t>(world));
      std::vector<float> got(all.size());
      dpl::spawn(world, [&](dpl::rank_context& rank) {
        auto const r = static_cast<std::size_t>(rank.rank());
        std::vector<float> mine(all.begin() + static_cast<std::ptrdiff_t>(cut[r]),
                                all.begin() + static_cast<std::ptrdiff_t>(cut[r + 1]));
        // The shard as two tensors when it can be split, as a bucket's pieces would be.
        std::vector<dpl::tensor_ref> shard;
        std::size_t const half = mine.size() / 2;
        shard.push_back(dpl::tensor_ref(mine.data(), half, dpl::dtype::f32));
        shard.push_back(dpl::tensor_ref(mine.data() + half, mine.size() - half, dpl::dtype::f32));
        norms[r] = optim::clip_grad_norm_sharded(shard, rank.group(), 0.25, {.norm_type = type});
        std::copy(mine.begin(), mine.end(), got.begin() + static_cast<std::ptrdiff_t>(cut[r]));
      });
      for (double n : norms) CHECK(std::memcmp(&n, &norms[0], sizeof n) == 0);  // the same bits on every rank
      if (type == inf) {
        CHECK(norms[0] == want_norm);  // exact however split
        CHECK(same_bits(got, want));
      } else {
        CHECK(std::fabs(norms[0] - want_norm) <= want_norm * 23 * 0x1p-53);  // the documented tolerance
        for (std::size_t i = 0; i < got.size(); ++i)
          CHECK(std::fabs(got[i] - want[i]) <= std::fabs(want[i]) * 0x1p-23);  // one f32 ulp at most
      }
    }
  }
}

TEST_CASE("clipping a non-finite norm is an error unless asked, and bad arguments are refused", "[optim][clip][error]") {
  using Catch::Matchers::Contains;
  model m = with_gradients(5);
  m.g[3][2] = std::numeric_limits<float>::quiet_NaN();
  auto const before = flat_grads(m);
  CHECK_THROWS_WITH(optim::clip_grad_norm(m, 1.0), Contains("nan") && Contains("not finite") &&
                                                       Contains("no gradient was changed"));
  CHECK(std::memcmp(flat_grads(m).data(), before.data(), before.size() * sizeof(float)) == 0);
  CHECK(std::isnan(optim::clip_grad_norm(m, 1.0, {.error_if_nonfinite = false})));
  CHECK(std::isnan(m.g[0][0]));  // scaled by the NaN coefficient, as PyTorch does
  model i = with_gradients(5);
  i.g[1][0] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH(optim::clip_grad_norm(i, 1.0, {.norm_type = inf}), Contains("inf"));
  std::vector<int> threw(3, 0);
  dpl::spawn(3, [&](dpl::rank_context& rank) {
    std::vector<float> g(4, 1.0f);
    if (rank.rank() == 1) g[2] = std::numeric_limits<float>::quiet_NaN();
    dpl::tensor_ref const t(g.data(), g.size(), dpl::dtype::f32);
    try {
      optim::clip_grad_norm_sharded(std::span<dpl::tensor_ref const>(&t, 1), rank.group(), 1.0);
    } catch (dpl::error const&) {
      threw[static_cast<std::size_t>(rank.rank())] = 1;
    }
  });
  CHECK(threw == std::vector<int>{1, 1, 1});  // every rank sees the same total
  model ok = with_gradients(6);
  CHECK_THROWS_WITH(optim::clip_grad_norm(ok, 1.0, {.norm_type = 1.0}), Contains("norm_type 2 or infinity"));
  CHECK_THROWS_WITH(optim::clip_grad_norm(ok, -1.0), Contains("max_norm >= 0"));
}

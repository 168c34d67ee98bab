// nn::batch_norm: PyTorch's BatchNorm1d numbers (training forward, backward, running statistics,
// evaluation), and the synchronised form over 2 and 3 thread ranks, even and uneven shards, equal
// to one device on the whole batch within float rounding; without the group the per-rank
// statistics differ, as they should.
#include <dparallel/dparallel.hpp>
#include <dparallel/nn/batch_norm.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dpl = dparallel;

namespace {

constexpr std::size_t channels = 3;

/// Whether every element of `got` is within `tol` (relative to max(1, |want|)) of `want`.
bool close(std::vector<float> const& got, std::vector<float> const& want, double tol) {
  if (got.size() != want.size()) return false;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::fabs(double(got[i]) - double(want[i])) > tol * std::max(1.0, std::fabs(double(want[i])))) return false;
  return true;
}

std::vector<float> copy(dpl::tensor_view<float> v) { return {v.begin(), v.end()}; }

/// Deterministic values in [-2, 2).
std::vector<float> values(std::size_t n, std::uint32_t seed) {
  std::vector<float> out(n);
  std::uint32_t s = seed * 2654435761u + 1;
  for (auto& v : out) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>((s >> 8) % 4096) / 1024.0f - 2.0f;
  }
  return out;
}

void set_affine(dpl::nn::batch_norm& bn) {
  std::vector<float> const w{1.5f, -0.5f, 2.0f}, b{0.1f, 0.2f, -0.3f};
  std::copy(w.begin(), w.end(), bn.weight().begin());
  std::copy(b.begin(), b.end(), bn.bias().begin());
}

}  // namespace

TEST_CASE("batch_norm: PyTorch's BatchNorm1d numbers", "[nn][batch_norm]") {
  // torch.nn.BatchNorm1d(3) (weight, bias as set_affine) on this 4 x 3 input in training mode,
  // loss = sum(a * y); then eval() on the same input (PyTorch 1.13).
  std::vector<float> const x{0.5f, -1.0f, 2.0f, 1.5f, 0.25f, -0.5f, -2.0f, 0.75f, 1.0f, 0.0f, -0.5f, 3.0f};
  std::vector<float> const a{1.0f, -0.5f, 0.25f, 0.5f, 2.0f, -1.0f, -1.5f, 0.5f, 0.75f, 0.25f, -1.0f, 1.5f};
  dpl::nn::batch_norm bn(channels);
  set_affine(bn);
  std::vector<float> y(12), dx(12), eval(12);
  bn.forward(dpl::view(x), dpl::view(y));
  bn.backward(dpl::view(a), dpl::view(dx));
  bn.forward_eval(dpl::view(x), dpl::view(eval));
  CHECK(close(y, {0.688346624f, 0.849926531f, 0.666733503f, 1.86503983f, -0.0785399377f, -3.20020103f, -2.2533865f,
                  -0.449926525f, -0.880040288f, 0.100000001f, 0.478539944f, 2.21350718f},
              1e-6));
  CHECK(close(dx, {0.718464077f, -0.160064623f, -0.798681021f, -0.639254153f, -0.992505372f, -0.310811132f,
                   -0.299839914f, 0.531451166f, 0.943240702f, 0.220629975f, 0.621118844f, 0.166251421f},
              1e-6));
  CHECK(close(copy(bn.weight_grad()), {3.33396411f, 2.9710927f, 3.23855758f}, 1e-6));
  CHECK(close(copy(bn.bias_grad()), {0.25f, 1.0f, 1.5f}, 1e-6));
  CHECK(close(copy(bn.running_mean()), {0.0f, -0.0125000002f, 0.137500003f}, 1e-6));
  CHECK(close(copy(bn.running_var()), {1.11666667f, 0.960416675f, 1.1229167f}, 1e-6));
  CHECK(close(eval, {0.809737206f, 0.703819513f, 3.21520424f, 2.22921157f, 0.0660732985f, -1.50319076f,
                     -2.73894882f, -0.189025193f, 1.32784629f, 0.100000001f, 0.448721051f, 5.10256195f},
              1e-6));
}

TEST_CASE("batch_norm synchronised over 2 and 3 ranks equals one device on the whole batch, even and uneven shards",
          "[nn][batch_norm][ddp]") {
  std::size_t const n = 12;
  auto const x = values(n * channels, 1);
  auto const a = values(n * channels, 2);  // the global loss: sum(a * y)
  // One device on the whole batch, two training steps (the running statistics move twice).
  dpl::nn::batch_norm one(channels);
  set_affine(one);
  std::vector<float> y1(n * channels), dx1(n * channels);
  for (int step = 0; step < 2; ++step) {
    one.forward(dpl::view(x), dpl::view(y1));
    one.backward(dpl::view(a), dpl::view(dx1));
  }
  for (int world : {2, 3}) {
    for (bool uneven : {false, true}) {
      for (auto weight : {dpl::nn::sync_weight::ranks, dpl::nn::sync_weight::samples}) {
        if (uneven && weight == dpl::nn::sync_weight::ranks) continue;  // ranks: every shard alike
        INFO(world << " ranks, " << (uneven ? "uneven" : "even") << " shards, weight "
                   << (weight == dpl::nn::sync_weight::ranks ? "ranks" : "samples"));
        // Rows per rank: even, or 12 = 2 + 10 and 12 = 1 + 4 + 7.
        std::vector<std::size_t> rows = uneven ? (world == 2 ? std::vector<std::size_t>{2, 10}
                                                              : std::vector<std::size_t>{1, 4, 7})
                                               : std::vector<std::size_t>(static_cast<std::size_t>(world),
                                                                          n / static_cast<std::size_t>(world));
        std::vector<std::size_t> first{0};
        for (std::size_t r : rows) first.push_back(first.back() + r);
        struct rank_out {
          std::vector<float> y, dx, dw, db, rm, rv;
          double w = 0;
        };
        std::vector<rank_out> out(static_cast<std::size_t>(world));
        dpl::spawn(world, [&](dpl::rank_context& rank) {
          auto const r = static_cast<std::size_t>(rank.rank());
          auto const lo = first[r] * channels, hi = first[r + 1] * channels;
          std::vector<float> xr(x.begin() + static_cast<std::ptrdiff_t>(lo), x.begin() + static_cast<std::ptrdiff_t>(hi));
          // This rank's share w of the average: its loss is its part of the global loss / w.
          double const w = weight == dpl::nn::sync_weight::ranks ? 1.0 / world : double(rows[r]) / double(n);
          std::vector<float> dy(hi - lo);
          for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = static_cast<float>(a[lo + i] / w);
          dpl::nn::batch_norm bn(channels, {.weight = weight});
          set_affine(bn);
          std::vector<float> y(xr.size()), dx(xr.size());
          for (int step = 0; step < 2; ++step) {
            bn.forward(dpl::view(xr), dpl::view(y), &rank.group());
            bn.backward(dpl::view(dy), dpl::view(dx));
          }
          out[r] = {y, dx, copy(bn.weight_grad()), copy(bn.bias_grad()), copy(bn.running_mean()),
                    copy(bn.running_var()), w};
        });
        std::vector<double> dw(channels, 0.0), db(channels, 0.0);
        for (std::size_t r = 0; r < out.size(); ++r) {
          auto const lo = first[r] * channels, hi = first[r + 1] * channels;
          std::vector<float> const want_y(y1.begin() + static_cast<std::ptrdiff_t>(lo),
                                          y1.begin() + static_cast<std::ptrdiff_t>(hi));
          std::vector<float> want_dx(hi - lo);
          for (std::size_t i = 0; i < want_dx.size(); ++i) want_dx[i] = static_cast<float>(dx1[lo + i] / out[r].w);
          CHECK(close(out[r].y, want_y, 1e-5));
          CHECK(close(out[r].dx, want_dx, 1e-5));  // the rank's share of the one-device input gradient
          CHECK(close(out[r].rm, copy(one.running_mean()), 1e-6));
          CHECK(close(out[r].rv, copy(one.running_var()), 1e-6));
          for (std::size_t k = 0; k < channels; ++k) {
            dw[k] += out[r].w * out[r].dw[k];  // as the wrapper averages them
            db[k] += out[r].w * out[r].db[k];
          }
        }
        CHECK(close(std::vector<float>(dw.begin(), dw.end()), copy(one.weight_grad()), 1e-5));
        CHECK(close(std::vector<float>(db.begin(), db.end()), copy(one.bias_grad()), 1e-5));
      }
    }
  }
}

TEST_CASE("batch_norm without the group normalises each rank by its own statistics", "[nn][batch_norm]") {
  std::size_t const n = 8;
  auto const x = values(n * channels, 3);
  dpl::nn::batch_norm one(channels);
  std::vector<float> y1(n * channels);
  one.forward(dpl::view(x), dpl::view(y1));
  std::vector<int> same(2, 1);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    auto const lo = static_cast<std::size_t>(rank.rank()) * 4 * channels;
    std::vector<float> xr(x.begin() + static_cast<std::ptrdiff_t>(lo),
                          x.begin() + static_cast<std::ptrdiff_t>(lo + 4 * channels));
    std::vector<float> y(xr.size());
    dpl::nn::batch_norm bn(channels);
    bn.forward(dpl::view(xr), dpl::view(y));  // local statistics
    same[static_cast<std::size_t>(rank.rank())] =
        close(y, std::vector<float>(y1.begin() + static_cast<std::ptrdiff_t>(lo),
                                    y1.begin() + static_cast<std::ptrdiff_t>(lo + 4 * channels)),
              1e-3)
            ? 1
            : 0;
  });
  CHECK(same == std::vector<int>{0, 0});
}

TEST_CASE("batch_norm refuses what cannot be normalised", "[nn][batch_norm][error]") {
  using Catch::Matchers::Contains;
  dpl::nn::batch_norm bn(channels);
  std::vector<float> one_row(channels), y(channels), odd(4), y4(4);
  CHECK_THROWS_WITH(bn.forward(dpl::view(one_row), dpl::view(y)), Contains("more than one value per channel"));
  CHECK_THROWS_WITH(bn.forward(dpl::view(odd), dpl::view(y4)), Contains("rows x 3 values"));
  CHECK_THROWS_WITH(bn.backward(dpl::view(y), dpl::view(y)), Contains("training forward() first"));
  CHECK_THROWS_WITH(dpl::nn::batch_norm(0), Contains("at least one channel"));
}

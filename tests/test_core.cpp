// Core vocabulary: partitioning, views, batch_traits, the model customisation points.
#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <numeric>
#include <span>
#include <tuple>
#include <vector>

namespace dp = dparallel;

TEST_CASE("chunk_sizes follows torch.chunk for every B in 1..100 and N in 1..9", "[core][partition]") {
  for (std::size_t n = 1; n <= 9; ++n) {
    for (std::size_t b = 1; b <= 100; ++b) {
      auto const s = dp::chunk_sizes(b, n);
      // torch.chunk's definition: split_size = ceil(B / N); torch.split(split_size) then yields
      // ceil(B / split_size) chunks, all of split_size except a smaller last one.
      std::size_t const split = (b + n - 1) / n;
      std::size_t const count = (b + split - 1) / split;
      INFO("B = " << b << ", N = " << n);
      REQUIRE(s.size() == count);
      REQUIRE(s.size() <= n);
      for (std::size_t i = 0; i + 1 < s.size(); ++i) REQUIRE(s[i] == split);
      REQUIRE(s.back() == b - split * (count - 1));
      REQUIRE(s.back() >= 1);
      REQUIRE(std::accumulate(s.begin(), s.end(), std::size_t{0}) == b);
    }
  }
  // Values printed by torch.chunk(torch.arange(B), N) for a few (B, N).
  CHECK(dp::chunk_sizes(5, 4) == std::vector<std::size_t>{2, 2, 1});
  CHECK(dp::chunk_sizes(6, 4) == std::vector<std::size_t>{2, 2, 2});
  CHECK(dp::chunk_sizes(10, 4) == std::vector<std::size_t>{3, 3, 3, 1});
  CHECK(dp::chunk_sizes(65, 4) == std::vector<std::size_t>{17, 17, 17, 14});
  CHECK(dp::chunk_sizes(2, 3) == std::vector<std::size_t>{1, 1});
  CHECK(dp::chunk_sizes(1, 9) == std::vector<std::size_t>{1});
}

TEST_CASE("an empty batch is an error for every partition", "[core][partition]") {
  for (std::size_t n = 1; n <= 9; ++n) {
    CHECK_THROWS_AS(dp::chunk_sizes(0, n), dp::invalid_argument);
    CHECK_THROWS_AS(dp::even_sizes(0, n), dp::invalid_argument);
  }
  CHECK_THROWS_WITH(dp::chunk_sizes(0, 2), Catch::Contains("empty batch"));
  CHECK_THROWS_AS(dp::chunk_sizes(4, 0), dp::invalid_argument);
}

TEST_CASE("even_sizes follows torch.tensor_split", "[core][partition]") {
  for (std::size_t n = 1; n <= 9; ++n) {
    for (std::size_t b = 1; b <= 100; ++b) {
      auto const s = dp::even_sizes(b, n);
      INFO("B = " << b << ", N = " << n);
      REQUIRE(s.size() == std::min(b, n));
      REQUIRE(std::accumulate(s.begin(), s.end(), std::size_t{0}) == b);
      for (std::size_t i = 0; i + 1 < s.size(); ++i) REQUIRE((s[i] == s[i + 1] || s[i] == s[i + 1] + 1));
      REQUIRE(s.front() - s.back() <= 1);
    }
  }
  CHECK(dp::even_sizes(10, 4) == std::vector<std::size_t>{3, 3, 2, 2});
}

TEST_CASE("weighted_sizes is proportional, exact in sum and deterministic", "[core][partition]") {
  CHECK(dp::weighted_sizes(100, {1, 1, 2}) == std::vector<std::size_t>{25, 25, 50});
  CHECK(dp::weighted_sizes(10, {1, 1, 1}) == std::vector<std::size_t>{4, 3, 3});
  CHECK(dp::weighted_sizes(64, {0, 1}) == std::vector<std::size_t>{0, 64});
  CHECK(dp::weighted_sizes(7, {0.5, 1, 1}) == std::vector<std::size_t>{1, 3, 3});
  for (std::size_t b = 1; b <= 50; ++b) {
    auto const s = dp::weighted_sizes(b, {0.3, 1.7, 1.0});
    REQUIRE(std::accumulate(s.begin(), s.end(), std::size_t{0}) == b);
  }
  CHECK_THROWS_AS(dp::weighted_sizes(10, {0, 0}), dp::invalid_argument);
  CHECK_THROWS_AS(dp::weighted_sizes(10, {1, -1}), dp::invalid_argument);
  CHECK_THROWS_AS(dp::partition(10, 3, dp::chunking::weights, {1, 1}), dp::invalid_argument);
  CHECK(dp::partition(10, 3, dp::chunking::sizes, {}, {2, 0, 8}) == std::vector<std::size_t>{2, 0, 8});
  CHECK_THROWS_WITH(dp::partition(10, 2, dp::chunking::sizes, {}, {2, 7}), Catch::Contains("summing to the batch size 10"));
}

TEST_CASE("tensor_view slices rows and converts to tensor_ref", "[core][view]") {
  std::vector<float> data(12);
  std::iota(data.begin(), data.end(), 0.0f);
  dp::tensor_view<float> v(data.data(), 12, 4);  // 4 samples of 3
  CHECK(v.rows() == 4);
  CHECK(v.row_size() == 3);
  auto s = v.slice_rows(1, 3);
  CHECK(s.rows() == 2);
  CHECK(s.size() == 6);
  CHECK(s[0] == 3.0f);
  CHECK_THROWS_AS(v.slice_rows(3, 5), dp::invalid_argument);
  CHECK_THROWS_AS(dp::tensor_view<float>(data.data(), 12, 5), dp::invalid_argument);
  dp::tensor_view<float const> c = v;
  CHECK(c.data() == v.data());
  dp::tensor_ref r = v;
  CHECK(r.dtype() == dp::dtype::f32);
  CHECK(r.size_bytes() == 48);
  CHECK(r.as<float>().data() == data.data());
  CHECK_THROWS_AS(r.as<double>(), dp::invalid_argument);
}

TEST_CASE("buffer owns aligned, value-initialised storage", "[core][buffer]") {
  dp::buffer<double> b(10, 5);
  CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 64 == 0);
  for (double x : b) CHECK(x == 0.0);
  b[3] = 2.5;
  dp::buffer<double> copy = b;
  CHECK(copy[3] == 2.5);
  CHECK(copy.data() != b.data());
  CHECK(copy.view().rows() == 5);
}

namespace {
struct pair_batch {
  dp::tensor_view<const float> x;
  dp::tensor_view<const std::int32_t> y;
};
struct mixed_batch {
  std::vector<int> ids;
  dp::tensor_view<const float> x;
};
}  // namespace

TEST_CASE("batch_traits size and slice views, vectors, tuples and aggregates", "[core][batch]") {
  std::vector<float> x(20);
  std::vector<std::int32_t> y(5);
  std::iota(x.begin(), x.end(), 0.0f);
  std::iota(y.begin(), y.end(), 0);
  dp::tensor_view<const float> xv(x.data(), 20, 5);
  dp::tensor_view<const std::int32_t> yv(y.data(), 5);

  CHECK(dp::batch_size(xv) == 5);
  CHECK(dp::batch_size(y) == 5);
  auto ys = dp::slice_batch(y, 1, 4);
  static_assert(std::is_same_v<decltype(ys), std::span<const std::int32_t>>);
  CHECK(ys.size() == 3);
  CHECK(ys[0] == 1);

  pair_batch pb{xv, yv};
  CHECK(dp::batch_size(pb) == 5);
  auto ps = dp::slice_batch(pb, 2, 5);
  static_assert(std::is_same_v<decltype(ps), pair_batch>, "an aggregate of views slices to itself");
  CHECK(ps.x.rows() == 3);
  CHECK(ps.x[0] == 8.0f);
  CHECK(ps.y[0] == 2);

  mixed_batch mb{{10, 11, 12, 13, 14}, xv};
  auto ms = dp::slice_batch(mb, 3, 5);
  static_assert(std::is_same_v<decltype(ms), std::tuple<std::span<const int>, dp::tensor_view<const float>>>);
  CHECK(std::get<0>(ms)[0] == 13);

  auto t = std::make_tuple(xv, y);
  CHECK(dp::batch_size(t) == 5);
  auto ts = dp::slice_batch(t, 0, 2);
  CHECK(std::get<1>(ts).size() == 2);

  std::vector<std::int32_t> short_y(4);
  pair_batch bad{xv, dp::tensor_view<const std::int32_t>(short_y.data(), 4)};
  CHECK_THROWS_WITH(dp::batch_size(bad), Catch::Contains("member 0 holds 5, member 1 holds 4"));
  static_assert(!dp::batch<int*>);
}

namespace {
struct with_members {
  std::vector<float> p{1, 2}, g{0, 0};
  auto parameters() { return std::array{dp::view(p)}; }
  auto gradients() { return std::array{dp::view(g)}; }
};
struct theirs {  // a type the user cannot edit
  std::vector<double> weights{1, 2, 3}, grad{0, 0, 0}, stats{7};
};
}  // namespace

template <>
struct dparallel::model_traits<theirs> {
  static auto parameters(theirs& m) { return std::array{dparallel::view(m.weights)}; }
  static auto gradients(theirs& m) { return std::array{dparallel::view(m.grad)}; }
  static auto buffers(theirs& m) { return std::array{dparallel::view(m.stats)}; }
};

TEST_CASE("model customisation points: members first, then model_traits", "[core][model]") {
  static_assert(dp::model<with_members>);
  static_assert(dp::model<theirs>);
  static_assert(!dp::model<int>);
  with_members a;
  CHECK(dp::parameter_refs(a).size() == 1);
  CHECK(dp::buffer_refs(a).empty());
  theirs b;
  auto p = dp::parameter_refs(b);
  REQUIRE(p.size() == 1);
  CHECK(p[0].dtype() == dp::dtype::f64);
  CHECK(p[0].data() == b.weights.data());
  REQUIRE(dp::buffer_refs(b).size() == 1);
  CHECK(dp::buffer_refs(b)[0].data() == b.stats.data());
  b.grad.resize(2);
  CHECK_THROWS_WITH(dp::verify_model(b, "here"), Catch::Contains("gradient 0 does not match its parameter"));
}

TEST_CASE("errors carry the device", "[core][error]") {
  dp::device_error e(3, "boom");
  CHECK(e.device() == 3);
  CHECK(std::string(e.what()) == "dparallel: on device 3: boom");
  dp::error const& base = e;
  CHECK(std::string(base.what()).find("boom") != std::string::npos);
}

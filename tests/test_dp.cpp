// DataParallel on the host backend: the contracts of docs/design.md ("The four contracts") as equalities.
#include "dp_contracts.hpp"
#include "threads.hpp"

#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <span>
#include <thread>
#include <vector>

namespace dp = dparallel;
using host = dp::host::backend;

TEST_CASE("DP gives the one-device gradient on random data", "[host][dp][contract]") {
  for (int n = 1; n <= 4; ++n)
    for (std::size_t b : {std::size_t{1}, std::size_t(n - 1), std::size_t(n), std::size_t{7}, std::size_t{64},
                          std::size_t{65}}) {
      if (b == 0) continue;  // B = 0 is an error, tested below
      test::check_same_gradients<host, float>(n, b, false);
      test::check_same_gradients<host, double>(n, b, false);
    }
}

TEST_CASE("DP gives exactly the one-device gradient when the sums are exact", "[host][dp][contract]") {
  // Power-of-two shards make every weight and mean exact.
  for (int n : {1, 2, 4})
    for (std::size_t b : {std::size_t(n), std::size_t{64}}) test::check_same_gradients<host, float>(n, b, true);
}

TEST_CASE("B < N uses fewer replicas, as torch.chunk does", "[host][dp][contract]") {
  test::linreg<float> m;
  dp::data_parallel<test::linreg<float>> wrapped(m, dp::host::devices(4));
  auto const data = test::dataset<float>::make(2, 4, 5, true);
  auto losses = wrapped.step(data.all(), [](auto& r, auto shard) { return r.forward_backward(shard); });
  CHECK(losses.size() == 2);
  CHECK(wrapped.last_shard_sizes() == std::vector<std::size_t>{1, 1, 0, 0});
  auto const five = test::dataset<float>::make(5, 4, 5, true);
  wrapped.step(five.all(), [](auto& r, auto shard) { return r.forward_backward(shard); });
  CHECK(wrapped.last_shard_sizes() == std::vector<std::size_t>{2, 2, 1, 0});
}

TEST_CASE("chunking options: even split, weights and explicit sizes keep the gradient", "[host][dp][contract]") {
  test::check_same_gradients<host, double>(3, 10, false, {.chunking = dp::chunking::even});
  test::check_same_gradients<host, double>(3, 10, false, {.chunking = dp::chunking::weights, .chunk_weights = {0.5, 1, 1}});
  test::check_same_gradients<host, double>(3, 10, false, {.chunking = dp::chunking::sizes, .chunk_sizes = {0, 4, 6}});
  test::check_same_gradients<host, double>(3, 10, false, {.chunking = dp::chunking::sizes, .chunk_sizes = {2, 0, 8}});

  test::linreg<double> m;
  dp::data_parallel<test::linreg<double>> wrapped(m, dp::host::devices(3),
                                                  {.chunking = dp::chunking::weights, .chunk_weights = {0, 1, 1}});
  auto const data = test::dataset<double>::make(9, 4, 5, true);
  wrapped.step(data.all(), [](auto& r, auto shard) { return r.forward_backward(shard); });
  CHECK(wrapped.last_shard_sizes() == std::vector<std::size_t>{0, 5, 4});  // the master is relieved

  dp::data_parallel<test::linreg<double>> sized(m, dp::host::devices(2),
                                                {.chunking = dp::chunking::sizes, .chunk_sizes = {3, 3}});
  CHECK_THROWS_WITH(sized.step(data.all(), [](auto& r, auto shard) { return r.forward_backward(shard); }),
                    Catch::Contains("summing to the batch size 9"));
}

TEST_CASE("DP is bitwise reproducible run to run", "[host][dp][contract]") {
  for (int n : {1, 2, 3, 4}) {
    auto const a = test::train_steps<host, float>(n, 6);
    auto const b = test::train_steps<host, float>(n, 6);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
  }
}

TEST_CASE("buffers are replicated from the master, never reduced", "[host][dp]") {
  test::linreg<double> m;
  m.seen[0] = 100;
  dp::data_parallel<test::linreg<double>> wrapped(m, dp::host::devices(3));
  auto const data = test::dataset<double>::make(9, 4, 1, true);
  wrapped.step(data.all(), [](auto& r, auto shard) { return r.forward_backward(shard); });
  CHECK(m.seen[0] == 103);  // the master counted its own shard only
  CHECK(wrapped.replica(1).seen[0] == 103);  // 100 copied from the master, then its shard of 3
  CHECK(wrapped.replica(2).seen[0] == 103);
}

TEST_CASE("gathered outputs: void, vectors and arithmetic values", "[host][dp]") {
  test::linreg<float> m;
  // Forward-only steps: they write no gradient, which the contract check would report.
  dp::data_parallel<test::linreg<float>> wrapped(m, dp::host::devices(2), {.check_contracts = false});
  std::vector<int> ids{0, 1, 2, 3, 4};
  int runs = 0;
  std::mutex mu;
  wrapped.step(ids, [&](auto&, std::span<const int>) {
    std::lock_guard lock(mu);
    ++runs;
  });
  CHECK(runs == 2);
  auto echoed = wrapped.step(ids, [](auto&, std::span<const int> s) { return std::vector<int>(s.begin(), s.end()); });
  CHECK(echoed == ids);
  auto offsets = wrapped.step(ids, [](auto&, auto, dp::step_context& c) { return c.shard_offset(); });
  CHECK(offsets == std::vector<std::size_t>{0, 3});
  auto bufs = wrapped.step(ids, [](auto&, std::span<const int> s) {
    dp::buffer<int> b(s.size());
    std::copy(s.begin(), s.end(), b.begin());
    return b;
  });
  CHECK(std::vector<int>(bufs.begin(), bufs.end()) == ids);
}


TEST_CASE("an exception in the step function names the device; the wrapper stays usable", "[host][dp][error]") {
  int const threads_before = test::thread_count();
  {
    test::linreg<double> m;
    auto const ref = test::reference_step(m, test::dataset<double>::make(8, 4, 3, false).all());
    dp::data_parallel<test::linreg<double>> wrapped(m, dp::host::devices(4));
    auto const data = test::dataset<double>::make(8, 4, 3, false);
    for (int bad = 0; bad < 4; ++bad) {
      try {
        wrapped.step(data.all(), [bad](auto& r, auto shard, dp::step_context& ctx) {
          if (ctx.replica() == bad) throw std::runtime_error("loss is NaN");
          return r.forward_backward(shard);
        });
        FAIL("the step must throw");
      } catch (dp::device_error const& e) {
        CHECK(e.device() == bad);
        CHECK_THAT(e.what(), Catch::Contains("device " + std::to_string(bad)) && Catch::Contains("loss is NaN"));
      }
      // The next step works and is right.
      wrapped.step(data.all(), [](auto& r, auto shard) { return r.forward_backward(shard); });
      CHECK(test::rel_error(test::flat(m, true), test::flat(const_cast<test::linreg<double>&>(ref), true)) <= 1e-12);
    }
  }
  if (threads_before > 0) CHECK(test::thread_count_settled(threads_before) == threads_before);  // every worker joined
}

namespace {
struct ragged {  // gradients that do not match the parameters
  std::vector<float> p{1, 2, 3}, g{0, 0};
  auto parameters() { return std::array{dp::view(p)}; }
  auto gradients() { return std::array{dp::view(g)}; }
};
struct aliasing {  // a model whose copies share storage (holds a pointer)
  std::vector<float>* storage;
  std::vector<float>* grad;
  auto parameters() { return std::array{dp::view(*storage)}; }
  auto gradients() { return std::array{dp::view(*grad)}; }
};
}  // namespace

TEST_CASE("bad input gets a clear error", "[host][dp][error]") {
  test::linreg<float> m;
  CHECK_THROWS_WITH(dp::data_parallel<test::linreg<float>>(m, {}), Catch::Contains("empty device list"));
  CHECK_THROWS_WITH(dp::data_parallel<test::linreg<float>>(
                        m, {dp::device{dp::device_kind::host, 0}, dp::device{dp::device_kind::host, 0}}),
                    Catch::Contains("expected distinct devices") && Catch::Contains("host:0"));
  CHECK_THROWS_WITH(dp::data_parallel<test::linreg<float>>(
                        m, dp::host::devices(2), {.output_device = dp::device{dp::device_kind::host, 5}}),
                    Catch::Contains("output_device") && Catch::Contains("host:5"));
  dp::data_parallel<test::linreg<float>> wrapped(m, dp::host::devices(2),
                                                 {.output_device = dp::device{dp::device_kind::host, 1}});
  CHECK(wrapped.output_device() == dp::device{dp::device_kind::host, 1});
  std::vector<float> none;
  CHECK_THROWS_WITH(wrapped.step(none, [](auto&, auto) {}), Catch::Contains("empty batch"));

  ragged r;
  CHECK_THROWS_WITH(dp::data_parallel<ragged>(r, dp::host::devices(2)),
                    Catch::Contains("gradient 0 does not match its parameter") &&
                        Catch::Contains("expected 3 elements of F32, found 2"));
  std::vector<float> s{1, 2}, g{0, 0};
  aliasing a{&s, &g};
  CHECK_THROWS_WITH(dp::data_parallel<aliasing>(a, dp::host::devices(2)), Catch::Contains("shares storage"));
}

namespace {
/// DataParallel where every replica gets the reduced gradient and runs its own optimizer.
struct dp_allreduce : dp::dp {
  using replicate = dparallel::policy::replicate_once;
  using reduce = dparallel::policy::all_reduce_replicas;
};
static_assert(dp::semantics<dp_allreduce>);
}  // namespace

TEST_CASE("policies compose: DP with all-reduce lets every replica run its own optimizer", "[host][dp][policy]") {
  using T = double;
  test::linreg<T> a(8, 3), b(8, 3);
  dp::parallel<test::linreg<T>, dp_allreduce> every(a, dp::host::devices(3));
  dp::data_parallel<test::linreg<T>> standard(b, dp::host::devices(3));
  for (int s = 0; s < 5; ++s) {
    auto const data = test::dataset<T>::make(s == 2 ? 2 : 11, 8, 40 + static_cast<std::uint64_t>(s), false);
    auto fn = [](test::linreg<T>& m, test::samples<T> shard) { return m.forward_backward(shard); };
    every.step(data.all(), fn);
    standard.step(data.all(), fn);
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(test::flat(every.replica(i), true) == test::flat(b, true));  // same reduced gradient everywhere
      every.replica(i).sgd(T(0.1));
    }
    b.sgd(T(0.1));
    for (std::size_t i = 0; i < 3; ++i) CHECK(test::same_bits(every.replica(i), b));
  }
}

namespace {
/// Gradients reached through a pointer member. A copy (DataParallel's replica) keeps pointing at
/// the master's gradient unless its copy constructor points it at its own (OwnCopy).
template <bool OwnCopy>
struct pointer_grads {
  std::vector<float> w{1, 2}, g{0, 0};
  float* gp = g.data();
  pointer_grads() = default;
  pointer_grads(pointer_grads const& o) : w(o.w), g(o.g), gp(OwnCopy ? g.data() : o.gp) {}
  pointer_grads& operator=(pointer_grads const&) = delete;
  ~pointer_grads() = default;
  auto parameters() { return std::array{dp::view(w)}; }
  auto gradients() { return std::array{dp::tensor_view<float>(gp, g.size())}; }
};
/// Gradient 1 is a view of parameter 1's memory.
struct grad_over_param {
  std::vector<float> w{1, 2}, b{3}, gw{0, 0};
  auto parameters() { return std::array{dp::view(w), dp::view(b)}; }
  auto gradients() { return std::array{dp::view(gw), dp::view(b)}; }
};
}  // namespace

TEST_CASE("DP refuses replicas whose gradients alias the master's, and gradients over parameters",
          "[host][dp][error]") {
  std::vector<float> const batch{1, 2, 3, 4};
  auto const fn = [](auto& m, std::span<float const> s) {  // the gradient of the mean of w . x over the shard
    for (std::size_t j = 0; j < 2; ++j) m.gp[j] = (s[0] + s[s.size() - 1]) / 2 * static_cast<float>(j + 1);
  };
  pointer_grads<true> own;  // the same model with a copy of its own trains as one device does
  dp::data_parallel<pointer_grads<true>> good(own, dp::host::devices(2));
  good.step(batch, fn);
  pointer_grads<true> one;
  fn(one, std::span<float const>(batch));
  CHECK(own.g == std::vector<float>{2.5F, 5.0F});
  CHECK(own.g == one.g);

  pointer_grads<false> shared;
  CHECK_THROWS_WITH(dp::data_parallel<pointer_grads<false>>(shared, dp::host::devices(3)),
                    Catch::Contains("the replica for host:1: gradient 0 shares storage with the master's gradient 0") &&
                        Catch::Contains("make_replica"));
  grad_over_param over;
  CHECK_THROWS_WITH(dp::data_parallel<grad_over_param>(over, dp::host::devices(2)),
                    Catch::Contains("the model: gradient 1 shares memory with parameter 1; every gradient needs "
                                    "memory of its own"));
}

TEST_CASE("a step function that adds into the gradients, with module() zeroed by the user, trains as one device",
          "[host][dp][contract]") {
  // PyTorch's habit: zero the module's gradients, then let backward add into them. DataParallel
  // zeroes its replicas' gradients before each step function, so nothing piles up across steps.
  using T = double;
  using M = test::linreg<T>;
  auto const add_gradient = [](M& m, test::samples<T> s) {
    M fresh = m;
    T const loss = fresh.forward_backward(s);
    for (std::size_t j = 0; j < m.gw.size(); ++j) m.gw[j] += fresh.gw[j];
    m.gb[0] += fresh.gb[0];
    return loss;
  };
  auto const zero_grad = [](M& m) {
    std::fill(m.gw.begin(), m.gw.end(), T(0));
    m.gb[0] = 0;
  };
  for (int n : {2, 3}) {
    M one(6, 5), m(6, 5);
    dp::data_parallel<M> wrapped(m, dp::host::devices(n));
    for (int step = 0; step < 5; ++step) {
      auto const data = test::dataset<T>::make(12, 6, 60 + static_cast<std::uint64_t>(step), false);
      zero_grad(one);
      add_gradient(one, data.all());
      one.sgd(T(0.1));
      zero_grad(wrapped.module());
      wrapped.step(data.all(), add_gradient);
      CHECK(test::rel_error(test::flat(m, true), test::flat(one, true)) < 1e-12);
      wrapped.module().sgd(T(0.1));
      CHECK(test::rel_error(test::flat(m, false), test::flat(one, false)) < 1e-12);
    }
  }
}

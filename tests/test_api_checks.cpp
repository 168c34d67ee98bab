// Mistakes that could pass silently, and the messages that name them: each is an error, or a
// result, stated here as an equality.
#include "models.hpp"

#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace dpl = dparallel;
using model = test::linreg<float>;

namespace {

std::size_t count_of(std::string const& text, std::string const& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

/// A metrics struct with no gather_traits specialisation.
struct metrics {
  float loss = 0;
  std::size_t samples = 0;
};

/// An output type whose gather_traits takes the output device.
struct placed {
  float value = 0;
};

/// A model with 24 weights whose declared shape is chosen per rank.
struct shaped {
  std::vector<float> w = std::vector<float>(24, 1.0F), g = std::vector<float>(24, 0.0F);
  std::vector<std::size_t> shape;
  auto parameters() { return std::array{dpl::view(w)}; }
  auto gradients() { return std::array{dpl::view(g)}; }
  auto parameter_shapes() const { return std::vector<std::vector<std::size_t>>{shape}; }
};

}  // namespace

template <>
struct dparallel::gather_traits<placed> {
  static std::vector<dparallel::device> concat(std::vector<placed>&& outs, dparallel::device where) {
    return std::vector<dparallel::device>(outs.size(), where);
  }
};

TEST_CASE("a step function returning a struct gathers into std::vector<Out> by default", "[host][gather]") {
  auto const data = test::dataset<float>::make(10, 4, 21, true);
  model m;
  dpl::data_parallel<model> dp(m, dpl::host::devices(3));
  std::vector<metrics> const out = dp.step(data.all(), [](model& r, test::samples<float> s) {
    return metrics{r.forward_backward(s), s.x.rows()};
  });
  REQUIRE(out.size() == 3);
  model ref;
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(out[i].samples == dp.last_shard_sizes()[i]);
    auto const first = dp.last_shard_sizes()[0] * i;  // torch.chunk of 10 over 3: 4, 4, 2
    CHECK(out[i].loss == ref.forward_backward(dpl::slice_batch(data.all(), first, first + out[i].samples)));
  }
}

TEST_CASE("options::output_device is the device a gather_traits with a device argument gathers on",
          "[host][gather]") {
  auto const data = test::dataset<float>::make(6, 4, 22, true);
  for (int out_dev : {0, 2}) {
    model m;
    dpl::data_parallel<model> dp(m, dpl::host::devices(3), {.output_device = dpl::device{dpl::device_kind::host, out_dev}});
    auto const where = dp.step(data.all(), [](model& r, test::samples<float> s) { return placed{r.forward_backward(s)}; });
    CHECK(where == std::vector<dpl::device>(3, dpl::device{dpl::device_kind::host, out_dev}));
    CHECK(dp.output_device() == dpl::device{dpl::device_kind::host, out_dev});
  }
}

TEST_CASE("two thread ranks wrapping the same model object fail at construction", "[host][ddp][diagnostics]") {
  model shared;  // built before spawn: the mistake
  try {
    dpl::spawn(2, [&](dpl::rank_context& rank) { dpl::distributed_data_parallel<model> ddp(shared, rank); });
    FAIL("expected an error");
  } catch (dpl::error const& e) {
    CHECK_THAT(e.what(), Catch::Contains("shares memory with a parameter of the model that rank") &&
                             Catch::Contains("every rank needs a model of its own"));
  }
  // Models of their own, and a model wrapped again after its first wrapper is gone, are fine.
  model again;
  { dpl::spawn(1, [&](dpl::rank_context& rank) { dpl::distributed_data_parallel<model> ddp(again, rank); }); }
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model own;
    dpl::distributed_data_parallel<model> ddp(own, rank);
  });
  dpl::spawn(1, [&](dpl::rank_context& rank) { dpl::distributed_data_parallel<model> ddp(again, rank); });
}

TEST_CASE("DDP compares declared parameter shapes across ranks", "[host][ddp][diagnostics]") {
  std::mutex m;
  std::vector<std::string> seen;
  CHECK_THROWS(dpl::spawn(3, [&](dpl::rank_context& rank) {
    shaped mdl;
    mdl.shape = rank.rank() == 2 ? std::vector<std::size_t>{6, 4} : std::vector<std::size_t>{4, 6};
    try {
      dpl::distributed_data_parallel<shaped> ddp(mdl, rank);
    } catch (dpl::error const& e) {
      std::lock_guard lock(m);
      seen.emplace_back(e.what());
      throw;
    }
  }));
  REQUIRE(seen.size() == 3);  // raised on every rank
  for (auto const& s : seen)
    CHECK_THAT(s, Catch::Contains("rank 2 declares shape [6, 4] for parameter 0, expected rank 0's [4, 6]"));
  // Equal shapes construct.
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    shaped mdl;
    mdl.shape = {4, 6};
    dpl::distributed_data_parallel<shaped> ddp(mdl, rank);
  });
}

TEST_CASE("nested messages carry each prefix once", "[host][diagnostics]") {
  auto const data = test::dataset<float>::make(4, 4, 23, true);
  model m;
  dpl::data_parallel<model> dp(m, dpl::host::devices(2));
  try {
    dp.step(data.all(), [](model&, test::samples<float>) { throw dpl::invalid_argument("dparallel: bad shard"); });
    FAIL("expected an error");
  } catch (dpl::device_error const& e) {
    CHECK(std::string(e.what()) == "dparallel: on device 0: bad shard");
  }
  try {
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      model mdl;
      dpl::distributed_data_parallel<model> ddp(mdl, rank);
      ddp.step(data.all(), [&](model&, test::samples<float>) {
        if (rank.rank() == 1) throw dpl::invalid_argument("dparallel: bad shard");
        return 0.0F;
      });
    });
    FAIL("expected an error");
  } catch (dpl::comm_error const& e) {
    std::string const what = e.what();
    CHECK(count_of(what, "dparallel") == 1);
    CHECK(count_of(what, "rank 1") == 1);
    CHECK_THAT(what, Catch::Contains("on device 1: bad shard"));
  }
}

// The forms that take the model by non-const reference train the master (checked against one
// device); every form by value or by const& is rejected at compile time with the same message
// (tests/packaging/compile_fail/step_model_by_*), which takes_model_by_value() decides.
namespace {
using shard_t = test::samples<float>;
template <class F>
constexpr bool rejected = dpl::detail::takes_model_by_value<std::remove_cvref_t<F>, model, shard_t>();
template <class F>
constexpr bool accepted = !rejected<F> && dpl::detail::check_step_function<std::remove_cvref_t<F>, model, shard_t>();

auto const by_ref = [](model& m, shard_t s) { return m.forward_backward(s); };
auto const by_ref_generic_shard = [](model& m, auto s) { return m.forward_backward(s); };
auto const by_auto_ref = [](auto& m, auto s) { return m.forward_backward(s); };
auto const by_forwarding = [](auto&& m, auto s) { return m.forward_backward(s); };
auto const by_auto_ref_ctx = [](auto& m, auto s, auto& ctx) { return m.forward_backward(s) + 0 * static_cast<float>(ctx.replica()); };
auto const by_forwarding_ctx = [](auto&& m, auto const& s, dpl::step_context&) { return m.forward_backward(s); };
auto const by_ref_ctx = [](model& m, auto s, dpl::step_context const&) { return m.forward_backward(s); };
auto const by_auto_ref_mutable = [](auto& m, auto s) mutable { return m.forward_backward(s); };
}  // namespace

static_assert(accepted<decltype(by_ref)> && accepted<decltype(by_ref_generic_shard)> &&
              accepted<decltype(by_auto_ref)> && accepted<decltype(by_forwarding)> &&
              accepted<decltype(by_auto_ref_ctx)> && accepted<decltype(by_forwarding_ctx)> &&
              accepted<decltype(by_ref_ctx)> && accepted<decltype(by_auto_ref_mutable)>);
static_assert(rejected<decltype([](model m, shard_t s) { return m.forward_backward(s); })>);
static_assert(rejected<decltype([](model const& m, shard_t) { return m.b[0]; })>);
static_assert(rejected<decltype([](model m, auto s) { return m.forward_backward(s); })>);
static_assert(rejected<decltype([](model m, auto s, dpl::step_context&) { return m.forward_backward(s); })>);
static_assert(rejected<decltype([](model const& m, auto) { return m.b[0]; })>);
static_assert(rejected<decltype([](auto m, auto s) { return m.forward_backward(s); })>);
static_assert(rejected<decltype([](auto const m, auto) { return m.b[0]; })>);
static_assert(rejected<decltype([](auto const& m, auto) { return m.b[0]; })>);
static_assert(rejected<decltype([](auto m, auto s, auto& ctx) { return m.forward_backward(s) + 0 * static_cast<float>(ctx.replica()); })>);
static_assert(rejected<decltype([](auto const& m, auto, dpl::step_context&) { return m.b[0]; })>);
static_assert(rejected<decltype([](auto m, auto s) mutable { return m.forward_backward(s); })>);
static_assert(rejected<float (*)(model, shard_t)>);
static_assert(rejected<float(model const&, shard_t)>);
static_assert(!rejected<float (*)(model&, shard_t)>);

TEST_CASE("every step function that takes the model by reference trains the master as one device does",
          "[host][api]") {
  auto const data = test::dataset<float>::make(8, 4, 31, true);  // shards of 4: exact means
  model ref;
  (void)ref.forward_backward(data.all());
  auto const check = [&](auto const& fn) {
    model m;
    dpl::data_parallel<model> dp(m, dpl::host::devices(2));
    auto fn_copy = fn;
    (void)dp.step(data.all(), fn_copy);
    CHECK(m.gw == ref.gw);
    CHECK(m.gb == ref.gb);
  };
  check(by_ref);
  check(by_ref_generic_shard);
  check(by_auto_ref);
  check(by_forwarding);
  check(by_auto_ref_ctx);
  check(by_forwarding_ctx);
  check(by_ref_ctx);
  check(by_auto_ref_mutable);
}

// launch<Semantics>(world, fn): one training function, templated on the bundle, gives the
// one-device parameters as DataParallel, as DDP over thread ranks, as DDP over a given group, and
// with a mixed bundle (docs/training-loop.md).
#include "models.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/launch.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace dpl = dparallel;
using model = test::chunked<float>;

namespace {

constexpr std::size_t global_batch = 8;
constexpr float lr = 0.125F;

/// Rows `indices` of `d`, as a dataset of their own.
test::dataset<float> pick(test::dataset<float> const& d, std::vector<std::size_t> const& indices) {
  test::dataset<float> out{indices.size(), d.dim, {}, {}};
  for (std::size_t i : indices) {
    out.x.insert(out.x.end(), d.x.begin() + static_cast<std::ptrdiff_t>(i * d.dim),
                 d.x.begin() + static_cast<std::ptrdiff_t>((i + 1) * d.dim));
    out.y.push_back(d.y[i]);
  }
  return out;
}

/// The training function under test: the same source for every bundle.
template <class Semantics>
std::vector<double> train(dpl::world const& w, test::dataset<float> const& data, int epochs,
                          std::size_t max_steps = 1000) {
  std::vector<std::vector<double>> per_rank;
  std::mutex m;
  dpl::launch<Semantics>(w, [&](auto& s) {
    model mdl;
    auto par = s.wrap(mdl);
    auto plan = s.batches(data.n, {.global_batch = global_batch, .seed = 3});
    std::size_t steps = 0;
    for (int e = 0; e < epochs; ++e) {
      plan.set_epoch(static_cast<std::uint64_t>(e));
      for (std::size_t j = 0; j < plan.size() && steps < max_steps; ++j, ++steps) {
        auto const b = pick(data, plan[j]);
        par.step(b.all(), [](model& r, test::samples<float> shard) { return r.forward_backward(shard); });
        par.module().sgd(lr);
      }
    }
    std::lock_guard lock(m);
    per_rank.push_back(test::flat(par.module(), false));
  });
  for (auto const& r : per_rank) CHECK(r == per_rank.front());  // every DDP rank holds the same model
  return per_rank.front();
}

/// One device, no wrapper, the batches of `replicas` sampler replicas.
std::vector<double> one_device(test::dataset<float> const& data, int replicas, int epochs,
                               std::size_t max_steps = 1000) {
  model mdl;
  dpl::batch_plan plan(data.n, replicas, 0, replicas, {.global_batch = global_batch, .seed = 3});
  std::size_t steps = 0;
  for (int e = 0; e < epochs; ++e) {
    plan.set_epoch(static_cast<std::uint64_t>(e));
    for (std::size_t j = 0; j < plan.size() && steps < max_steps; ++j, ++steps) {
      mdl.forward_backward(pick(data, plan[j]).all());
      mdl.sgd(lr);
    }
  }
  return test::flat(mdl, false);
}

struct ddp_from_root_each_step : dpl::ddp {
  using replicate = dpl::policy::broadcast_each_step;
};

}  // namespace

TEST_CASE("launch: one training function trains the one-device model as dp, ddp and a mixed bundle",
          "[host][launch][contract]") {
  auto const data = test::dataset<float>::make(40, model().dim, 11, true);
  for (int n : {1, 2, 4}) {
    INFO("participants = " << n);
    auto const want = one_device(data, n, 2);
    auto const w = dpl::world::local(n);
    // Two epochs of SGD: the parameters leave the small integers, so the modes agree within
    // rounding (examples/train_generic shows the bitwise case with the MLP's pairwise sums).
    CHECK(test::rel_error(train<dpl::dp>(w, data, 2), want) <= 1e-5);
    CHECK(test::rel_error(train<dpl::ddp>(w, data, 2), want) <= 1e-5);
    CHECK(test::rel_error(train<ddp_from_root_each_step>(w, data, 2), want) <= 1e-5);
    CHECK(test::rel_error(train<dpl::dp_balanced>(w, data, 2), want) <= 1e-5);
    // One step on exact data: every sum is exact, so every mode gives the one-device bits.
    auto const first = one_device(data, n, 1, 1);
    model untrained;
    CHECK(first != test::flat(untrained, false));  // the step moved the parameters
    CHECK(train<dpl::dp>(w, data, 1, 1) == first);
    CHECK(train<dpl::ddp>(w, data, 1, 1) == first);
  }
}

TEST_CASE("launch: DDP over a given process group (world::of) and over listed devices", "[host][launch]") {
  auto const data = test::dataset<float>::make(32, model().dim, 12, false);
  auto const want = one_device(data, 2, 1);
  // Catch2's assertions are not thread-safe: the ranks record what they saw, the test thread checks.
  std::vector<std::vector<double>> got(2);
  std::vector<std::array<std::size_t, 4>> seen(2);  // rank, world size, replicas, samplers
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    dpl::launch<dpl::ddp>(dpl::world::of(rank), [&](auto& s) {
      model mdl;
      auto par = s.wrap(mdl);
      auto plan = s.batches(data.n, {.global_batch = global_batch, .seed = 3});
      seen[static_cast<std::size_t>(rank.rank())] = {static_cast<std::size_t>(s.rank()),
                                                      static_cast<std::size_t>(s.world_size()),
                                                      static_cast<std::size_t>(s.replicas()), plan.samplers().size()};
      for (std::size_t j = 0; j < plan.size(); ++j) {
        auto const b = pick(data, plan[j]);
        par.step(b.all(), [](model& r, test::samples<float> shard) { return r.forward_backward(shard); });
        par.module().sgd(lr);
      }
      got[static_cast<std::size_t>(s.rank())] = test::flat(mdl, false);
    });
  });
  for (std::size_t r = 0; r < 2; ++r) CHECK(seen[r] == std::array<std::size_t, 4>{r, 2, 2, 1});
  CHECK(got[0] == got[1]);
  CHECK(test::rel_error(got[0], want) <= 1e-6);

  auto const devs = std::vector<dpl::device>{{dpl::device_kind::host, 3}, {dpl::device_kind::host, 1}};
  std::vector<dpl::device> placed(2);
  dpl::launch<dpl::ddp>(dpl::world::on(devs), [&](auto& s) {
    model mdl;
    auto par = s.wrap(mdl);
    placed[static_cast<std::size_t>(s.rank())] = par.devices().front();
  });
  CHECK(placed == devs);
  dpl::launch<dpl::dp>(dpl::world::on(devs), [&](auto& s) {
    model mdl;
    auto par = s.wrap(mdl);
    CHECK(par.devices() == devs);
    CHECK(s.replicas() == 2);
    CHECK(s.world_size() == 1);
  });
}

TEST_CASE("launch: a batch plan covers the sampler replicas in order; DP's batch is every rank's", "[host][launch]") {
  for (bool drop_last : {false, true}) {
    dpl::batch_options const o{.global_batch = 6, .seed = 9, .drop_last = drop_last};
    dpl::batch_plan const all(23, 3, 0, 3, o);
    for (std::size_t j = 0; j < all.size(); ++j) {
      std::vector<std::size_t> joined;
      for (int r = 0; r < 3; ++r) {
        dpl::batch_plan const mine(23, 3, r, 1, o);
        REQUIRE(mine.size() == all.size());
        auto const part = mine[j];
        CHECK(part.size() <= 2);
        joined.insert(joined.end(), part.begin(), part.end());
      }
      CHECK(all[j] == joined);
    }
    std::set<std::size_t> seen;
    for (std::size_t j = 0; j < all.size(); ++j)
      for (std::size_t i : all[j]) seen.insert(i);
    CHECK(seen.size() == (drop_last ? 21U : 23U));
  }
  // The samplers' options pass through, the order among them.
  for (auto order : {dpl::shuffle_order::torch, dpl::shuffle_order::splitmix64}) {
    dpl::batch_plan plan(23, 1, 0, 1, {.global_batch = 23, .seed = 9, .order = order});
    plan.set_epoch(2);
    dpl::distributed_sampler s(23, 1, 0, {.seed = 9, .order = order});
    s.set_epoch(2);
    REQUIRE(plan.size() == 1);
    CHECK(plan[0] == s.indices());
  }
}

TEST_CASE("launch: misuse is reported with what to do", "[host][launch][diagnostics]") {
  CHECK_THROWS_WITH(dpl::world::local(0), Catch::Contains("at least one participant"));
  CHECK_THROWS_WITH(dpl::batch_plan(10, 3, 0, 3, {.global_batch = 8}), Catch::Contains("multiple of the 3 replicas"));
  std::vector<std::string> said(2);  // each rank's message; checked on the test thread
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    try {
      dpl::launch<dpl::dp>(dpl::world::of(rank), [](auto&) {});
    } catch (dpl::error const& e) {
      said[static_cast<std::size_t>(rank.rank())] = e.what();
    }
  });
  for (auto const& m : said)
    CHECK_THAT(m, Catch::Contains("DataParallel runs in one process") && Catch::Contains("use a DDP bundle"));
  CHECK_THROWS_WITH(dpl::launch<dpl::ddp>(dpl::world::local(2),
                                          [](auto& s) { (void)s.batches(8, {.global_batch = 4, .replicas = 3}); }),
                    Catch::Contains("world size 2"));
}

TEST_CASE("parallel accepts a rank_context wherever it accepts a process_group", "[host][launch]") {
  std::vector<std::array<int, 2>> seen(2);  // the wrapper's group rank and size, per rank
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model mdl;
    dpl::distributed_data_parallel<model> ddp(mdl, rank);
    seen[static_cast<std::size_t>(rank.rank())] = {ddp.group().rank(), ddp.group().size()};
  });
  CHECK(seen == std::vector<std::array<int, 2>>{{0, 2}, {1, 2}});
}

TEST_CASE("local_mean weights DataParallel's per-device losses by shard size", "[host][launch]") {
  auto const data = test::dataset<float>::make(7, model().dim, 13, true);
  model m;
  dpl::data_parallel<model> dp(m, dpl::host::devices(3));
  auto const out = dp.step(data.all(), [](model& r, test::samples<float> s) { return r.forward_backward(s); });
  model ref;
  double const want = ref.forward_backward(data.all());
  CHECK(dpl::local_mean(dp, out) == Approx(want).epsilon(1e-6));
}

TEST_CASE("a batch plan resumed from a saved position visits the batches of an uninterrupted run", "[host][launch][resume]") {
  for (int replicas : {1, 2, 3}) {
    INFO(replicas << " replicas");
    dpl::batch_options const o{.global_batch = 6, .seed = 9, .replicas = replicas};
    dpl::batch_plan whole(31, replicas, 0, replicas, o);
    std::vector<std::vector<std::size_t>> want, got;
    for (std::uint64_t e = 0; e < 3; ++e) {
      whole.set_epoch(e);
      for (std::size_t j = 0; j < whole.size(); ++j) want.push_back(whole[j]);
    }
    // Stopped after step 2 of epoch 1 (the position it saves), resumed in a fresh plan.
    whole.set_epoch(1);
    auto const saved = whole.position_after(2);
    for (std::uint64_t e = 0; e < 1; ++e) {
      dpl::batch_plan first(31, replicas, 0, replicas, o);
      first.set_epoch(e);
      for (std::size_t j = 0; j < first.size(); ++j) got.push_back(first[j]);
    }
    dpl::batch_plan before(31, replicas, 0, replicas, o);
    before.set_epoch(1);
    for (std::size_t j = 0; j <= 2; ++j) got.push_back(before[j]);
    dpl::batch_plan resumed(31, replicas, 0, replicas, o);
    for (std::uint64_t e = saved.epoch; e < 3; ++e) {
      std::size_t j = 0;
      if (e == saved.epoch) j = resumed.resume(saved);
      resumed.set_epoch(e);  // as a loop does at each epoch's top: keeps the resumed position
      for (; j < resumed.size(); ++j) got.push_back(resumed[j]);
    }
    CHECK(got == want);
    auto const last = whole.position_after(whole.size() - 1);  // the epoch's end: the next epoch's start
    CHECK((last.epoch == 2 && last.index == 0));
  }
  dpl::batch_plan plan(31, 2, 0, 2, {.global_batch = 6, .replicas = 2});
  CHECK_THROWS_WITH(plan.resume({0, 4, dpl::shuffle_order::torch}),
                    Catch::Contains("index 4 is not the start of a step of 3 samples per replica"));
}

TEST_CASE("global_mean is the loss over every rank's samples: DDP's equals DataParallel's", "[host][launch]") {
  auto const data = test::dataset<float>::make(9, model().dim, 13, true);
  model m;
  dpl::data_parallel<model> dp(m, dpl::host::devices(3));
  auto const out = dp.step(data.all(), [](model& r, test::samples<float> s) { return r.forward_backward(s); });
  double const want = dpl::global_mean(dp, out);
  CHECK(want == dpl::local_mean(dp, out));
  std::vector<double> got(3);
  dpl::spawn(3, [&](dpl::rank_context& ctx) {
    model mine;
    dpl::distributed_data_parallel<model> ddp(mine, ctx.group());
    auto const r = static_cast<std::size_t>(ctx.rank());
    auto const rank_out = ddp.step(dpl::slice_batch(data.all(), r * 3, r * 3 + 3),
                                   [](model& x, test::samples<float> s) { return x.forward_backward(s); });
    got[r] = dpl::global_mean(ddp, rank_out);
  });
  for (double g : got) CHECK(g == Approx(want).epsilon(1e-6));
  CHECK(got[0] == got[1]);  // every rank the same value
  CHECK(got[1] == got[2]);
}

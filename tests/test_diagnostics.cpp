// Diagnostics: the per-step profile of DP and DDP, the devices-differ warning, and the
// auto_balance scatter policy (shards sized by measured speed, same gradient as one device).
#include "models.hpp"

#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t gib = std::size_t{1} << 30;

/// The host backend, but describing its devices: device 1 has half device 0's memory.
struct uneven_backend : dp::host::backend {
  static dp::device_properties describe(dp::device d) {
    return {d.index == 0 ? 80 * gib : 40 * gib, 132, d.index == 0 ? "big" : "small"};
  }
};
/// The host backend describing identical devices.
struct even_backend : dp::host::backend {
  static dp::device_properties describe(dp::device) { return {80 * gib, 132, "same"}; }
};

/// Checks that hold for every profile: phases >= 0 that add up to at most the step (they cut it
/// into consecutive intervals), a compute time for each device that had a shard and none for the
/// others. Returns a description of the first violation (empty when none), for use on any thread.
std::string profile_violation(dp::step_profile const& p) {
  for (auto d : {p.data_wait, p.scatter, p.replicate, p.compute, p.reduce, p.gather, p.total})
    if (d < dp::profile_duration{}) return "a negative phase";
  if (p.phases() > p.total + dp::profile_duration(1e-6)) return "phases longer than the step";
  if (p.device_compute.size() != p.devices.size() || p.shard_sizes.size() != p.devices.size())
    return "not one entry per device";
  for (std::size_t i = 0; i < p.devices.size(); ++i) {
    if (p.shard_sizes[i] == 0 && p.device_compute[i] != dp::profile_duration{}) return "compute without a shard";
    if (p.shard_sizes[i] != 0 && p.device_compute[i] <= dp::profile_duration{}) return "no compute for a shard";
  }
  return {};
}

dp::step_profile synthetic(std::vector<std::size_t> shards, std::vector<double> seconds) {
  dp::step_profile p;
  p.devices = dp::host::devices(static_cast<int>(shards.size()));
  p.shard_sizes = std::move(shards);
  for (double s : seconds) p.device_compute.emplace_back(s);
  return p;
}

}  // namespace

TEST_CASE("the DP profile: phases, per-device compute, data wait, imbalance and the table", "[host][diagnostics]") {
  test::linreg<double> m;
  dp::data_parallel<test::linreg<double>> wrapped(m, dp::host::devices(2));
  auto const data = test::dataset<double>::make(16, 4, 3, false);
  auto slow_second = [](test::linreg<double>& r, test::samples<double> s, dp::step_context& ctx) {
    std::this_thread::sleep_for(ctx.replica() == 1 ? 40ms : 1ms);
    return r.forward_backward(s);
  };
  CHECK(wrapped.last_profile().total == dp::profile_duration{});  // nothing before the first step
  wrapped.note_data_wait(dp::profile_duration(0.25));
  wrapped.note_data_wait(125ms);  // several calls add up; any duration type
  wrapped.step(data.all(), slow_second);
  dp::step_profile const first = wrapped.last_profile();
  CHECK(profile_violation(first).empty());
  CHECK(first.data_wait == dp::profile_duration(0.375));
  CHECK(first.batch == 16);
  CHECK(first.shard_sizes == std::vector<std::size_t>{8, 8});
  CHECK(first.device_compute[1] >= dp::profile_duration(40ms));  // measured around the step function
  CHECK(first.device_compute[0] >= dp::profile_duration(1ms));
  CHECK(first.compute >= dp::profile_duration(40ms));
  CHECK(first.total >= dp::profile_duration(40ms));
  CHECK(first.imbalance().slowest == 1);
  CHECK(first.imbalance().ratio > 1.0);
  auto const table = dp::format_profile(first);
  CHECK_THAT(table, Catch::Contains("host:0") && Catch::Contains("host:1") && Catch::Contains("replicate") &&
                        Catch::Contains("reduce") && Catch::Contains("slowest host:1"));

  wrapped.step(data.all(), slow_second);
  CHECK(wrapped.last_profile().data_wait == dp::profile_duration{});  // consumed by the step after the note
  CHECK(profile_violation(wrapped.last_profile()).empty());

  // The summary: the mean of the recorded steps.
  CHECK(wrapped.profile().steps() == 2);
  auto const mean = wrapped.profile().mean();
  CHECK(mean.data_wait == dp::profile_duration(0.1875));
  CHECK(mean.device_compute[1] >= dp::profile_duration(40ms));
  CHECK(mean.shard_sizes == std::vector<std::size_t>{8, 8});
  CHECK(mean.imbalance().slowest == 1);
  CHECK_THAT(dp::format_profile(wrapped.profile()), Catch::Contains("mean of 2 steps") && Catch::Contains("host:1"));
  wrapped.reset_profile();
  CHECK(wrapped.profile().steps() == 0);

  // A step that throws records nothing.
  dp::step_profile const before = wrapped.last_profile();
  CHECK_THROWS(wrapped.step(data.all(), [](auto&, auto, dp::step_context& ctx) {
    if (ctx.replica() == 1) throw std::runtime_error("boom");
    return 0.0;
  }));
  CHECK(wrapped.last_profile().total == before.total);
  CHECK(wrapped.profile().steps() == 0);
}

TEST_CASE("the profile leaves out devices without a shard (B < N)", "[host][diagnostics]") {
  test::linreg<float> m;
  dp::data_parallel<test::linreg<float>> wrapped(m, dp::host::devices(4));
  auto const data = test::dataset<float>::make(2, 4, 5, true);
  wrapped.step(data.all(), [](auto& r, auto shard, dp::step_context& ctx) {
    std::this_thread::sleep_for(ctx.replica() == 0 ? 30ms : 1ms);
    return r.forward_backward(shard);
  });
  auto const& p = wrapped.last_profile();
  CHECK(profile_violation(p).empty());
  CHECK(p.shard_sizes == std::vector<std::size_t>{1, 1, 0, 0});
  CHECK(p.device_compute[2] == dp::profile_duration{});
  CHECK(p.imbalance().slowest == 0);
  CHECK(p.imbalance().ratio <= 2.0);  // max / mean over the two active devices (over all four: ~3.9)
  CHECK(p.imbalance().ratio > 1.0);
}

TEST_CASE("the DDP profile: one device per rank, reduce waits for the all-reduces", "[host][diagnostics][ddp]") {
  std::vector<dp::step_profile> got(2);
  std::vector<std::string> tables(2);
  dp::spawn(2, [&](dp::rank_context& rank) {
    test::chunked<double> model;
    dp::distributed_data_parallel<test::chunked<double>> ddp(model, rank.group());
    auto const data = test::dataset<double>::make(8, model.dim, 11 + static_cast<std::uint64_t>(rank.rank()), false);
    ddp.note_data_wait(std::chrono::milliseconds(rank.rank() + 1));  // 1 ms, 2 ms
    ddp.step(data.all(), [](test::chunked<double>& mm, test::samples<double> s, dp::step_context& ctx) {
      // Rank 1's step function starts only after rank 0 posted the broadcast of its buffers.
      if (ctx.rank() == 1) std::this_thread::sleep_for(40ms);
      return mm.forward_backward(s, &ctx);
    });
    auto const r = static_cast<std::size_t>(rank.rank());
    got[r] = ddp.last_profile();
    tables[r] = dp::format_profile(ddp.last_profile());
  });
  for (std::size_t r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(profile_violation(got[r]).empty());
    CHECK(got[r].rank == static_cast<int>(r));
    CHECK(got[r].world_size == 2);
    CHECK(got[r].devices == std::vector<dp::device>{dp::device{dp::device_kind::host, static_cast<int>(r)}});
    CHECK(got[r].shard_sizes == std::vector<std::size_t>{8});
    CHECK(got[r].data_wait == dp::profile_duration(std::chrono::milliseconds(static_cast<int>(r) + 1)));
    CHECK_THAT(tables[r], Catch::Contains("rank " + std::to_string(r) + " host:" + std::to_string(r)));
  }
  CHECK(got[1].device_compute[0] >= dp::profile_duration(40ms));
  // Rank 0 cannot finish its all-reduces before rank 1's gradients, 40 ms after rank 0 began.
  CHECK(got[0].total >= dp::profile_duration(40ms));
}

TEST_CASE("device_mismatch compares memory and multiprocessors with a 25% tolerance", "[diagnostics]") {
  auto const big = dp::device_properties{80 * gib, 132, "H100"};
  auto const fired = dp::device_mismatch({big, {40 * gib, 132, "A100-40"}});
  CHECK_THAT(fired, Catch::Contains("total memory") && Catch::Contains("80.0 GiB") && Catch::Contains("40.0 GiB") &&
                        Catch::Contains("device 1 (A100-40)"));
  CHECK(dp::device_mismatch({big, {79 * gib, 132, "almost"}}).empty());
  CHECK(dp::device_mismatch({big, {80 * gib, 66, "half"}}).find("multiprocessor") != std::string::npos);
  CHECK(dp::device_mismatch({big, {80 * gib, 108, "-18%"}}).empty());  // 132 / 108 = 1.22
  CHECK(dp::device_mismatch({big, {0, 0, "unknown"}}).empty());        // unknown values are ignored
  CHECK(dp::device_mismatch({big}).empty());
  CHECK(!dp::device_mismatch({big, big, {60 * gib, 132, ""}}).empty());  // 80 / 60 = 1.33
  CHECK(dp::device_mismatch({big, big, {60 * gib, 132, ""}}, 0.5).empty());
}

TEST_CASE("DP warns once through the sink when a backend describes devices that differ", "[host][diagnostics]") {
  std::vector<std::string> lines;
  dp::options opts;
  opts.warning_sink = [&](std::string_view l) { lines.emplace_back(l); };
  test::linreg<float> m;
  {
    dp::parallel<test::linreg<float>, dp::dp, uneven_backend> wrapped(m, dp::host::devices(2), opts);
    auto const data = test::dataset<float>::make(4, 4, 1, true);
    wrapped.step(data.all(), [](auto& r, auto s) { return r.forward_backward(s); });  // no warning per step
  }
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::Contains("device 0 (big)") && Catch::Contains("device 1 (small)"));
  lines.clear();
  { dp::parallel<test::linreg<float>, dp::dp, even_backend> alike(m, dp::host::devices(2), opts); }
  { dp::data_parallel<test::linreg<float>> host_only(m, dp::host::devices(2), opts); }  // no describe()
  { dp::parallel<test::linreg<float>, dp::dp, uneven_backend> one(m, dp::host::devices(1), opts); }
  CHECK(lines.empty());
  opts.warning_sink = nullptr;  // silenced
  { dp::parallel<test::linreg<float>, dp::dp, uneven_backend> quiet(m, dp::host::devices(2), opts); }
  CHECK(lines.empty());
}

TEST_CASE("auto_balance: even first, then proportional to measured speed", "[diagnostics][auto_balance]") {
  dp::policy::auto_balance p;
  dp::options const o;
  CHECK(p.shard_sizes(96, 2, o) == std::vector<std::size_t>{48, 48});
  CHECK(p.shard_sizes(7, 3, o) == std::vector<std::size_t>{3, 2, 2});
  p.observe(synthetic({64, 64}, {0.0625, 0.125}));  // device 1 at half speed
  CHECK(p.rates() == std::vector<double>{1024, 512});
  CHECK(p.shard_sizes(96, 2, o) == std::vector<std::size_t>{64, 32});
  p.observe(synthetic({64, 32}, {0.03125, 0.03125}));  // 2048 and 1024 now: averaged with smoothing 0.5
  CHECK(p.rates() == std::vector<double>{1536, 768});
  p.observe(synthetic({96, 0}, {0.01, 0.0}));  // a device without a shard keeps its rate
  CHECK(p.rates()[1] == 768);
  p.reset();
  CHECK(p.shard_sizes(96, 2, o) == std::vector<std::size_t>{48, 48});
  // Until every device is measured, the split stays even.
  p.observe(synthetic({2, 0, 0}, {0.001, 0, 0}));
  CHECK(p.shard_sizes(9, 3, o) == std::vector<std::size_t>{3, 3, 3});
  p.smoothing = 0;
  CHECK_THROWS_WITH(p.observe(synthetic({1, 1}, {1, 1})), Catch::Contains("smoothing in (0, 1]"));
}

TEST_CASE("auto_balance keeps a sample on every device unless it is hopeless", "[diagnostics][auto_balance]") {
  dp::options const o;
  {
    dp::policy::auto_balance p;
    p.observe(synthetic({1, 1}, {0.001, 1.0}));  // 1000 vs 1 sample/s: one sample takes longer than 96
    CHECK(p.shard_sizes(96, 2, o) == std::vector<std::size_t>{96, 0});
    CHECK(p.shard_sizes(2000, 2, o) == std::vector<std::size_t>{1998, 2});  // worth a share again
  }
  // Random speeds: shards sum to the batch, every device that is not hopeless has one.
  test::rng g{42};
  for (int trial = 0; trial < 2000; ++trial) {
    std::size_t const n = 2 + g.next() % 7, batch = n + g.next() % (3 * n);
    std::vector<double> seconds(n);
    for (auto& s : seconds) s = g.uniform() < 0.3 ? 0.001 : 0.001 + g.uniform() * (g.uniform() < 0.5 ? 0.05 : 1.0);
    dp::policy::auto_balance p;
    p.observe(synthetic(std::vector<std::size_t>(n, 1), seconds));
    auto const sizes = p.shard_sizes(batch, n, o);
    double total_rate = 0;
    for (double r : p.rates()) total_rate += r;
    std::size_t sum = 0;
    bool ok = sizes.size() == n;
    for (std::size_t i = 0; ok && i < n; ++i) {
      sum += sizes[i];
      bool const hopeless = p.rates()[i] * static_cast<double>(batch + 1) < total_rate;
      ok = hopeless ? sizes[i] == 0 : sizes[i] >= 1;
    }
    INFO("trial " << trial << ", devices " << n << ", batch " << batch);
    REQUIRE(ok);
    REQUIRE(sum == batch);
  }
}

TEST_CASE("auto_balance gives a half-speed device a third of the batch, and the one-device gradient",
          "[host][diagnostics][auto_balance]") {
  using T = double;
  constexpr std::size_t batch = 96;
  auto const data = test::dataset<T>::make(batch, 4, 77, false);
  test::linreg<T> master(4, 7);
  test::linreg<T> ref = master;  // the one-device reference: the gradient over the whole batch
  ref.forward_backward(data.all());
  dp::parallel<test::linreg<T>, dp::dp_balanced> wrapped(master, dp::host::devices(2));
  // Sleeping in proportion to the shard: device 1 takes twice device 0's time per sample, so the
  // balance has a fixed point at shares 2/3 and 1/3 (64 and 32 samples).
  auto slowed = [](test::linreg<T>& m, test::samples<T> s, dp::step_context& ctx) {
    auto const per_sample = ctx.replica() == 1 ? 500us : 250us;
    std::this_thread::sleep_for(per_sample * static_cast<int>(ctx.shard_size()));
    return m.forward_backward(s);
  };
  std::vector<std::size_t> second;
  for (int step = 0; step < 10; ++step) {
    wrapped.step(data.all(), slowed);
    second.push_back(wrapped.last_shard_sizes()[1]);
  }
  INFO("device 1's shards: " << Catch::Detail::stringify(second));
  CHECK(second[0] == batch / 2);  // the first step splits evenly
  double share = 0;
  for (std::size_t k = second.size() - 4; k < second.size(); ++k) share += static_cast<double>(second[k]) / batch;
  share /= 4;
  CHECK(share >= 0.25);
  CHECK(share <= 0.42);
  CHECK(test::rel_error(test::flat(master, true), test::flat(ref, true)) <= 1e-6);
  CHECK(wrapped.scatterer().rates().size() == 2);
}

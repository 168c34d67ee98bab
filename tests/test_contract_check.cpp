// The contract-checking mode (options::check_contracts, DPARALLEL_CHECK_CONTRACTS): each mistake
// it exists for is made, and its message checked; a correct step gives the same bits with the
// mode on as with it off.
#include "models.hpp"
#include "rank_threads.hpp"

#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace dpl = dparallel;

namespace {

/// A model that names its parameters. Its gradients are reached through a pointer member, so a
/// test can make a replica's gradient point at another's memory.
struct named {
  std::vector<float> w = std::vector<float>(6, 1.0f), b = std::vector<float>(10, 0.5f);
  std::vector<float> gw = std::vector<float>(6), gb = std::vector<float>(10);
  float* gb_at = nullptr;  // where gradients() says gb lies (null: gb itself)
  named() = default;
  named(named const& o) : w(o.w), b(o.b), gw(o.gw), gb(o.gb) {}  // a replica owns its storage
  named& operator=(named const&) = delete;
  static auto parameter_names() { return std::array{"fc2.weight", "fc2.bias"}; }
  auto parameters() { return std::array{dpl::view(w), dpl::view(b)}; }
  auto gradients() {
    return std::array{dpl::view(gw), dpl::tensor_view<float>(gb_at != nullptr ? gb_at : gb.data(), gb.size())};
  }
  /// The gradient of a made-up loss over the shard; bias elements [0, bias_end) only.
  void backward(test::samples<float> const& s, std::size_t bias_end = 10) {
    auto g = gradients();
    float sum = 0;
    for (std::size_t i = 0; i < s.x.size(); ++i) sum += s.x[i];
    float const mean = sum / static_cast<float>(s.x.rows());
    for (std::size_t k = 0; k < gw.size(); ++k) g[0][k] = mean * static_cast<float>(k + 1) * w[k];
    for (std::size_t k = 0; k < bias_end; ++k) g[1][k] = mean - b[k] + static_cast<float>(k);
  }
};

dpl::options checked() { return {.check_contracts = true}; }

test::dataset<float> data(std::size_t n = 8) { return test::dataset<float>::make(n, 1, 7, true); }

std::string message_of(std::exception_ptr const& e) {
  try {
    if (e) std::rethrow_exception(e);
  } catch (std::exception const& ex) {
    return ex.what();
  }
  return "";
}

// Catch's Contains over a list: every part must be in `what`.
bool contains_all(std::string const& what, std::vector<std::string> const& parts) {
  for (auto const& p : parts)
    if (what.find(p) == std::string::npos) return false;
  return true;
}

}  // namespace

TEST_CASE("contract check: a step that trains a copy of the model (as a by-value model does) is named",
          "[host][contract_check]") {
  named m;
  dpl::data_parallel<named> dp(m, dpl::host::devices(2), checked());
  auto const d = data();
  // The mistake a by-value model parameter makes, spelt so that no compile-time check sees it.
  auto copy_trains = [](named& r, test::samples<float> s) {
    named copy(r);
    copy.backward(s);
  };
  // Zeroed gradients (as made, or as the user zeroes them) may be added into: writing none of them
  // is the error.
  CHECK_THROWS_WITH(dp.step(d.all(), copy_trains),
                    Catch::Contains("the step function wrote none of the gradients of the replica on device host:") &&
                        Catch::Contains("Model&"));
  // The wrapper stays usable: a correct step runs, and leaves gradients that are not zero.
  auto const good = [](named& r, test::samples<float> s) { r.backward(s); };
  CHECK_NOTHROW(dp.step(d.all(), good));
  // Gradients that are not zero must be overwritten: every element left is named.
  CHECK_THROWS_WITH(dp.step(d.all(), copy_trains),
                    Catch::Contains("the step function did not write gradient `fc2.bias` elements 0..9 (10 of 10") &&
                        Catch::Contains("on device host:0") && Catch::Contains("Model&"));
}

TEST_CASE("contract check: a partial write names the gradient, the elements and the device", "[host][contract_check]") {
  named m;
  dpl::data_parallel<named> dp(m, dpl::host::devices(2), checked());
  auto const d = data();
  auto const good = [](named& r, test::samples<float> s) { r.backward(s); };
  dp.step(d.all(), good);  // the master's gradients are not zero from here on
  auto partial_on_0 = [](named& r, test::samples<float> s, dpl::step_context& ctx) {
    r.backward(s, ctx.replica() == 0 ? 5 : 10);
  };
  CHECK_THROWS_WITH(dp.step(d.all(), partial_on_0),
                    Catch::Contains("did not write gradient `fc2.bias` elements 5..9 (5 of 10") &&
                        Catch::Contains("on device host:0"));
  // Gaps: several ranges.
  auto holes = [](named& r, test::samples<float> s) {
    r.backward(s, 0);
    auto g = r.gradients();
    for (std::size_t k : {0u, 2u, 3u, 6u, 7u, 8u}) g[1][k] = 1.0f;  // not 1, 4..5, 9
  };
  CHECK_THROWS_WITH(dp.step(d.all(), holes),
                    Catch::Contains("did not write gradient `fc2.bias` elements 1, 4..5, 9 (4 of 10"));
  // Adding into a gradient that was not zeroed keeps the pattern too (it would pile up).
  auto adds = [](named& r, test::samples<float> s) {
    r.backward(s, 0);
    for (auto& v : r.gb) v += 1.0f;
  };
  CHECK_THROWS_WITH(dp.step(d.all(), adds), Catch::Contains("did not write gradient `fc2.bias` elements 0..9"));
}

TEST_CASE("contract check: DataParallel replicas sharing gradient memory are caught before the step function",
          "[host][contract_check]") {
  named m;
  dpl::data_parallel<named> dp(m, dpl::host::devices(2), checked());
  auto const d = data();
  auto const good = [](named& r, test::samples<float> s) { r.backward(s); };
  dp.step(d.all(), good);
  dp.replica(1).gb_at = m.gb.data();  // the replica's bias gradient is now the master's
  CHECK_THROWS_WITH(dp.step(d.all(), good),
                    Catch::Contains("gradient `fc2.bias` on host:1 shares memory with gradient `fc2.bias` on host:0"));
  dp.replica(1).gb_at = nullptr;
  CHECK_NOTHROW(dp.step(d.all(), good));
}

TEST_CASE("contract check: adding into zeroed gradients is the contract too, and gives the same bits",
          "[host][contract_check]") {
  auto const d = data();
  auto const run = [&](bool on, bool add) {
    auto groups = dpl::host::make_group(2);
    std::vector<std::vector<float>> out(2);
    test::rethrow_first(test::on_ranks(groups, [&](int r, dpl::process_group& g) {
      named m;
      dpl::distributed_data_parallel<named> ddp(m, g, {.check_contracts = on});
      auto const mine = dpl::slice_batch(d.all(), static_cast<std::size_t>(r) * 4, static_cast<std::size_t>(r) * 4 + 4);
      for (int step = 0; step < 3; ++step) {
        std::fill(m.gw.begin(), m.gw.end(), 0.0f);  // PyTorch's zero_grad()
        std::fill(m.gb.begin(), m.gb.end(), 0.0f);
        ddp.step(mine, [add](named& rep, test::samples<float> s) {
          if (!add) return rep.backward(s);
          named fresh(rep);
          fresh.backward(s, 7);  // the bias's last elements get no gradient: they stay zero
          for (std::size_t k = 0; k < rep.gw.size(); ++k) rep.gw[k] += fresh.gw[k];
          for (std::size_t k = 0; k < 7; ++k) rep.gb[k] += fresh.gb[k];
        });
      }
      out[static_cast<std::size_t>(r)] = m.gb;
    }));
    return out;
  };
  auto const on = run(true, true);
  CHECK(on == run(false, true));
  CHECK(on[0][9] == 0.0f);
  CHECK_FALSE(std::signbit(on[0][9]));  // set back to +0.0
}

TEST_CASE("contract check: a correct step gives the bits of the mode off, DP and DDP, no_sync and unused parameters",
          "[host][contract_check]") {
  auto const d = data(12);
  auto const run_dp = [&](bool on) {
    named m;
    dpl::data_parallel<named> dp(m, dpl::host::devices(3), {.check_contracts = on});
    for (int k = 0; k < 2; ++k) dp.step(d.all(), [](named& r, test::samples<float> s) { r.backward(s); });
    return std::vector<float>(m.gb.begin(), m.gb.end());
  };
  CHECK(run_dp(true) == run_dp(false));

  // DDP with grad_ready, gradient accumulation and a parameter never marked (find_unused_parameters).
  auto const run_ddp = [&](bool on) {
    auto groups = dpl::host::make_group(2);
    std::vector<std::vector<float>> out(2);
    test::rethrow_first(test::on_ranks(groups, [&](int r, dpl::process_group& g) {
      named m;
      dpl::distributed_data_parallel<named> ddp(
          m, g, {.find_unused_parameters = true, .check_contracts = on});
      auto const mine = dpl::slice_batch(d.all(), static_cast<std::size_t>(r) * 6, static_cast<std::size_t>(r) * 6 + 6);
      auto const weight_only = [](named& rep, test::samples<float> s, dpl::step_context& ctx) {
        rep.backward(s, 0);
        ctx.grad_ready(0);  // the bias is unused this step
      };
      {
        auto scope = ddp.no_sync();
        ddp.step(dpl::slice_batch(mine, 0, 3), weight_only);
      }
      ddp.step(dpl::slice_batch(mine, 3, 6), weight_only);
      ddp.step(mine, [](named& rep, test::samples<float> s) { rep.backward(s); });
      out[static_cast<std::size_t>(r)] = m.gw;
      out[static_cast<std::size_t>(r)].insert(out[static_cast<std::size_t>(r)].end(), m.gb.begin(), m.gb.end());
    }));
    return out;
  };
  auto const on = run_ddp(true), off = run_ddp(false);
  CHECK(on == off);
  CHECK(on[0] == on[1]);
}

TEST_CASE("contract check: DDP names the rank, and checks a gradient when it is marked ready", "[host][contract_check]") {
  auto const d = data();
  auto const fail_on_rank_1 = [&](auto fn) {
    auto groups = dpl::host::make_group(2);
    auto errors = test::on_ranks(groups, [&](int r, dpl::process_group& g) {
      named m;
      dpl::distributed_data_parallel<named> ddp(m, g, checked());
      auto const mine = dpl::slice_batch(d.all(), static_cast<std::size_t>(r) * 4, static_cast<std::size_t>(r) * 4 + 4);
      ddp.step(mine, [](named& rep, test::samples<float> s) { rep.backward(s); });  // gradients not zero from here on
      ddp.step(mine, fn);
    });
    CHECK(errors[0] != nullptr);  // the failing rank aborts the group
    return message_of(errors[1]);
  };
  // A partial write on rank 1, found when the step function returns.
  auto const what = fail_on_rank_1([](named& r, test::samples<float> s, dpl::step_context& ctx) {
    r.backward(s, ctx.rank() == 1 ? 7 : 10);
  });
  CHECK(contains_all(what, {"did not write gradient `fc2.bias` elements 7..9 (3 of 10", "on rank 1"}));
  // Marked ready before it was written: found at grad_ready, before its bucket is reduced (the
  // write that follows would hide it from a check at the end).
  auto const early = fail_on_rank_1([](named& r, test::samples<float> s, dpl::step_context& ctx) {
    r.backward(s, ctx.rank() == 1 ? 0 : 10);
    ctx.grad_ready(1);
    r.backward(s);
    ctx.grad_ready(0);
  });
  CHECK(contains_all(early, {"did not write gradient `fc2.bias` elements 0..9 (10 of 10", "on rank 1"}));
}

TEST_CASE("contract check: DPARALLEL_CHECK_CONTRACTS decides when the option is left empty", "[host][contract_check]") {
  char const* before = std::getenv("DPARALLEL_CHECK_CONTRACTS");
  std::string const saved = before != nullptr ? before : "";
  auto const d = data();
  auto const copy_trains = [](named& r, test::samples<float> s) {
    named copy(r);
    copy.backward(s);
  };
  auto const fails = [&](dpl::options o = {}) {
    named m;
    dpl::data_parallel<named> dp(m, dpl::host::devices(2), o);
    try {
      dp.step(d.all(), copy_trains);
    } catch (dpl::error const& e) {
      return std::string(e.what()).find("DPARALLEL_CHECK_CONTRACTS") != std::string::npos;
    }
    return false;
  };
  ::setenv("DPARALLEL_CHECK_CONTRACTS", "1", 1);
  CHECK(fails());  // options::check_contracts left empty: the variable decides
  CHECK_FALSE(fails({.check_contracts = false}));  // an explicit value wins
  ::setenv("DPARALLEL_CHECK_CONTRACTS", "0", 1);
  CHECK_FALSE(fails());
  ::unsetenv("DPARALLEL_CHECK_CONTRACTS");
  CHECK_FALSE(fails());
  CHECK(fails({.check_contracts = true}));
  if (before != nullptr) ::setenv("DPARALLEL_CHECK_CONTRACTS", saved.c_str(), 1);
}

TEST_CASE("a rank that never builds its DDP wrapper is reported as the constructor's failure", "[host][contract_check]") {
  auto groups = dpl::host::make_group(2, std::chrono::milliseconds(300));
  auto errors = test::on_ranks(
      groups,
      [&](int, dpl::process_group& g) {
        named m;
        dpl::distributed_data_parallel<named> ddp(m, g);
      },
      {0});  // rank 1 never builds its wrapper
  REQUIRE(errors[0] != nullptr);
  try {
    std::rethrow_exception(errors[0]);
  } catch (dpl::timeout_error const& e) {  // the type the collective raised
    CHECK(e.rank() == 1);
    CHECK(contains_all(e.what(), {"DDP's constructor (distributed_data_parallel(model, group)) on rank 0 failed",
                                  "every rank must construct its DDP wrapper", "rank 1"}));
  }
}

TEST_CASE("under desync detection DDP warns once about different batch sizes and fails on different sampler epochs",
          "[host][contract_check][desync]") {
  auto const d = data(16);
  auto const good = [](named& r, test::samples<float> s) { r.backward(s); };
  auto const batches = [&](bool detect) {
    auto groups = dpl::host::make_group(2);
    std::mutex m;
    std::vector<std::string> lines;
    test::rethrow_first(test::on_ranks(groups, [&](int r, dpl::process_group& g) {
      named model;
      dpl::options o;
      o.warning_sink = [&](std::string_view line) {
        std::lock_guard held(m);
        lines.emplace_back(line);
      };
      dpl::distributed_data_parallel<named> ddp(model, detect ? dpl::with_desync_detection(g) : g, o);
      std::size_t const n = r == 0 ? 4 : 2;
      for (int step = 0; step < 3; ++step) ddp.step(dpl::slice_batch(d.all(), 0, n), good);
    }));
    return lines;
  };
  auto const warned = batches(true);
  REQUIRE(warned.size() == 2);  // once per rank, not once per step
  CHECK(contains_all(warned[0], {"the ranks feed different batch sizes (rank 0: 4 samples, rank 1: 2 samples)",
                                 "average_mode::samples"}));
  CHECK(batches(false).empty());  // the check belongs to desync detection

  auto groups = dpl::host::make_group(2);
  auto errors = test::on_ranks(groups, [&](int r, dpl::process_group& g) {
    dpl::distributed_sampler sampler(16, 2, r);
    named model;
    dpl::distributed_data_parallel<named> ddp(model, dpl::with_desync_detection(g));
    for (std::uint64_t epoch = 0; epoch < 2; ++epoch) {
      if (r == 0) sampler.set_epoch(epoch);  // rank 1 forgets
      ddp.step(dpl::slice_batch(d.all(), 0, 4), good);
    }
  });
  for (auto const& e : errors)
    CHECK(contains_all(message_of(e), {"the ranks' samplers are on different epochs (rank 0: epoch 1, rank 1: epoch 0)",
                                       "set_epoch"}));
}

TEST_CASE("a gradient that does not match its parameter is named by parameter_names()", "[host][contract_check]") {
  struct ragged_named : named {
    std::vector<float> short_gb = std::vector<float>(9);
    auto gradients() { return std::array{dpl::view(gw), dpl::view(short_gb)}; }
  };
  ragged_named m;
  CHECK_THROWS_WITH(dpl::data_parallel<ragged_named>(m, dpl::host::devices(2)),
                    Catch::Contains("gradient `fc2.bias` does not match its parameter: expected 10 elements of F32, "
                                    "found 9"));
}

TEST_CASE("DDP's grad_ready errors name the parameters by parameter_names()", "[host][contract_check]") {
  auto const d = data();
  auto groups = dpl::host::make_group(2);
  auto errors = test::on_ranks(groups, [&](int r, dpl::process_group& g) {
    named m;
    dpl::distributed_data_parallel<named> ddp(m, g, {.check_contracts = false});
    ddp.step(dpl::slice_batch(d.all(), static_cast<std::size_t>(r) * 4, static_cast<std::size_t>(r) * 4 + 4),
             [](named& rep, test::samples<float> s, dpl::step_context& ctx) {
               rep.backward(s);
               ctx.grad_ready(0);  // never the bias
             });
  });
  bool named_it = false;
  for (auto const& e : errors) named_it = named_it || message_of(e).find("never for parameter(s) `fc2.bias`") != std::string::npos;
  CHECK(named_it);
}

TEST_CASE("construction errors name the parameters by parameter_names()", "[host][contract_check]") {
  // DP: a replica whose gradient lies in the master's memory (its copy keeps the master's pointer).
  struct shares_bias : named {
    shares_bias() = default;
    shares_bias(shares_bias const& o) : named(o) { gb_at = o.gb_at != nullptr ? o.gb_at : const_cast<float*>(o.gb.data()); }
  };
  shares_bias master;
  CHECK_THROWS_WITH(dpl::data_parallel<shares_bias>(master, dpl::host::devices(2)),
                    Catch::Contains("the replica for host:1: gradient `fc2.bias` shares storage with the master's "
                                    "gradient `fc2.bias`"));
  // DDP: ranks that declare different shapes for one parameter.
  struct shaped_named : named {
    std::vector<std::size_t> bias_shape{10};
    auto parameter_shapes() const { return std::vector<std::vector<std::size_t>>{{6}, bias_shape}; }
  };
  auto groups = dpl::host::make_group(2);
  auto errors = test::on_ranks(groups, [&](int r, dpl::process_group& g) {
    shaped_named m;
    if (r == 1) m.bias_shape = {2, 5};
    dpl::distributed_data_parallel<shaped_named> ddp(m, g);
  });
  for (auto const& e : errors)
    CHECK_THAT(message_of(e), Catch::Contains("rank 1 declares shape [2, 5] for parameter `fc2.bias`, expected rank "
                                              "0's [10]"));
  // DDP: two thread ranks wrapping one model object.
  named one;
  try {
    dpl::spawn(2, [&](dpl::rank_context& rank) { dpl::distributed_data_parallel<named> ddp(one, rank); });
    FAIL("expected an error");
  } catch (dpl::error const& e) {
    CHECK_THAT(e.what(), Catch::Contains("parameter `fc2.weight` shares memory with a parameter of the model that rank"));
  }
}

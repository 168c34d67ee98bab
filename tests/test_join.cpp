// Join for uneven inputs, sample-weighted averaging and buffer averaging (policy/join.hpp), on
// thread ranks, as equalities: against one device over the samples actually seen, against the
// default path's bits, against a serial mean, against a rank that trains alone.
#include "hook_models.hpp"
#include "join_run.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/policy/compress_hooks.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace dpl = dparallel;
using namespace test::join;

namespace {

std::vector<uneven_result> run_threads(uneven_plan const& p, dpl::options const& opts, bool overlap) {
  std::vector<uneven_result> out(p.steps.size());
  dpl::spawn(static_cast<int>(p.steps.size()), [&](dpl::rank_context& rank) {
    out[static_cast<std::size_t>(rank.rank())] = train_uneven(rank.group(), p, opts, overlap);
  });
  return out;
}

dpl::options uneven(dpl::average_mode mode, bool tiny) {
  dpl::options o;
  if (tiny) {
    o.bucket_cap_mb = 8.0 / (1024 * 1024);
    o.first_bucket_cap_mb = 4.0 / (1024 * 1024);
  }
  o.uneven_inputs = true;
  o.average = mode;
  return o;
}

}  // namespace

// The tolerance: each rank's gradient is its own mean (a sum over its samples times 1/n_r),
// scaled by world * n_r / N and averaged (summed in rank order, times 1/world), where one device
// sums all N samples at once and multiplies by 1/N: the same value, rounded differently (float).
TEST_CASE("join: ranks with 5, 3 and 0 extra steps and sample weighting equal one device on the union",
          "[host][ddp][join]") {
  uneven_plan const p{{7, 5, 2}, {4, 6, 3}};
  auto const want = train_union(p);
  for (bool overlap : {false, true}) {
    for (bool tiny : {false, true}) {
      INFO("grad_ready overlap " << overlap << ", many buckets " << tiny);
      auto const got = run_threads(p, uneven(dpl::average_mode::samples, tiny), overlap);
      for (std::size_t r = 0; r < got.size(); ++r) {
        REQUIRE(got[r].grads.size() == static_cast<std::size_t>(p.steps[r]));
        for (std::size_t k = 0; k < got[r].grads.size(); ++k) {
          INFO("rank " << r << ", step " << k);
          CHECK(test::rel_error(got[r].grads[k], want.grads[k]) <= 1e-5);
          CHECK(got[r].grads[k] == got[0].grads[k]);  // bitwise the same on every rank still stepping
        }
        CHECK(got[r].params == got[0].params);  // join() ends with the last stepping rank's on every rank
      }
      CHECK(test::rel_error(got[0].params, want.params) <= 1e-5);
    }
  }
}

TEST_CASE("join: equal batches averaged over the ranks still stepping equal one device on the union",
          "[host][ddp][join]") {
  uneven_plan const p{{6, 3, 1, 4}, {4, 4, 4, 4}};
  auto const want = train_union(p);
  auto const got = run_threads(p, uneven(dpl::average_mode::ranks, false), true);
  for (std::size_t r = 0; r < got.size(); ++r) {
    for (std::size_t k = 0; k < got[r].grads.size(); ++k) CHECK(test::rel_error(got[r].grads[k], want.grads[k]) <= 1e-5);
    CHECK(got[r].params == got[0].params);
  }
}

TEST_CASE("join: with even inputs, uneven_inputs and sample weighting leave the default path's bits",
          "[host][ddp][join][contract]") {
  uneven_plan const p{{4, 4, 4}, {5, 5, 5}};
  dpl::options plain;
  plain.bucket_cap_mb = 8.0 / (1024 * 1024);
  plain.first_bucket_cap_mb = 4.0 / (1024 * 1024);
  auto const base = run_threads(p, plain, true);
  for (auto mode : {dpl::average_mode::ranks, dpl::average_mode::samples}) {
    auto const got = run_threads(p, uneven(mode, true), true);
    for (std::size_t r = 0; r < got.size(); ++r) {
      CHECK(got[r].grads == base[r].grads);
      CHECK(got[r].params == base[r].params);
    }
  }
}

TEST_CASE("join: average_buffers gives every rank the serial mean of the ranks' buffers", "[host][ddp][join]") {
  // chunked's buffer counts the samples a replica saw: after each step, rank r's is the mean
  // before the step plus n_r; averaged, the rank-order sum times 1/world (host kernels' order).
  int const world = 3;
  std::vector<std::size_t> const batch{2, 5, 4};
  std::vector<std::vector<float>> got(world);
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    model m;
    dpl::distributed_data_parallel<model> ddp(m, rank.group(), dpl::options{.average_buffers = true});
    auto const r = static_cast<std::size_t>(rank.rank());
    for (int k = 0; k < 3; ++k) {
      auto const d = test::dataset<float>::make(5, m.dim, static_cast<std::uint64_t>(k), false);
      ddp.step(dpl::slice_batch(d.all(), 0, batch[r]), [](model& x, test::samples<float> s) { x.forward_backward(s); });
      got[r].push_back(m.stats[0]);
    }
  });
  float mean = 0;
  for (int k = 0; k < 3; ++k) {
    float sum = 0;
    for (int r = 0; r < world; ++r) sum += mean + static_cast<float>(batch[static_cast<std::size_t>(r)]);
    mean = sum * (1.0f / static_cast<float>(world));
    for (int r = 0; r < world; ++r) CHECK(got[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)] == mean);
  }
}

TEST_CASE("join: averaged buffers count only the ranks still stepping, and join() leaves them identical",
          "[host][ddp][join]") {
  uneven_plan const p{{3, 1}, {2, 2}};
  auto o = uneven(dpl::average_mode::samples, false);
  o.average_buffers = true;
  auto const got = run_threads(p, o, false);
  // Step 0: both ranks saw 2 samples; steps 1 and 2: rank 0 alone (weight 2, rank 1 zeros).
  CHECK(got[0].stats[0] == 2.0f + 2.0f + 2.0f);
  CHECK(got[1].stats == got[0].stats);
}

namespace {

using test::hooks::pull_model;

// Rank 0 alone in a group of `world`: pairs of steps, the first under no_sync; rank 1.. join at
// once. The gradient after each synchronised step.
std::vector<std::vector<float>> alone(int world, dpl::average_mode mode, bool view, bool overlap, bool hook) {
  std::vector<std::vector<float>> out;
  dpl::options o = test::hooks::small_buckets();
  o.gradient_as_bucket_view = view;
  o.uneven_inputs = true;
  o.average = mode;
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    pull_model m;
    dpl::distributed_data_parallel<pull_model> ddp(m, rank.group(), o);
    if (hook) ddp.reducer().register_comm_hook(dpl::compress_state{}, dpl::bf16_compress);
    if (rank.rank() != 0) {
      ddp.join();
      return;
    }
    auto fn = [&](pull_model& x, test::samples<float> s, dpl::step_context& ctx) {
      x.forward_backward(s, overlap ? &ctx : nullptr);
    };
    for (int k = 0; k < 3; ++k) {
      auto const a = test::dataset<float>::make(3 + static_cast<std::size_t>(k), m.dim, static_cast<std::uint64_t>(50 + k), false);
      auto const b = test::dataset<float>::make(4, m.dim, static_cast<std::uint64_t>(60 + k), false);
      {
        auto scope = ddp.no_sync();
        ddp.step(a.all(), fn);
      }
      ddp.step(b.all(), fn);
      out.push_back(m.g);
      m.sgd(0.01f);
    }
    ddp.join();
  });
  return out;
}

}  // namespace

// Rank 0's weight is world/1 (its samples are all the samples): the joined ranks' zeros, summed
// and times 1/world, give back rank 0's own gradient exactly (powers of two), through the
// bf16_compress hook too (bf16 rounding commutes with a power-of-two factor).
TEST_CASE("join: a rank alone under no_sync gets the bits it gets alone, joined ranks sending zeros (hooks too)",
          "[host][ddp][join]") {
  for (auto mode : {dpl::average_mode::ranks, dpl::average_mode::samples}) {
    for (bool view : {false, true}) {
      for (bool overlap : {false, true}) {
        for (bool hook : {false, true}) {
          INFO("samples " << (mode == dpl::average_mode::samples) << ", view " << view << ", overlap " << overlap
                          << ", bf16 hook " << hook);
          auto const one = alone(1, mode, view, overlap, hook);
          CHECK(alone(2, mode, view, overlap, hook) == one);
          CHECK(alone(4, mode, view, overlap, hook) == one);
        }
      }
    }
  }
}

TEST_CASE("join: refused where it makes no sense, with a message that says what to do", "[host][ddp][join]") {
  // Catch2's assertions are not thread-safe: each rank records its error, the test thread checks.
  std::vector<std::string> join_errors(2), zero_errors(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model m;
    dpl::distributed_data_parallel<model> ddp(m, rank.group());
    try {
      ddp.join();
    } catch (dpl::error const& e) {
      join_errors[static_cast<std::size_t>(rank.rank())] = e.what();
    }
  });
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model m;
    try {
      dpl::parallel<model, dpl::ddp_zero1> w(m, rank.group(), dpl::options{.uneven_inputs = true});
    } catch (dpl::error const& e) {
      zero_errors[static_cast<std::size_t>(rank.rank())] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK_THAT(join_errors[static_cast<std::size_t>(r)], Catch::Contains("expected options::uneven_inputs = true"));
    CHECK_THAT(zero_errors[static_cast<std::size_t>(r)], Catch::Contains("work with the all-reduce reducer"));
  }
}

// ZeRO stage 1 (ddp_zero1 + zero_redundancy_optimizer) on thread ranks: the parameters are
// bitwise DDP's with the same update rule (also over bf16/f16 parameters with F32 master shards),
// each rank holds 1/N of the optimizer state, and bad input fails with errors that say what to do.
#include "test_zero_common.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dpl = dparallel;
using model = test::chunked<float>;

namespace {

template <class Rule = test::adam_like>
std::vector<test::zero_run> run_all(int world, bool zero, bool hook, bool tiny, Rule rule = {}) {
  std::vector<test::zero_run> out(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    out[static_cast<std::size_t>(rank.rank())] = test::train_zero_or_ddp(rank.group(), zero, hook, tiny, rule);
  });
  return out;
}

/// Runs `fn(rank)` on `world` thread ranks and returns what each rank's exception said ("" when
/// it threw nothing); Catch2 assertions stay on the test thread.
template <class F>
std::vector<std::string> errors_of(int world, F fn) {
  std::vector<std::string> seen(static_cast<std::size_t>(world));
  std::mutex mu;
  try {
    dpl::spawn(world, [&](dpl::rank_context& rank) {
      try {
        fn(rank);
      } catch (std::exception const& e) {
        std::lock_guard lock(mu);
        seen[static_cast<std::size_t>(rank.rank())] = e.what();
        throw;
      }
    });
  } catch (std::exception const&) {  // NOLINT(bugprone-empty-catch): each rank's message is checked
  }
  return seen;
}

/// Half `k` (0 or 1) of rank `rank`'s 8 samples of `d`.
test::samples<float> half_of_rank(test::dataset<float> const& d, int rank, std::size_t k) {
  std::size_t const lo = static_cast<std::size_t>(rank) * 8 + 4 * k;
  return dpl::slice_batch(d.all(), lo, lo + 4);
}

auto const plain_step = [](model& r, test::samples<float> s) { return r.forward_backward(s); };

}  // namespace

TEST_CASE("ZeRO-1 over N ranks gives bitwise the parameters of DDP with the same rule after 20 steps",
          "[host][zero][contract]") {
  for (int world = 1; world <= 4; ++world) {
    for (bool tiny : {false, true}) {
      for (bool hook : {false, true}) {
        INFO("world " << world << ", tiny buckets " << tiny << ", grad_ready " << hook);
        auto const ddp = run_all(world, false, hook, tiny);
        auto const zero = run_all(world, true, hook, tiny);
        for (int r = 0; r < world; ++r) {
          auto const& z = zero[static_cast<std::size_t>(r)];
          CHECK(z.params == ddp[0].params);  // bitwise (doubles converted exactly from the floats)
          CHECK(z.hashes == ddp[0].hashes);  // after every step
        }
        // The training moved the parameters: a ZeRO-1 that updated nothing would fail above only
        // if DDP moved them too.
        CHECK(ddp[0].hashes.front() != ddp[0].hashes.back());
      }
    }
  }
}

TEST_CASE("ZeRO-1 with the library's Adam, AdamW and SGD gives bitwise DDP's parameters with optim::optimizer",
          "[host][zero][contract]") {
  auto const check = [](auto rule, char const* name) {
    for (int world = 1; world <= 4; ++world) {
      for (bool tiny : {false, true}) {
        INFO(name << ", world " << world << ", tiny buckets " << tiny);
        auto const ddp = run_all(world, false, true, tiny, rule);
        auto const zero = run_all(world, true, true, tiny, rule);
        for (auto const& z : zero) {
          CHECK(z.params == ddp[0].params);
          CHECK(z.hashes == ddp[0].hashes);
          CHECK(z.state_bytes == z.expected_state_bytes);
        }
        CHECK(ddp[0].hashes.front() != ddp[0].hashes.back());
      }
    }
  };
  check(dpl::optim::adam{}, "adam");
  check(dpl::optim::adamw({.weight_decay = 0.1}), "adamw");
  check(dpl::optim::sgd({.momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01, .nesterov = false}), "momentum");
  check(dpl::optim::sgd({.momentum = 0.9, .nesterov = true}), "nesterov");
  check(dpl::optim::sgd(), "plain sgd (no state: 0 bytes)");
}

TEST_CASE("ZeRO-1 keeps 1/N of the optimizer state per rank (plus bucket padding)", "[host][zero][memory]") {
  std::size_t total = 0;
  for (auto s : test::zero_sizes()) total += s;
  for (int world = 1; world <= 4; ++world) {
    for (bool tiny : {false, true}) {
      INFO("world " << world << ", tiny buckets " << tiny);
      auto const ddp = run_all(world, false, false, tiny);
      auto const zero = run_all(world, true, false, tiny);
      CHECK(ddp[0].state_bytes == 2 * sizeof(float) * total);  // every DDP rank holds the whole state
      std::size_t covered = 0;
      for (auto const& z : zero) {
        CHECK(z.state_bytes == z.expected_state_bytes);
        covered += z.valid_elements;
      }
      CHECK(covered == total);  // the shards cover every parameter element exactly once
      if (!tiny) CHECK(zero[0].state_bytes == 2 * sizeof(float) * ((total + world - 1) / world));  // one bucket
    }
  }
}

namespace {
/// The host backend with an allocator that counts its calls (bucket, shard and state memory).
struct counting_backend : dpl::host::backend {
  static inline std::atomic<std::size_t> calls{0};
  static std::shared_ptr<std::byte> allocate(dpl::device d, std::size_t n) {
    calls.fetch_add(1);
    return dpl::host::backend::allocate(d, n);
  }
};
}  // namespace

TEST_CASE("ZeRO-1 steady-state steps allocate no bucket, shard or state memory", "[host][zero][memory]") {
  for (bool tiny : {false, true}) {
    std::vector<std::size_t> after(12, 0);
    std::vector<std::size_t> state(12, 0);
    counting_backend::calls = 0;
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      model m(test::zero_sizes());
      auto const d = test::dataset<float>::make(8, m.dim, 2, false);
      auto const mine = dpl::slice_batch(d.all(), 4 * static_cast<std::size_t>(rank.rank()),
                                         4 * static_cast<std::size_t>(rank.rank()) + 4);
      dpl::parallel<model, dpl::ddp_zero1, counting_backend> w(m, rank, tiny ? test::zero_tiny_buckets() : dpl::options{});
      dpl::optim::zero_redundancy_optimizer opt(w, dpl::optim::adam{});
      for (std::size_t k = 0; k < after.size(); ++k) {
        w.step(mine, plain_step);
        opt.step(w, 1e-3);
        rank.group().barrier().wait();  // both ranks' allocations of this step are counted
        if (rank.rank() == 0) {
          after[k] = counting_backend::calls.load();
          state[k] = opt.state_bytes();
        }
        rank.group().barrier().wait();
      }
    });
    INFO("tiny buckets " << tiny);
    CHECK(state[1] > 0);
    for (std::size_t k = 2; k < after.size(); ++k) {  // step 1 rebuilt the plan and laid the state out
      CHECK(after[k] == after[1]);
      CHECK(state[k] == state[1]);
    }
  }
}

TEST_CASE("ZeRO-1 with no_sync accumulation equals DDP with no_sync", "[host][zero]") {
  for (int world : {2, 3}) {
    std::vector<std::vector<double>> got(2 * static_cast<std::size_t>(world));
    for (bool zero : {false, true}) {
      dpl::spawn(world, [&](dpl::rank_context& rank) {
        model m(test::zero_sizes());
        auto const d = test::dataset<float>::make(8 * static_cast<std::size_t>(world), m.dim, 5, false);
        auto const part = [&](std::size_t k) { return half_of_rank(d, rank.rank(), k); };
        if (zero) {
          dpl::parallel<model, dpl::ddp_zero1> w(m, rank, test::zero_tiny_buckets());
          dpl::optim::zero_redundancy_optimizer opt(w, test::adam_like{});
          for (int step = 0; step < 3; ++step) {
            {
              auto s = w.no_sync();
              w.step(part(0), plain_step);
            }
            w.step(part(1), plain_step);
            opt.step(0.01);
          }
        } else {
          dpl::distributed_data_parallel<model> w(m, rank, test::zero_tiny_buckets());
          dpl::optim::optimizer opt(w, test::adam_like{});
          for (int step = 0; step < 3; ++step) {
            {
              auto s = w.no_sync();
              w.step(part(0), plain_step);
            }
            w.step(part(1), plain_step);
            opt.step(w, 0.01);
          }
        }
        got[static_cast<std::size_t>(rank.rank() + (zero ? world : 0))] = test::flat(m, false);
      });
    }
    for (auto const& g : got) CHECK(g == got[0]);
  }
}

TEST_CASE("ZeRO-1 leaves the model's gradients as the step function computed them", "[host][zero][contract]") {
  // Plain steps (gradients reduce-scattered from a list, in place, on thread ranks), steps after
  // no_sync accumulation and steps that mark gradients ready (both staged through bucket storage).
  for (int world : {2, 3}) {
    for (int mode : {0, 1, 2}) {
      INFO("world " << world << ", mode " << mode);
      std::vector<char> same(static_cast<std::size_t>(world), 0);
      dpl::spawn(world, [&](dpl::rank_context& rank) {
        model m(test::zero_sizes());
        auto const d = test::dataset<float>::make(8 * static_cast<std::size_t>(world), m.dim, 7, false);
        auto const part = [&](std::size_t k) { return half_of_rank(d, rank.rank(), k); };
        dpl::parallel<model, dpl::ddp_zero1> w(m, rank, test::zero_tiny_buckets());
        dpl::optim::zero_redundancy_optimizer opt(w, test::adam_like{});
        bool ok = true;
        for (int step = 0; step < 3; ++step) {
          if (mode == 1) {
            auto s = w.no_sync();
            w.step(part(0), plain_step);
          }
          std::vector<std::vector<float>> computed;
          w.step(part(1), [&](model& x, test::samples<float> s, dpl::step_context& ctx) {
            auto const loss = mode == 2 ? x.forward_backward(s, &ctx) : x.forward_backward(s);
            computed = x.g;
            return loss;
          });
          if (step > 0) ok = ok && m.g == computed;  // the first step all-reduces, as DDP (documented)
          opt.step(0.01);
        }
        same[static_cast<std::size_t>(rank.rank())] = ok ? 1 : 0;
      });
      for (char c : same) CHECK(c == 1);
    }
  }
}

TEST_CASE("ZeRO-1: ranks with different models fail construction on every rank, naming the rank and parameter",
          "[host][zero][error]") {
  auto const seen = errors_of(3, [](dpl::rank_context& rank) {
    model m(rank.rank() == 1 ? std::vector<std::size_t>{3, 5, 1, 7, 2, 4} : test::zero_sizes());
    dpl::parallel<model, dpl::ddp_zero1> w(m, rank);
  });
  for (auto const& s : seen) CHECK_THAT(s, Catch::Contains("rank 1's parameter 3 has 7 elements"));
}

TEST_CASE("ZeRO-1: an update without a synchronised step is refused, naming the rank", "[host][zero][error]") {
  auto const before_any = errors_of(2, [](dpl::rank_context& rank) {
    model m(test::zero_sizes());
    dpl::parallel<model, dpl::ddp_zero1> w(m, rank);
    dpl::optim::zero_redundancy_optimizer opt(w, test::adam_like{});
    opt.step(0.1);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_THAT(before_any[static_cast<std::size_t>(r)],
               Catch::Contains("zero_redundancy_optimizer::step on rank " + std::to_string(r)) &&
                   Catch::Contains("expected a synchronised step() of the wrapper since the last update"));
  }
  auto const twice = errors_of(2, [](dpl::rank_context& rank) {
    model m(test::zero_sizes());
    auto const d = test::dataset<float>::make(8, m.dim, 1, false);
    dpl::parallel<model, dpl::ddp_zero1> w(m, rank);
    dpl::optim::zero_redundancy_optimizer opt(w, test::adam_like{});
    w.step(dpl::slice_batch(d.all(), 4 * static_cast<std::size_t>(rank.rank()), 4 * static_cast<std::size_t>(rank.rank()) + 4),
           plain_step);
    opt.step(0.1);
    {
      auto s = w.no_sync();  // accumulates only: no fresh shards
      w.step(d.all(), plain_step);
    }
    opt.step(0.1);
  });
  for (auto const& s : twice) CHECK_THAT(s, Catch::Contains("call the wrapper's step() outside no_sync() first"));
}

TEST_CASE("ZeRO-1: a step after an update written by hand (shards not used by the optimizer) fails on every rank",
          "[host][zero][error]") {
  // The "one using" move from DDP with the update kept by hand: module()'s gradients are each
  // rank's own after a ZeRO-1 step, so such an update would make the ranks diverge.
  auto const steps = [](dpl::rank_context& rank, bool optimizer) {
    model m(test::zero_sizes());
    auto const d = test::dataset<float>::make(16, m.dim, 3, false);
    dpl::parallel<model, dpl::ddp_zero1> w(m, rank, test::zero_tiny_buckets());
    dpl::optim::zero_redundancy_optimizer opt(w, test::adam_like{});
    for (int step = 0; step < 3; ++step) {
      w.step(half_of_rank(d, rank.rank(), static_cast<std::size_t>(step % 2)), plain_step);
      if (optimizer) {
        opt.step(0.01);
      } else {
        for (std::size_t i = 0; i < m.w.size(); ++i)
          for (std::size_t j = 0; j < m.w[i].size(); ++j) m.w[i][j] -= 0.01F * m.g[i][j];
      }
    }
  };
  auto const by_hand = errors_of(2, [&](dpl::rank_context& rank) { steps(rank, false); });
  for (int r = 0; r < 2; ++r)
    CHECK_THAT(by_hand[static_cast<std::size_t>(r)],
               Catch::Contains("ZeRO-1 (ddp_zero1) on rank " + std::to_string(r) +
                               ": the previous synchronised step's gradient shards were not used by a "
                               "zero_redundancy_optimizer") &&
                   Catch::Contains("call opt.step(lr) of a dparallel::zero_redundancy_optimizer"));
  auto const with_optimizer = errors_of(2, [&](dpl::rank_context& rank) { steps(rank, true); });
  CHECK(with_optimizer == std::vector<std::string>(2));
}

TEST_CASE("ZeRO-1 refuses gradient_as_bucket_view and parameters that are not f32", "[host][zero][error]") {
  auto const view = errors_of(2, [](dpl::rank_context& rank) {
    model m(test::zero_sizes());
    dpl::parallel<model, dpl::ddp_zero1> w(m, rank, dpl::options{.gradient_as_bucket_view = true});
  });
  for (int r = 0; r < 2; ++r)
    CHECK_THAT(view[static_cast<std::size_t>(r)],
               Catch::Contains("ZeRO-1 (bucketed_reduce_scatter) on rank " + std::to_string(r)) &&
                   Catch::Contains("expected options::gradient_as_bucket_view = false"));
  auto const f64 = errors_of(2, [](dpl::rank_context& rank) {
    test::chunked<double> m(test::zero_sizes());
    dpl::parallel<test::chunked<double>, dpl::ddp_zero1> w(m, rank);
    dpl::optim::zero_redundancy_optimizer opt(w, test::adam_like{});
  });
  for (auto const& s : f64) CHECK_THAT(s, Catch::Contains("parameter 0 is F64, expected F32"));
  auto const bf16 = errors_of(2, [](dpl::rank_context& rank) {  // 16-bit: only with master shards
    test::half_chunked<dpl::bf16> m(test::zero_sizes(), 7);
    dpl::parallel<test::half_chunked<dpl::bf16>, dpl::ddp_zero1> w(m, rank);
    dpl::optim::zero_redundancy_optimizer opt(w, test::adam_like{});
  });
  for (auto const& s : bf16) CHECK_THAT(s, Catch::Contains("parameter 0 is BF16") && Catch::Contains("master_weights = true"));
}

namespace {

/// train_half_rank on `world` thread ranks: every rank's run.
template <class T>
std::vector<test::half_run> run_half(int world, bool zero, bool hook, bool tiny) {
  std::vector<test::half_run> out(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    out[static_cast<std::size_t>(rank.rank())] = test::train_half_rank<T>(rank.group(), zero, hook, tiny);
  });
  return out;
}

template <class T>
void half_zero_equals_ddp(char const* name) {
  for (int n = 1; n <= 4; ++n)
    for (bool tiny : {false, true})
      for (bool hook : {false, true}) {
        INFO(name << ", " << n << " ranks, tiny buckets " << tiny << ", grad_ready " << hook);
        auto const want = run_half<T>(n, false, hook, tiny);
        auto const got = run_half<T>(n, true, hook, tiny);
        for (auto const& r : got) {
          CHECK(r.hashes == want[0].hashes);  // after every step
          CHECK(r.bits == want[0].bits);
          CHECK(r.state_bytes == r.expected_state_bytes);  // 1/N of two slots and the master, plus padding
        }
        CHECK(want[0].hashes.front() != want[0].hashes.back());  // the run moved the parameters
        if (n > 1) CHECK(got[0].state_bytes < want[0].state_bytes);
      }
}

}  // namespace

// Each rank keeps the F32 master copy of its shard only; DDP's optimizer keeps all of it on every
// rank. The model rounds F32 gradients to 16 bits, so the ranks' averages are not exact: the
// reduce-scatter must round them as DDP's all-reduce does.
TEST_CASE("ZeRO-1 over bf16 and f16 parameters with F32 master shards equals DDP with master weights, bitwise",
          "[host][zero][master][contract]") {
  half_zero_equals_ddp<dpl::bf16>("bf16");
  half_zero_equals_ddp<dpl::f16>("f16");
}

TEST_CASE("ZeRO-1 with overlap_gather: the gathers run on into the next step, and with need() the parameters are "
          "bitwise those of the waiting step",
          "[host][zero][overlap][contract]") {
  for (int world = 1; world <= 4; ++world) {
    for (bool tiny : {false, true}) {
      for (bool hook : {false, true}) {
        INFO("world " << world << ", tiny buckets " << tiny << ", grad_ready " << hook);
        auto const want = run_all(world, true, hook, tiny);
        std::vector<test::overlap_run> got(static_cast<std::size_t>(world));
        dpl::spawn(world, [&](dpl::rank_context& rank) {
          got[static_cast<std::size_t>(rank.rank())] = test::train_overlap(rank.group(), hook, tiny);
        });
        for (int r = 0; r < world; ++r) {
          auto const& g = got[static_cast<std::size_t>(r)];
          CHECK(g.params == want[static_cast<std::size_t>(r)].params);  // every forward read the updated values
          CHECK(g.params == want[0].params);
          // After every update the gathers are still pending (one per bucket), until the next step's need().
          CHECK(g.pending.front() >= 1);
          CHECK(std::count(g.pending.begin(), g.pending.end(), g.pending.front()) == 20);
        }
      }
    }
  }
}

TEST_CASE("ZeRO-1 with overlap_gather: a step that reads parameters without need() fails on every rank, naming "
          "them; need() refuses an index out of range",
          "[host][zero][overlap][error]") {
  for (bool hook : {false, true}) {
    INFO("grad_ready " << hook);
    auto const errors = errors_of(2, [hook](dpl::rank_context& rank) { (void)test::train_overlap(rank.group(), hook, false, true); });
    for (int r = 0; r < 2; ++r) {
      CHECK_THAT(errors[static_cast<std::size_t>(r)],
                 Catch::Contains("zero_redundancy_optimizer with overlap_gather on rank " + std::to_string(r)) &&
                     Catch::Contains("before their all-gather was waited for") &&
                     Catch::Contains("call opt.need(i) in the step function"));
    }
  }
  auto const range = errors_of(2, [](dpl::rank_context& rank) {
    model m(test::zero_sizes());
    dpl::parallel<model, dpl::ddp_zero1> w(m, rank);
    dpl::optim::zero_redundancy_optimizer opt(w, test::adam_like{}, {.overlap_gather = true});
    opt.need(test::zero_sizes().size());
  });
  for (auto const& s : range) CHECK_THAT(s, Catch::Contains("expected a parameter index below 6, found 6"));
}

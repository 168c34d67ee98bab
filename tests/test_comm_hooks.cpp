// DDP communication hooks on thread ranks (policy/comm_hook.hpp, policy/compress_hooks.hpp):
//  - fp16_compress / bf16_compress, with and without error feedback, in the copying mode and with
//    gradient_as_bucket_view, with and without grad_ready overlap, through a no_sync
//    accumulation: every rank's gradients equal, bit for bit, a reference computed here on the
//    test thread (each rank's local gradient, compressed, averaged in float in rank order, rounded
//    once, widened), step after step;
//  - a user hook that all-reduces in place gives the default's bits, and runs while backward is
//    still going (overlap);
//  - a hook whose result has the wrong size, and a compression hook on an F64 model, fail every
//    rank with an error that says what was expected.
// Ranks only record what they saw; every assertion runs on the test thread.
#include "hook_models.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/policy/compress_hooks.hpp>

#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace dpl = dparallel;
using namespace test::hooks;

namespace {

/// Every rank's gradients after each synchronised step.
using traces = std::vector<std::vector<std::vector<float>>>;

/// Trains `steps` steps of DDP on `world` thread ranks; `setup(ddp)` registers a hook (or not).
template <class Setup>
traces train(int world, bool view, bool overlap, Setup setup) {
  traces out(static_cast<std::size_t>(world));
  dpl::options opts = small_buckets();
  opts.gradient_as_bucket_view = view;
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    pull_model m;
    dpl::distributed_data_parallel<pull_model> ddp(m, rank.group(), opts);
    setup(ddp);
    auto fn = [&](pull_model& r, test::samples<float> s, dpl::step_context& ctx) {
      r.forward_backward(s, overlap ? &ctx : nullptr);
    };
    for (int step = 0; step < steps; ++step) {
      auto const data = batch_of(step, world);
      if (step == 3) {
        auto scope = ddp.no_sync();
        ddp.step(rank_part(data, rank.rank()), fn);
        continue;
      }
      ddp.step(rank_part(data, rank.rank()), fn);
      out[static_cast<std::size_t>(rank.rank())].push_back(m.g);
      m.sgd(0.01f);
    }
  });
  return out;
}

/// The reference of train() with a compression hook of type H, on this thread: the gradients of
/// each synchronised step.
template <class H>
std::vector<std::vector<float>> reference(int world, bool error_feedback) {
  auto const uw = static_cast<std::size_t>(world);
  pull_model m;  // the parameters every rank holds (rank 0's, the same seed)
  std::size_t const dim = m.dim;
  std::vector<std::vector<float>> residual(uw, std::vector<float>(dim, 0.0f));
  std::vector<std::vector<float>> acc(uw);  // no_sync: each rank's accumulated gradients
  std::vector<std::vector<float>> out;
  float const inv_world = 1.0f / static_cast<float>(world);
  for (int step = 0; step < steps; ++step) {
    auto const data = batch_of(step, world);
    std::vector<std::vector<float>> local(uw);
    for (std::size_t r = 0; r < uw; ++r) {
      pull_model one = m;
      one.forward_backward(rank_part(data, static_cast<int>(r)));
      local[r] = one.g;
    }
    auto const n = static_cast<float>(per_rank);
    if (step == 3) {  // the reducer's accumulation: 0 + n * g
      for (std::size_t r = 0; r < uw; ++r) {
        acc[r].assign(dim, 0.0f);
        for (std::size_t j = 0; j < dim; ++j) acc[r][j] = acc[r][j] + n * local[r][j];
      }
      continue;
    }
    if (step == 4) {  // the weighted mean of the accumulated step and this one
      auto const scale = static_cast<float>(1.0 / (2.0 * per_rank));
      for (std::size_t r = 0; r < uw; ++r)
        for (std::size_t j = 0; j < dim; ++j) local[r][j] = (acc[r][j] + n * local[r][j]) * scale;
    }
    std::vector<float> avg(dim);
    for (std::size_t j = 0; j < dim; ++j) {
      float sum = 0;
      for (std::size_t r = 0; r < uw; ++r) {
        float const x = local[r][j] + (error_feedback ? residual[r][j] : 0.0f);
        H const c(x);
        if (error_feedback) residual[r][j] = x - static_cast<float>(c);
        sum = r == 0 ? static_cast<float>(c) : sum + static_cast<float>(c);
      }
      avg[j] = static_cast<float>(H(sum * inv_world));
    }
    out.push_back(avg);
    m.g = avg;
    m.sgd(0.01f);
  }
  return out;
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <class H, class Hook>
void check_compression(Hook hook) {
  for (int world : {2, 3, 4}) {
    for (bool ef : {false, true}) {
      auto const want = reference<H>(world, ef);
      for (bool view : {false, true}) {
        for (bool overlap : {false, true}) {
          auto const got = train(world, view, overlap, [&](auto& ddp) {
            ddp.reducer().register_comm_hook(dpl::compress_state{.error_feedback = ef}, hook);
          });
          INFO("world " << world << ", error feedback " << ef << ", bucket view " << view << ", grad_ready " << overlap);
          for (std::size_t r = 0; r < got.size(); ++r) {
            REQUIRE(got[r].size() == want.size());
            for (std::size_t t = 0; t < want.size(); ++t) {
              INFO("rank " << r << ", synchronised step " << t);
              CHECK(same_bits(got[r][t], want[t]));
            }
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("fp16_compress equals compress -> average in float -> decompress, bitwise", "[host][ddp][hooks]") {
  check_compression<dpl::f16>(dpl::fp16_compress);
}

TEST_CASE("bf16_compress equals compress -> average in float -> decompress, bitwise", "[host][ddp][hooks]") {
  check_compression<dpl::bf16>(dpl::bf16_compress);
}

TEST_CASE("error feedback changes the result (the residual is carried)", "[host][ddp][hooks]") {
  // The reference with and without feedback must differ from the second step on: otherwise the
  // feedback tests above could not tell the two apart.
  auto const with = reference<dpl::bf16>(2, true);
  auto const without = reference<dpl::bf16>(2, false);
  CHECK(same_bits(with[0], without[0]));
  CHECK_FALSE(same_bits(with[1], without[1]));
}

/// A user hook: the plain in-place average, counting its calls and those made while backward
/// was still running on this rank.
struct counting_state {
  int calls = 0;
  int during_backward = 0;
  bool const* backward_running = nullptr;
};
struct plain_average {
  dpl::bucket_future operator()(counting_state& st, dpl::process_group const& g, dpl::grad_bucket const& b) const {
    ++st.calls;
    if (*st.backward_running) ++st.during_backward;
    return dpl::bucket_future(g.all_reduce(b.data, dpl::reduce_op::avg), b.data);
  }
};
static_assert(dpl::comm_hook<plain_average, counting_state>);

TEST_CASE("a user hook that averages in place gives the default's bits and overlaps backward", "[host][ddp][hooks]") {
  for (bool view : {false, true}) {
    auto const plain = train(3, view, true, [](auto&) {});
    traces hooked(3);
    dpl::options opts = small_buckets();
    opts.gradient_as_bucket_view = view;
    dpl::spawn(3, [&](dpl::rank_context& rank) {
      auto const r = static_cast<std::size_t>(rank.rank());
      pull_model m;
      bool running = false;
      dpl::distributed_data_parallel<pull_model> ddp(m, rank.group(), opts);
      ddp.reducer().register_comm_hook(counting_state{0, 0, &running}, plain_average{});
      for (int step = 0; step < steps; ++step) {
        auto const data = batch_of(step, 3);
        auto fn = [&](pull_model& mm, test::samples<float> s, dpl::step_context& ctx) {
          running = true;
          mm.forward_backward(s, &ctx);
          running = false;
        };
        if (step == 3) {
          auto scope = ddp.no_sync();
          ddp.step(rank_part(data, rank.rank()), fn);
          continue;
        }
        ddp.step(rank_part(data, rank.rank()), fn);
        hooked[r].push_back(m.g);
        m.sgd(0.01f);
      }
    });
    INFO("bucket view " << view);
    for (std::size_t r = 0; r < 3; ++r) {
      REQUIRE(hooked[r].size() == plain[r].size());
      for (std::size_t t = 0; t < plain[r].size(); ++t) CHECK(same_bits(hooked[r][t], plain[r][t]));
    }
  }
}

TEST_CASE("a user hook is called once per bucket and synchronised step, while backward runs", "[host][ddp][hooks]") {
  struct outcome {
    int calls = 0, during = 0;
    std::size_t buckets = 0;
  };
  std::vector<outcome> seen(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    pull_model m;
    bool running = false;
    dpl::distributed_data_parallel<pull_model> ddp(m, rank.group(), small_buckets());
    auto const state = std::make_shared<counting_state>();
    state->backward_running = &running;
    ddp.reducer().register_comm_hook(state, [](std::shared_ptr<counting_state>& st, dpl::process_group const& g,
                                               dpl::grad_bucket const& b) { return plain_average{}(*st, g, b); });
    for (int step = 0; step < 3; ++step) {
      ddp.step(rank_part(batch_of(step, 2), rank.rank()), [&](pull_model& mm, test::samples<float> s, dpl::step_context& ctx) {
        running = true;
        mm.forward_backward(s, &ctx);
        running = false;
      });
    }
    auto& o = seen[static_cast<std::size_t>(rank.rank())];
    o.calls = state->calls;
    o.during = state->during_backward;
    o.buckets = ddp.reducer().buckets().size();
  });
  for (auto const& o : seen) {
    CHECK(o.buckets >= 3);
    CHECK(static_cast<std::size_t>(o.calls) == 3 * o.buckets);  // the plan keeps its bucket count here
    CHECK(o.during >= 3);  // at least the first bucket of each step, before backward ended
  }
}

TEST_CASE("a hook's wrong result and a compression hook on F64 fail every rank with a clear error",
          "[host][ddp][hooks][error]") {
  struct short_result {
    dpl::bucket_future operator()(int&, dpl::process_group const& g, dpl::grad_bucket const& b) const {
      return dpl::bucket_future(g.all_reduce(b.data, dpl::reduce_op::avg),
                                dpl::tensor_ref(b.data.data(), b.data.size() - 1, b.data.dtype(), b.data.device()));
    }
  };
  auto const run_short = [] {
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      pull_model m;
      dpl::distributed_data_parallel<pull_model> ddp(m, rank.group());
      ddp.reducer().register_comm_hook(0, short_result{});
      ddp.step(rank_part(batch_of(0, 2), rank.rank()),
               [](pull_model& mm, test::samples<float> s) { mm.forward_backward(s); });
    });
  };
  CHECK_THROWS_WITH(run_short(), Catch::Contains("bucket 0 holds 1367 x F32, the hook returned 1366 x F32; "
                                                 "expected the reduced bucket, of the bucket's dtype and size"));
  auto const run_f64 = [] {
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      test::chunked<double> m;
      dpl::distributed_data_parallel<test::chunked<double>> ddp(m, rank.group());
      ddp.reducer().register_comm_hook(dpl::compress_state{}, dpl::fp16_compress);
      auto const data = test::dataset<double>::make(4, m.dim, 1, false);
      ddp.step(data.all(), [](test::chunked<double>& mm, test::samples<double> s) { mm.forward_backward(s); });
    });
  };
  CHECK_THROWS_WITH(run_f64(), Catch::Contains("fp16_compress: expected an F32 gradient bucket, found F64"));
  // A bucket said to be in GPU memory (never touched: the check comes first) names the hook that takes it.
  auto const run_gpu_bucket = [] {
    dpl::spawn(1, [&](dpl::rank_context& rank) {
      std::vector<float> x(4);
      std::vector<std::size_t> const params{0}, offsets{0}, sizes{4};
      dpl::compress_state st;
      (void)dpl::bf16_compress(st, rank.group(),
                               dpl::grad_bucket{0, dpl::tensor_ref(x.data(), 4, dpl::dtype::f32, dpl::device{dpl::device_kind::cuda, 0, 0}),
                                                params, offsets, sizes});
    });
  };
  CHECK_THROWS_WITH(run_gpu_bucket(), Catch::Contains("bf16_compress: expected the bucket in host memory") &&
                                          Catch::Contains("register dparallel::cuda::bf16_compress"));
}

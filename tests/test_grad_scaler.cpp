// optim::grad_scaler: PyTorch's dynamic loss scaling (the scale sequence and the skipped steps of a
// gradient stream with planted infs and NaNs, worked out by hand from the algorithm), the unscaled
// bits, and the same skipped steps and bits on one device, DDP and ZeRO-1 over 2 and 3 ranks.
#include "models.hpp"
#include "test_zero_common.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/optim/grad_scaler.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;
using model = test::chunked<float>;

namespace {

float const inf = std::numeric_limits<float>::infinity();
float const qnan = std::numeric_limits<float>::quiet_NaN();

/// One gradient tensor of `n` elements holding `v`.
struct one_grad {
  std::vector<float> g;
  std::vector<dpl::tensor_ref> refs() { return {dpl::tensor_ref(g.data(), g.size(), dpl::dtype::f32)}; }
};

std::vector<float> flat_params(model& m) {
  std::vector<float> out;
  for (auto& w : m.w) out.insert(out.end(), w.begin(), w.end());
  return out;
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Multiplies every gradient by `s` (the backward of a scaled loss; exact for powers of two) and
/// plants `bad` at element 0 of tensor `tensor` when `bad` is not 0.
void scale_and_plant(model& m, float s, float bad, std::size_t tensor) {
  for (auto& g : m.g)
    for (float& x : g) x *= s;
  if (bad != 0) m.g[tensor][0] = bad;
}

}  // namespace

TEST_CASE("grad_scaler: PyTorch's defaults, and the scale sequence of a stream with infs and NaNs",
          "[optim][grad_scaler]") {
  optim::grad_scaler defaults;
  CHECK(defaults.scale() == 65536.0f);
  CHECK(defaults.options().growth_factor == 2.0);
  CHECK(defaults.options().backoff_factor == 0.5);
  CHECK(defaults.options().growth_interval == 2000);
  CHECK(defaults.scale(1.5f) == 98304.0f);

  // growth_interval 3, from 8: steps 4 (inf), 5 (NaN) and 9 (-inf) are skipped. By hand: good
  // steps 1-3 grow 8 -> 16; 4 backs off to 8, 5 to 4; 6-8 grow to 8; 9 backs off to 4; 10 is good.
  optim::grad_scaler scaler({.init_scale = 8.0, .growth_interval = 3});
  std::vector<float> const planted{0, 0, 0, inf, qnan, 0, 0, 0, -inf, 0};
  std::vector<float> const want_scale{8, 8, 8, 16, 8, 4, 4, 4, 8, 4};
  std::vector<float> used;
  std::vector<int> skipped;
  for (std::size_t k = 0; k < planted.size(); ++k) {
    one_grad g{{0.5f * scaler.scale(), -0.25f * scaler.scale(), planted[k] == 0 ? 1.0f : planted[k]}};
    used.push_back(scaler.scale());
    auto const refs = g.refs();
    bool const found = scaler.unscale(refs);
    CHECK(found == (planted[k] != 0));
    if (!found) CHECK(g.g == std::vector<float>{0.5f, -0.25f, 1.0f / scaler.scale()});  // exact: powers of two
    else skipped.push_back(static_cast<int>(k) + 1);
    scaler.update();
  }
  CHECK(used == want_scale);
  CHECK(skipped == std::vector<int>{4, 5, 9});
  CHECK(scaler.scale() == 4.0f);
  CHECK(scaler.good_steps() == 1);
}

TEST_CASE("grad_scaler: unscaling multiplies by the f32 inverse, and a scale that would overflow stays",
          "[optim][grad_scaler]") {
  optim::grad_scaler three({.init_scale = 3.0});
  one_grad g{{1.0f, 7.0f, -2.5f}};
  auto const inv = static_cast<float>(1.0 / 3.0);
  std::vector<float> const want{1.0f * inv, 7.0f * inv, -2.5f * inv};
  auto const refs = g.refs();
  CHECK_FALSE(three.unscale(refs));
  CHECK(same_bits(g.g, want));

  optim::grad_scaler top({.init_scale = 0x1p127, .growth_interval = 1});
  one_grad h{{1.0f}};
  auto const hr = h.refs();
  top.unscale(hr);
  top.update();
  CHECK(top.scale() == 0x1p127f);  // 2^128 is not a finite f32: the scale stays
  CHECK(top.good_steps() == 0);
}

TEST_CASE("grad_scaler: one device, DDP and ZeRO-1 over 2 and 3 ranks skip the same steps and end as without them",
          "[optim][grad_scaler][ddp][zero]") {
  // Steps 3 and 6 carry an inf, step 5 a NaN, each planted on one rank only (the last), in a tensor
  // whose ZeRO shard another rank may own: without the ranks combining found-inf, ZeRO's ranks
  // would disagree about skipping. The scale stays a power of two, so unscaling is exact and every
  // run equals the same run without a scaler that leaves those steps out.
  constexpr int steps = 8;
  std::vector<float> const planted{0, 0, inf, 0, qnan, -inf, 0, 0};
  std::vector<std::size_t> const tensor{0, 0, 5, 0, 0, 3, 0, 0};
  auto const data = test::dataset<float>::make(12, model().dim, 31, true);
  dpl::options const opts = test::zero_tiny_buckets();
  optim::grad_scaler_options const so{.init_scale = 1024.0, .growth_interval = 2};

  model reference;  // one device, no scaler: the planted steps left out
  {
    optim::optimizer<optim::sgd> opt(reference, optim::sgd({.momentum = 0.9}));
    for (int k = 0; k < steps; ++k) {
      reference.forward_backward(data.all());
      if (planted[static_cast<std::size_t>(k)] == 0) opt.step(reference, 0.01);
    }
  }
  auto const want = flat_params(reference);

  model one;  // one device with the scaler
  std::vector<int> one_skipped;
  {
    optim::optimizer<optim::sgd> opt(one, optim::sgd({.momentum = 0.9}));
    optim::grad_scaler scaler(so);
    for (int k = 0; k < steps; ++k) {
      one.forward_backward(data.all());
      scale_and_plant(one, scaler.scale(), planted[static_cast<std::size_t>(k)], tensor[static_cast<std::size_t>(k)]);
      if (!scaler.step(opt, one, 0.01)) one_skipped.push_back(k + 1);
      scaler.update();
    }
  }
  CHECK(one_skipped == std::vector<int>{3, 5, 6});
  CHECK(same_bits(flat_params(one), want));

  // mode 0: DDP without a scaler, leaving the planted steps out (the optimizer is not called);
  // 1: DDP with the scaler; 2: ZeRO-1 with the scaler. All three agree bitwise.
  for (int world : {2, 3}) {
    std::vector<std::vector<float>> plain;
    for (int mode : {0, 1, 2}) {
      INFO(world << " ranks, " << (mode == 0 ? "DDP leaving the steps out" : mode == 1 ? "DDP" : "ZeRO-1"));
      std::vector<std::vector<float>> got(static_cast<std::size_t>(world));
      std::vector<std::vector<int>> skipped(static_cast<std::size_t>(world));
      std::vector<float> scales(static_cast<std::size_t>(world));
      std::size_t const per = 12 / static_cast<std::size_t>(world);
      dpl::spawn(world, [&](dpl::rank_context& rank) {
        auto const r = static_cast<std::size_t>(rank.rank());
        bool const planter = mode != 0 && rank.rank() == world - 1;
        model m;
        optim::grad_scaler scaler(so);
        auto const run = [&](auto& w, auto& opt) {
          for (int k = 0; k < steps; ++k) {
            auto const kk = static_cast<std::size_t>(k);
            w.step(dpl::slice_batch(data.all(), r * per, (r + 1) * per), [&](model& rep, test::samples<float> s) {
              rep.forward_backward(s);
              if (mode != 0) scale_and_plant(rep, scaler.scale(), planter ? planted[kk] : 0.0f, tensor[kk]);
            });
            if (mode == 0) {
              if (planted[kk] == 0) opt.step(w, 0.01);
              else skipped[r].push_back(k + 1);
              continue;
            }
            if (!scaler.step(opt, w, 0.01)) skipped[r].push_back(k + 1);
            scaler.update();
          }
        };
        if (mode == 2) {
          dpl::parallel<model, dpl::ddp_zero1> w(m, rank.group(), opts);
          dpl::zero_redundancy_optimizer opt(w, optim::sgd({.momentum = 0.9}));
          run(w, opt);
        } else {
          dpl::distributed_data_parallel<model> w(m, rank.group(), opts);
          optim::optimizer<optim::sgd> opt(w, optim::sgd({.momentum = 0.9}));
          run(w, opt);
        }
        got[r] = flat_params(m);
        scales[r] = scaler.scale();
      });
      if (mode == 0) plain = got;
      for (std::size_t r = 0; r < got.size(); ++r) {
        CHECK(skipped[r] == one_skipped);
        CHECK(scales[r] == scales[0]);
        CHECK(same_bits(got[r], plain[0]));
      }
    }
  }
}

TEST_CASE("grad_scaler: the state resumes through a checkpoint; misuse and bad settings are named",
          "[optim][grad_scaler][error]") {
  using Catch::Matchers::Contains;
  auto const dir = std::filesystem::temp_directory_path() / "dparallel_grad_scaler_test";
  std::filesystem::create_directories(dir);
  model m;
  optim::grad_scaler scaler({.init_scale = 64.0, .growth_interval = 5});
  for (int k = 0; k < 3; ++k) {
    one_grad g{{k == 1 ? inf : 1.0f}};
    auto const refs = g.refs();
    scaler.unscale(refs);
    scaler.update();
  }
  REQUIRE(scaler.scale() == 32.0f);
  REQUIRE(scaler.good_steps() == 1);
  {
    dpl::checkpoint ck(m);
    optim::add_to(ck, scaler);
    ck.save(dir / "c.safetensors");
  }
  optim::grad_scaler back({.init_scale = 64.0, .growth_interval = 5});
  {
    dpl::checkpoint ck(m);
    optim::add_to(ck, back);
    ck.load(dir / "c.safetensors");
  }
  CHECK(back.scale() == 32.0f);
  CHECK(back.good_steps() == 1);
  std::filesystem::remove_all(dir);

  one_grad g{{1.0f}};
  auto const refs = g.refs();
  optim::grad_scaler s;
  CHECK_THROWS_WITH(s.update(), Contains("no unscale() or step() since the last update()"));
  s.unscale(refs);
  CHECK_THROWS_WITH(s.unscale(refs), Contains("already unscaled"));
  std::vector<dpl::f16> half(2, dpl::f16(1.0f));
  optim::grad_scaler t;
  dpl::tensor_ref const h(half.data(), half.size(), dpl::dtype::f16);
  CHECK_THROWS_WITH(t.unscale(std::span<dpl::tensor_ref const>(&h, 1)),
                    Contains("expected F32, F64 or BF16 gradients, found F16"));
  // bf16: the f32 product rounded to bf16, exact for a power-of-two scale; infs found.
  std::vector<dpl::bf16> b16{dpl::bf16(3.0f * 256), dpl::bf16(-0.5f * 256), dpl::bf16(inf)};
  optim::grad_scaler u({.init_scale = 256.0});
  dpl::tensor_ref const bref(b16.data(), b16.size(), dpl::dtype::bf16);
  CHECK(u.unscale(std::span<dpl::tensor_ref const>(&bref, 1)));
  CHECK(static_cast<float>(b16[0]) == 3.0f);
  CHECK(static_cast<float>(b16[1]) == -0.5f);
  CHECK_THROWS_WITH(optim::grad_scaler({.growth_factor = 1.0}), Contains("growth_factor > 1"));
  CHECK_THROWS_WITH(optim::grad_scaler({.backoff_factor = 1.0}), Contains("backoff_factor in (0, 1)"));
  CHECK_THROWS_WITH(optim::grad_scaler({.growth_interval = 0}), Contains("growth_interval >= 1"));
  CHECK_THROWS_WITH(optim::grad_scaler({.init_scale = 1e39}), Contains("init_scale"));

  optim::grad_scaler off({.enabled = false});  // disabled: the loss as it is, every step taken
  CHECK(off.scale(2.5f) == 2.5f);
  one_grad bad{{inf}};
  auto const badrefs = bad.refs();
  CHECK_FALSE(off.unscale(badrefs));
  off.update();
}

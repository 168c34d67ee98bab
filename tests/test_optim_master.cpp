// F32 master copies of F16/BF16 parameters (optim::optimizer_options::master_weights):
//  - the update equals its definition element by element: the rule applied to an F32 copy with
//    the gradient widened to F32, then rounded to nearest even (a scalar SGD loop, and the F32
//    optimizer, itself checked against PyTorch's algorithms in test_optim.cpp, for Adam/AdamW);
//  - the master copy saves and loads with the rest of the state: a resumed run is bitwise the
//    uninterrupted one (the 16-bit parameters alone could not restore it);
//  - DDP over bf16 parameters on thread ranks equals one device bitwise;
//  - without the option 16-bit parameters are refused with a message naming it.
#include "models.hpp"
#include "scratch.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/optim/state.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;

namespace {

std::vector<std::size_t> const sizes = {5, 300, 1, 257};
constexpr std::size_t dim = 7;

/// A model whose parameters and gradients are T (f16, bf16 or float). Its gradient is the mean
/// over the batch's rows of x(r, (i + k) mod dim) / 8 for element i of parameter k: with the
/// small-integer data of test::dataset (exact), every mean and every rank average is exact in
/// bf16, so one device and DDP see the same gradient bits.
template <class T>
struct half_model {
  std::vector<std::vector<T>> w, g;
  explicit half_model(std::uint64_t seed) {
    test::rng r{seed};
    for (std::size_t s : sizes) {
      std::vector<T> v(s);
      for (auto& x : v) x = T(static_cast<float>((r.uniform() * 2 - 1) * 3));
      w.push_back(v);
      g.emplace_back(s, T(0.0f));
    }
  }
  std::vector<dpl::tensor_view<T>> parameters() {
    std::vector<dpl::tensor_view<T>> out;
    for (auto& v : w) out.push_back(dpl::view(v));
    return out;
  }
  std::vector<dpl::tensor_view<T>> gradients() {
    std::vector<dpl::tensor_view<T>> out;
    for (auto& v : g) out.push_back(dpl::view(v));
    return out;
  }
  float forward_backward(test::samples<float> const& s) {
    std::size_t const n = s.x.rows();
    for (std::size_t k = 0; k < w.size(); ++k)
      for (std::size_t i = 0; i < w[k].size(); ++i) {
        float sum = 0;
        for (std::size_t r = 0; r < n; ++r) sum += s.x.data()[r * dim + (i + k) % dim];
        g[k][i] = T(sum / static_cast<float>(n) * 0.125f);
      }
    return 0;
  }
};

test::dataset<float> batch(int t, std::size_t rows) {
  return test::dataset<float>::make(rows, dim, 900 + static_cast<std::uint64_t>(t), true);
}
double lr_at(int t) { return 0.05 / (1.0 + 0.3 * t) + (t % 3 == 0 ? 0.01 : 0.0); }

template <class T>
std::vector<std::uint16_t> bits_of(half_model<T> const& m) {
  std::vector<std::uint16_t> out;
  for (auto const& v : m.w)
    for (T x : v) out.push_back(x.bits);
  return out;
}

/// `steps` steps of `rule` over a 16-bit model and, as the reference, the rule over an F32 model
/// holding the master values with the gradients widened; checks the 16-bit parameters are the
/// reference rounded, and the master copies the reference, bit for bit, after every step.
template <class T, class Rule>
void check_against_f32(Rule const& rule) {
  half_model<T> m(3);
  half_model<float> ref(3);
  for (std::size_t k = 0; k < sizes.size(); ++k)
    for (std::size_t i = 0; i < sizes[k]; ++i) ref.w[k][i] = static_cast<float>(m.w[k][i]);
  optim::optimizer opt(m, rule, {.master_weights = true});
  optim::optimizer on_f32(ref, rule);
  for (int t = 1; t <= 20; ++t) {
    m.forward_backward(batch(t, 5).all());
    for (std::size_t k = 0; k < sizes.size(); ++k)
      for (std::size_t i = 0; i < sizes[k]; ++i) ref.g[k][i] = static_cast<float>(m.g[k][i]);
    opt.step(m, lr_at(t));
    on_f32.step(ref, lr_at(t));
    std::size_t wrong = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      REQUIRE(opt.has_master(k));
      auto const master = opt.master(k).template as<float>();
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        if (m.w[k][i].bits != T(ref.w[k][i]).bits) ++wrong;
        if (std::memcmp(&master.data()[i], &ref.w[k][i], sizeof(float)) != 0) ++wrong;
      }
    }
    INFO("step " << t);
    REQUIRE(wrong == 0);
  }
}

}  // namespace

TEST_CASE("a master-copy SGD step equals the scalar definition element by element", "[optim][master]") {
  half_model<dpl::bf16> m(1);
  std::vector<std::vector<float>> master, buf;
  for (auto const& v : m.w) {
    master.emplace_back();
    for (auto x : v) master.back().push_back(static_cast<float>(x));
    buf.emplace_back(v.size(), 0.0f);
  }
  float const mu = 0.9f, wd = 0.01f;
  optim::optimizer opt(m, optim::sgd({.momentum = 0.9, .weight_decay = 0.01, .nesterov = true}),
                       {.master_weights = true});
  for (int t = 1; t <= 20; ++t) {
    m.forward_backward(batch(t, 4).all());
    opt.step(m, lr_at(t));
    auto const lr = static_cast<float>(lr_at(t));
    std::size_t wrong = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k)
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        float d = static_cast<float>(m.g[k][i]) + wd * master[k][i];
        buf[k][i] = t == 1 ? d : buf[k][i] * mu + 1.0f * d;
        d = d + mu * buf[k][i];
        master[k][i] = master[k][i] - lr * d;
        if (m.w[k][i].bits != dpl::bf16(master[k][i]).bits) ++wrong;
      }
    INFO("step " << t);
    REQUIRE(wrong == 0);
  }
}

TEST_CASE("master-copy updates equal the F32 rule then rounding, bf16 and f16", "[optim][master]") {
  check_against_f32<dpl::bf16>(optim::sgd({.momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-3}));
  check_against_f32<dpl::bf16>(optim::adam({.weight_decay = 0.01}));
  check_against_f32<dpl::bf16>(optim::adamw());
  check_against_f32<dpl::f16>(optim::adam());
  check_against_f32<dpl::f16>(optim::sgd());
}

TEST_CASE("16-bit parameters without master_weights are refused, naming the option", "[optim][master][error]") {
  half_model<dpl::bf16> m(1);
  CHECK_THROWS_WITH(optim::optimizer(m, optim::adam()),
                    Catch::Contains("BF16") && Catch::Contains("master_weights = true"));
  half_model<float> f(1);
  optim::optimizer opt(f, optim::adam(), {.master_weights = true});  // no 16-bit parameter: no master
  CHECK(!opt.has_master(0));
  CHECK(opt.state_bytes() == 2 * (5 + 300 + 1 + 257) * sizeof(float));
}

TEST_CASE("the master copies save and load with the state: a resumed run is bitwise the straight one",
          "[optim][master][io]") {
  auto const dir = test::scratch_dir("test_optim_master", "resume");
  auto const rule = optim::adamw({.weight_decay = 0.05});
  half_model<dpl::bf16> straight(4);
  optim::optimizer s_opt(straight, rule, {.master_weights = true});
  half_model<dpl::bf16> first(4);
  optim::optimizer f_opt(first, rule, {.master_weights = true});
  for (int t = 1; t <= 20; ++t) {
    straight.forward_backward(batch(t, 4).all());
    s_opt.step(straight, lr_at(t));
    if (t <= 8) {
      first.forward_backward(batch(t, 4).all());
      f_opt.step(first, lr_at(t));
    }
  }
  auto const names = optim::state_dict(f_opt, first);
  std::size_t masters = 0;
  for (auto const& t : names) masters += t.name.ends_with(".master") && t.data.dtype() == dpl::dtype::f32;
  CHECK(masters == sizes.size());
  optim::save_state(dir / "opt.safetensors", f_opt, first);

  half_model<dpl::bf16> resumed = first;  // the 16-bit parameters at step 8
  optim::optimizer r_opt(resumed, rule, {.master_weights = true});
  half_model<dpl::bf16> no_state = first;
  optim::optimizer n_opt(no_state, rule, {.master_weights = true});
  optim::load_state(dir / "opt.safetensors", r_opt, resumed);
  CHECK(r_opt.steps() == 8);
  for (int t = 9; t <= 20; ++t) {
    resumed.forward_backward(batch(t, 4).all());
    r_opt.step(resumed, lr_at(t));
    no_state.forward_backward(batch(t, 4).all());
    n_opt.step(no_state, lr_at(t));
  }
  CHECK(bits_of(resumed) == bits_of(straight));
  CHECK(bits_of(no_state) != bits_of(straight));  // the 16-bit parameters alone do not resume it
}

TEST_CASE("DDP over bf16 parameters with master copies equals one device bitwise", "[optim][master][ddp][contract]") {
  using model = half_model<dpl::bf16>;
  auto const rule = optim::adamw({.weight_decay = 0.02});
  constexpr int steps = 20;
  for (int world : {2, 3}) {
    INFO("world " << world);
    auto const rows = static_cast<std::size_t>(2 * world);
    model one(6);
    optim::optimizer one_opt(one, rule, {.master_weights = true});
    for (int t = 1; t <= steps; ++t) {
      one.forward_backward(batch(t, rows).all());
      one_opt.step(one, lr_at(t));
    }
    std::vector<std::vector<std::uint16_t>> got(static_cast<std::size_t>(world));
    dpl::spawn(world, [&](dpl::rank_context& rank) {
      model m(6);
      dpl::distributed_data_parallel<model> ddp(m, rank.group(), {.bucket_cap_mb = 256.0 / (1024 * 1024)});
      optim::optimizer ropt(ddp, rule, {.master_weights = true});
      for (int t = 1; t <= steps; ++t) {
        auto const d = batch(t, rows);
        auto const lo = static_cast<std::size_t>(rank.rank()) * 2;
        ddp.step(dpl::slice_batch(d.all(), lo, lo + 2), [](model& x, test::samples<float> s) { return x.forward_backward(s); });
        ropt.step(ddp, lr_at(t));
      }
      got[static_cast<std::size_t>(rank.rank())] = bits_of(m);
    });
    for (auto const& g : got) CHECK(g == bits_of(one));
  }
}

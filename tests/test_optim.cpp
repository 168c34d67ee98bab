// The update rules against PyTorch's documented algorithms (torch.optim.SGD, Adam, AdamW),
// written plainly here as scalar f32 loops, element by element over 20 steps with a changing
// learning rate. Each reference performs the same operations in the same order as the rule (the
// order of PyTorch's implementation, e.g. Adam's step size lr / (1 - beta1^t) and its denominator
// sqrt(v) / sqrt(1 - beta2^t) + eps), so the comparison is bitwise.
#include "models.hpp"

#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/sgd.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;

namespace {

constexpr std::size_t n = 97;
constexpr int steps = 20;

/// Step t's learning rate (t = 1..20): changes every step.
double lr_at(int t) { return 0.05 / (1.0 + 0.3 * t) + (t % 3 == 0 ? 0.01 : 0.0); }

/// Parameters and per-step gradients: mixed signs and magnitudes, some exact zeros.
std::vector<float> initial(std::uint64_t seed) {
  test::rng g{seed};
  std::vector<float> p(n);
  for (auto& v : p) v = static_cast<float>((g.uniform() * 2 - 1) * 3);
  return p;
}
std::vector<float> gradient(std::uint64_t seed, int t) {
  test::rng g{seed * 1000 + static_cast<std::uint64_t>(t)};
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    double const u = g.uniform() * 2 - 1;
    out[i] = i % 17 == 0 ? 0.0f : static_cast<float>(u * std::pow(10.0, static_cast<double>(i % 7) - 4));
  }
  return out;
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Runs `rule` for 20 steps over the whole vector, or (split > 0) in two stretches [0, split) and
/// [split, n) as a ZeRO-1 shard would; returns the parameters and the slots.
template <class Rule>
std::vector<std::vector<float>> run_rule(Rule const& rule, std::uint64_t seed, std::size_t split = 0) {
  std::vector<float> p = initial(seed);
  std::vector<std::vector<float>> slots(Rule::slot_count, std::vector<float>(n, 0.0f));
  for (int t = 1; t <= steps; ++t) {
    auto const g = gradient(seed, t);
    auto const c = rule.constants(static_cast<std::uint64_t>(t), lr_at(t));
    auto part = [&](std::size_t lo, std::size_t hi) {
      std::vector<float*> s;
      for (auto& v : slots) s.push_back(v.data() + lo);
      rule.apply(c, std::span<float>(p.data() + lo, hi - lo), std::span<float const>(g.data() + lo, hi - lo), s);
    };
    if (split == 0) {
      part(0, n);
    } else {
      part(0, split);
      part(split, n);
    }
  }
  slots.insert(slots.begin(), p);
  return slots;
}

/// torch.optim.SGD's documented algorithm, plainly (f32 values, hyperparameters rounded to f32
/// as PyTorch passes them to its f32 kernels).
std::vector<std::vector<float>> reference_sgd(optim::sgd_options o, std::uint64_t seed) {
  std::vector<float> p = initial(seed), b(n, 0.0f);
  auto const mu = static_cast<float>(o.momentum), wd = static_cast<float>(o.weight_decay);
  auto const keep = static_cast<float>(1 - o.dampening);
  for (int t = 1; t <= steps; ++t) {
    auto const g = gradient(seed, t);
    auto const lr = static_cast<float>(lr_at(t));
    for (std::size_t i = 0; i < n; ++i) {
      float d = g[i];
      if (wd != 0) d = d + wd * p[i];
      if (mu != 0) {
        if (t == 1) b[i] = d;  // the buffer starts as the gradient: no dampening
        else b[i] = b[i] * mu + keep * d;
        if (o.nesterov) d = d + mu * b[i];
        else d = b[i];
      }
      p[i] = p[i] - lr * d;
    }
  }
  return {p, b};
}

/// torch.optim.Adam / AdamW's documented algorithm, plainly.
std::vector<std::vector<float>> reference_adam(bool decoupled, optim::adam_options o, std::uint64_t seed) {
  std::vector<float> p = initial(seed), m(n, 0.0f), v(n, 0.0f);
  double const wd = o.weight_decay.value_or(decoupled ? 1e-2 : 0.0);
  auto const b1 = static_cast<float>(o.beta1), b2 = static_cast<float>(o.beta2), eps = static_cast<float>(o.eps);
  for (int t = 1; t <= steps; ++t) {
    auto const g = gradient(seed, t);
    double const lr = lr_at(t);
    double const bias1 = 1 - std::pow(o.beta1, t), bias2 = 1 - std::pow(o.beta2, t);
    auto const step_size = static_cast<float>(lr / bias1);
    auto const bias2_sqrt = static_cast<float>(std::sqrt(bias2));
    for (std::size_t i = 0; i < n; ++i) {
      float gi = g[i];
      if (decoupled) p[i] = p[i] * static_cast<float>(1 - lr * wd);
      else if (wd != 0) gi = gi + static_cast<float>(wd) * p[i];
      m[i] = m[i] * b1 + static_cast<float>(1 - o.beta1) * gi;
      v[i] = v[i] * b2 + static_cast<float>(1 - o.beta2) * gi * gi;
      float const denom = std::sqrt(v[i]) / bias2_sqrt + eps;
      p[i] = p[i] - step_size * m[i] / denom;
    }
  }
  return {p, m, v};
}

}  // namespace

TEST_CASE("SGD equals PyTorch's algorithm bitwise, whole or in stretches", "[optim][sgd]") {
  std::vector<optim::sgd_options> const configs = {
      {},
      {.momentum = 0.9},
      {.momentum = 0.8, .dampening = 0.3},
      {.momentum = 0.9, .nesterov = true},
      {.momentum = 0.7, .weight_decay = 1e-2},
      {.weight_decay = 5e-2},
      {.momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-3},
      {.momentum = 0.95, .weight_decay = 1e-4, .nesterov = true},
  };
  std::uint64_t seed = 1;
  for (auto const& o : configs) {
    INFO("momentum " << o.momentum << ", dampening " << o.dampening << ", weight_decay " << o.weight_decay
                     << ", nesterov " << o.nesterov);
    optim::sgd const rule(o);
    auto const got = run_rule(rule, seed);
    auto const want = reference_sgd(o, seed);
    CHECK(same_bits(got[0], want[0]));
    if (o.momentum != 0) CHECK(same_bits(got[1], want[1]));
    CHECK(rule.active_slots() == (o.momentum != 0 ? 1u : 0u));
    auto const split = run_rule(rule, seed, 41);
    CHECK(same_bits(split[0], got[0]));
    CHECK(!same_bits(got[0], initial(seed)));
    ++seed;
  }
}

TEST_CASE("Adam and AdamW equal PyTorch's algorithms bitwise, whole or in stretches", "[optim][adam]") {
  std::vector<optim::adam_options> const configs = {
      {},
      {.weight_decay = 1e-2},
      {.beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6},
      {.beta1 = 0.0, .beta2 = 0.5, .eps = 1e-3, .weight_decay = 0.1},
      {.weight_decay = 0.0},
  };
  std::uint64_t seed = 20;
  for (bool decoupled : {false, true}) {
    for (auto const& o : configs) {
      INFO((decoupled ? "adamw" : "adam") << ": betas " << o.beta1 << ", " << o.beta2 << ", eps " << o.eps
                                          << ", weight_decay " << o.weight_decay.value_or(-1));
      auto const got = decoupled ? run_rule(optim::adamw(o), seed) : run_rule(optim::adam(o), seed);
      auto const want = reference_adam(decoupled, o, seed);
      for (std::size_t k = 0; k < 3; ++k) CHECK(same_bits(got[k], want[k]));
      auto const split = decoupled ? run_rule(optim::adamw(o), seed, 13) : run_rule(optim::adam(o), seed, 13);
      CHECK(split == got);
      CHECK(!same_bits(got[0], initial(seed)));
      ++seed;
    }
  }
}

TEST_CASE("Adam's and AdamW's defaults are PyTorch's", "[optim][adam]") {
  optim::adam const a;
  optim::adamw const w;
  CHECK(optim::adam::default_lr == 1e-3);
  CHECK(a.options().beta1 == 0.9);
  CHECK(a.options().beta2 == 0.999);
  CHECK(a.options().eps == 1e-8);
  CHECK(*a.options().weight_decay == 0.0);
  CHECK(*w.options().weight_decay == 1e-2);
  // AdamW decays even a parameter whose gradient is zero; Adam (no weight decay) leaves it.
  float pa = 2.0f, pw = 2.0f, m = 0, v = 0;
  float* s[2] = {&m, &v};
  a.apply(a.constants(1, 1e-3), std::span<float>(&pa, 1), std::vector<float>{0.0f}, s);
  m = v = 0;
  w.apply(w.constants(1, 1e-3), std::span<float>(&pw, 1), std::vector<float>{0.0f}, s);
  CHECK(pa == 2.0f);
  CHECK(pw == 2.0f * static_cast<float>(1 - 1e-3 * 1e-2));
}

TEST_CASE("bad hyperparameters are rejected with PyTorch's rules", "[optim][error]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(optim::sgd({.momentum = -0.1}), Contains("momentum") && Contains(">= 0") && Contains("-0.1"));
  CHECK_THROWS_WITH(optim::sgd({.weight_decay = -1}), Contains("weight_decay"));
  CHECK_THROWS_WITH(optim::sgd({.nesterov = true}), Contains("Nesterov") && Contains("momentum > 0"));
  CHECK_THROWS_WITH(optim::sgd({.momentum = 0.9, .dampening = 0.1, .nesterov = true}),
                    Contains("Nesterov") && Contains("zero dampening"));
  CHECK_THROWS_WITH(optim::sgd().constants(1, -0.1), Contains("learning rate") && Contains("-0.1"));
  CHECK_THROWS_WITH(optim::sgd().constants(1, NAN), Contains("learning rate"));
  CHECK_THROWS_WITH(optim::adam({.beta1 = 1.0}), Contains("optim::adam: beta1") && Contains("[0, 1)"));
  CHECK_THROWS_WITH(optim::adamw({.beta2 = -0.5}), Contains("optim::adamw: beta2"));
  CHECK_THROWS_WITH(optim::adam({.eps = -1e-8}), Contains("eps"));
  CHECK_THROWS_WITH(optim::adamw({.weight_decay = -0.1}), Contains("weight_decay"));
  CHECK_THROWS_WITH(optim::adam().constants(1, -1e-3), Contains("learning rate"));
  CHECK_THROWS_WITH(optim::adam().constants(0, 1e-3), Contains("step number >= 1"));
  CHECK_THROWS_AS(optim::adam({.beta1 = 1.5}), dpl::invalid_argument);
  CHECK_NOTHROW(optim::sgd({.momentum = 0.9, .nesterov = true}));
}

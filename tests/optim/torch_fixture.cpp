// Runs each update rule of dparallel::optim for 20 steps on fixed inputs and prints, as JSON, the
// inputs and the results, for tests/optim/check_torch.py to replay with PyTorch's optimizers.
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/sgd.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr std::size_t n = 64;
constexpr int steps = 20;

std::string list(std::vector<float> const& v) {
  std::string s = "[";
  char buf[32];
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%s%.9g", i == 0 ? "" : ",", static_cast<double>(v[i]));
    s += buf;
  }
  return s + "]";
}

/// Values in [-scale, scale) from a linear congruential generator.
std::vector<float> values(std::uint64_t& state, float scale) {
  std::vector<float> v(n);
  for (auto& x : v) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    x = (static_cast<float>(state >> 40) / static_cast<float>(1u << 24) * 2 - 1) * scale;
  }
  return v;
}

template <class Rule>
void run(Rule const& rule, char const* name, char const* options, bool last) {
  std::uint64_t state = 12345;
  std::vector<float> p = values(state, 1.0f), p0 = p;
  std::vector<std::vector<float>> slots(Rule::slot_count, std::vector<float>(n, 0.0f));
  std::vector<float*> s;
  for (auto& v : slots) s.push_back(v.data());
  std::string grads = "[", lrs = "[";
  for (int t = 1; t <= steps; ++t) {
    auto const g = values(state, 0.1f);
    double const lr = 0.01 * (1 + t % 3);
    rule.apply(rule.constants(static_cast<std::uint64_t>(t), lr), p, g, s);
    grads += (t == 1 ? "" : ",") + list(g);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.17g", t == 1 ? "" : ",", lr);  // reads back as the same double
    lrs += buf;
  }
  std::printf("{\"rule\":\"%s\",\"options\":%s,\"p0\":%s,\"grads\":%s],\"lrs\":%s],\"p\":%s}%s\n", name, options,
              list(p0).c_str(), grads.c_str(), lrs.c_str(), list(p).c_str(), last ? "" : ",");
}

}  // namespace

int main() {
  namespace optim = dparallel::optim;
  std::printf("[\n");
  run(optim::sgd({.momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01}), "sgd",
      R"({"momentum":0.9,"dampening":0.1,"weight_decay":0.01,"nesterov":false})", false);
  run(optim::sgd({.momentum = 0.9, .weight_decay = 0.01, .nesterov = true}), "sgd",
      R"({"momentum":0.9,"dampening":0.0,"weight_decay":0.01,"nesterov":true})", false);
  run(optim::adam({.weight_decay = 0.01}), "adam", R"({"betas":[0.9,0.999],"eps":1e-8,"weight_decay":0.01})", false);
  run(optim::adamw(), "adamw", R"({"betas":[0.9,0.999],"eps":1e-8,"weight_decay":0.01})", true);
  std::printf("]\n");
}

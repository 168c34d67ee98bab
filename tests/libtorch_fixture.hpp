#pragma once
// The libtorch tests' reference module and its one-device training (test_libtorch.cpp,
// test_libtorch_semantics.cpp).
#include <dparallel/adapters/libtorch.hpp>
#include <dparallel/core/device.hpp>

#include <tuple>
#include <vector>

namespace libtorch_fixture {

namespace dpl = dparallel;

// The reference module: two linear layers, a tanh, and a buffer the output is scaled by.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
    scale = register_buffer("scale", torch::full({3}, 0.5));
  }
  torch::Tensor forward(torch::Tensor const& x) { return fc2(torch::tanh(fc1(x))) * scale; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Net);

using batch_t = std::tuple<torch::Tensor, torch::Tensor>;

struct fixture {
  Net init;
  torch::Tensor x, y;  // 12 samples
  fixture() {
    torch::set_num_threads(1);  // the devices are the threads; no oversubscription on small machines
    torch::manual_seed(5);
    init = Net();
    init->to(torch::kDouble);
    x = torch::randn({12, 6}, torch::kDouble);
    y = torch::randn({12, 3}, torch::kDouble);
  }
  [[nodiscard]] Net copy() const { return dpl::model_traits<Net>::make_replica(init, dpl::host_memory); }
};

// The gradient of the shard's mean loss, by ordinary autograd code.
inline void step_fn(Net& m, batch_t b) {
  torch::mse_loss(m->forward(std::get<0>(b)), std::get<1>(b)).backward();
}

constexpr int steps = 20;
constexpr double lr = 0.1;

inline torch::Tensor flat(Net& m) {
  std::vector<torch::Tensor> parts;
  for (auto const& p : m->parameters()) parts.push_back(p.detach().flatten().clone());
  return torch::cat(parts);
}

inline double relative(torch::Tensor const& a, torch::Tensor const& ref) {
  return (a - ref).abs().max().item<double>() / ref.abs().max().item<double>();
}

// The one-device reference: `steps` SGD steps on the whole batch.
inline torch::Tensor one_device(fixture const& f) {
  Net m = f.copy();
  torch::optim::SGD opt(m->parameters(), lr);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    step_fn(m, batch_t{f.x, f.y});
    opt.step();
  }
  return flat(m);
}

inline std::vector<dpl::device> host_devices(int n) {
  std::vector<dpl::device> d;
  for (int i = 0; i < n; ++i) d.push_back(dpl::device{dpl::device_kind::host, i});
  return d;
}

}  // namespace libtorch_fixture

// The optimizers' CUDA kernels against the host rules: the same gradients over 20 steps with a
// changing learning rate give bitwise the host's parameters and state, for every rule. Without a
// GPU every test reports skipped (gpu_main.cpp).
#include "../models.hpp"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/backend/cuda/optim_kernels.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/sgd.hpp>

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;

namespace {

std::vector<std::size_t> const sizes = {1, 7, 300, 1025, 4};

/// Parameters and gradients in GPU 0's memory (the host side is test::chunked<float>).
struct gpu_model {
  std::vector<dpl::cuda::device_buffer<float>> w, g;
  std::vector<dpl::tensor_view<float>> parameters() {
    std::vector<dpl::tensor_view<float>> out;
    for (auto& b : w) out.push_back(b.view());
    return out;
  }
  std::vector<dpl::tensor_view<float>> gradients() {
    std::vector<dpl::tensor_view<float>> out;
    for (auto& b : g) out.push_back(b.view());
    return out;
  }
};

void upload(dpl::cuda::device_buffer<float>& dst, std::vector<float> const& src) {
  REQUIRE(cudaMemcpy(dst.data(), src.data(), src.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
}
std::vector<float> download(dpl::tensor_ref t) {
  std::vector<float> out(t.size());
  REQUIRE(cudaMemcpy(out.data(), t.data(), t.size_bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
  return out;
}

template <class Rule>
void check_rule(Rule const& rule) {
  dpl::device const gpu{dpl::device_kind::cuda, 0, 0};
  test::chunked<float> h(sizes);
  gpu_model d;
  test::rng r{42};
  for (std::size_t p = 0; p < sizes.size(); ++p) {
    for (auto& v : h.w[p]) v = static_cast<float>(r.uniform() * 4 - 2);
    d.w.emplace_back(sizes[p], gpu);
    d.g.emplace_back(sizes[p], gpu);
    upload(d.w.back(), h.w[p]);
  }
  optim::optimizer<Rule> on_host(h, rule);
  optim::optimizer<Rule, dpl::cuda::backend> on_gpu(d, rule);
  CHECK(on_gpu.state_device() == gpu);
  for (int t = 1; t <= 20; ++t) {
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      for (std::size_t i = 0; i < sizes[p]; ++i)
        h.g[p][i] = i % 11 == 0 ? 0.0f : static_cast<float>((r.uniform() * 2 - 1) * std::pow(10.0, double(i % 5) - 3));
      upload(d.g[p], h.g[p]);
    }
    double const lr = 0.01 / t + 1e-4 * (t % 3);
    on_host.step(h, lr);
    on_gpu.step(d, lr);
  }
  for (std::size_t p = 0; p < sizes.size(); ++p) {
    INFO("parameter " << p);
    auto const got = download(d.w[p].view());
    CHECK(std::memcmp(got.data(), h.w[p].data(), got.size() * sizeof(float)) == 0);
    for (std::size_t k = 0; k < on_host.slots_kept(); ++k) {
      auto const slot = download(on_gpu.slot(p, k));
      CHECK(std::memcmp(slot.data(), on_host.slot(p, k).data(), slot.size() * sizeof(float)) == 0);
    }
  }
  CHECK(on_gpu.steps() == 20);
}

}  // namespace

TEST_CASE("CUDA optimizer kernels equal the host rules bitwise", "[cuda][optim]") {
  SECTION("sgd") { check_rule(optim::sgd()); }
  SECTION("sgd with momentum, dampening and weight decay") {
    check_rule(optim::sgd({.momentum = 0.9, .dampening = 0.2, .weight_decay = 1e-3}));
  }
  SECTION("sgd nesterov") { check_rule(optim::sgd({.momentum = 0.9, .nesterov = true})); }
  SECTION("adam") { check_rule(optim::adam({.weight_decay = 1e-2})); }
  SECTION("adamw") { check_rule(optim::adamw()); }
}

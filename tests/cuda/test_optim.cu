// The optimizers' CUDA kernels against the host rules: the same gradients over 20 steps with a
// changing learning rate give bitwise the host's parameters and state, for every rule. Without a
// GPU every test reports skipped (gpu_main.cpp).
#include "../models.hpp"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/optim/cuda/kernels.hpp>
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

/// Parameters and gradients of T (bf16, f16) in GPU 0's memory, and the same on the host.
template <class T>
struct half_models {
  std::vector<std::vector<T>> hw, hg;
  std::vector<dpl::cuda::device_buffer<T>> dw, dg;
};
template <class T>
struct half_view {
  std::vector<std::vector<T>>* hw = nullptr;
  std::vector<std::vector<T>>* hg = nullptr;
  std::vector<dpl::tensor_view<T>> parameters() {
    std::vector<dpl::tensor_view<T>> out;
    for (auto& v : *hw) out.push_back(dpl::view(v));
    return out;
  }
  std::vector<dpl::tensor_view<T>> gradients() {
    std::vector<dpl::tensor_view<T>> out;
    for (auto& v : *hg) out.push_back(dpl::view(v));
    return out;
  }
};
template <class T>
struct half_gpu {
  std::vector<dpl::cuda::device_buffer<T>>* dw = nullptr;
  std::vector<dpl::cuda::device_buffer<T>>* dg = nullptr;
  std::vector<dpl::tensor_view<T>> parameters() {
    std::vector<dpl::tensor_view<T>> out;
    for (auto& b : *dw) out.push_back(b.view());
    return out;
  }
  std::vector<dpl::tensor_view<T>> gradients() {
    std::vector<dpl::tensor_view<T>> out;
    for (auto& b : *dg) out.push_back(b.view());
    return out;
  }
};

/// The master-copy update on the GPU against the host's: the 16-bit parameters and the F32 master
/// copies bitwise after 20 steps.
template <class T, class Rule>
void check_master(Rule const& rule) {
  dpl::device const gpu{dpl::device_kind::cuda, 0, 0};
  half_models<T> m;
  test::rng r{7};
  for (std::size_t s : sizes) {
    std::vector<T> w(s);
    for (auto& v : w) v = T(static_cast<float>(r.uniform() * 4 - 2));
    m.hw.push_back(w);
    m.hg.emplace_back(s, T(0.0f));
    m.dw.emplace_back(s, gpu);
    m.dg.emplace_back(s, gpu);
    REQUIRE(cudaMemcpy(m.dw.back().data(), w.data(), s * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  half_view<T> h{&m.hw, &m.hg};
  half_gpu<T> d{&m.dw, &m.dg};
  optim::optimizer<Rule> on_host(h, rule, {.master_weights = true});
  optim::optimizer<Rule, dpl::cuda::backend> on_gpu(d, rule, {.master_weights = true});
  for (int t = 1; t <= 20; ++t) {
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      for (auto& v : m.hg[p]) v = T(static_cast<float>((r.uniform() * 2 - 1) * 0.1));
      REQUIRE(cudaMemcpy(m.dg[p].data(), m.hg[p].data(), sizes[p] * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    }
    on_host.step(h, 0.01 / t);
    on_gpu.step(d, 0.01 / t);
  }
  for (std::size_t p = 0; p < sizes.size(); ++p) {
    INFO("parameter " << p);
    std::vector<T> got(sizes[p]);
    REQUIRE(cudaMemcpy(got.data(), m.dw[p].data(), sizes[p] * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(std::memcmp(got.data(), m.hw[p].data(), sizes[p] * sizeof(T)) == 0);
    auto const master = download(on_gpu.master(p));
    CHECK(std::memcmp(master.data(), on_host.master(p).data(), master.size() * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_CASE("CUDA master-copy updates of bf16 and f16 parameters equal the host's bitwise", "[cuda][optim][master]") {
  SECTION("bf16 adamw") { check_master<dpl::bf16>(optim::adamw()); }
  SECTION("bf16 sgd with momentum") { check_master<dpl::bf16>(optim::sgd({.momentum = 0.9, .weight_decay = 1e-3})); }
  SECTION("f16 adam") { check_master<dpl::f16>(optim::adam()); }
}

TEST_CASE("CUDA optimizer kernels equal the host rules bitwise", "[cuda][optim]") {
  SECTION("sgd") { check_rule(optim::sgd()); }
  SECTION("sgd with momentum, dampening and weight decay") {
    check_rule(optim::sgd({.momentum = 0.9, .dampening = 0.2, .weight_decay = 1e-3}));
  }
  SECTION("sgd nesterov") { check_rule(optim::sgd({.momentum = 0.9, .nesterov = true})); }
  SECTION("adam") { check_rule(optim::adam({.weight_decay = 1e-2})); }
  SECTION("adamw") { check_rule(optim::adamw()); }
}

// ZeRO-1 on the CUDA backend (NCCL engine): ddp_zero1 + zero_redundancy_optimizer with the CUDA
// optimizer kernels gives bitwise the parameters of DDP + optim::optimizer<Rule, cuda::backend>
// after 20 steps, on every rank, with default and with tiny buckets (a bucket of fewer elements
// than ranks). The world is one thread rank per GPU present, at most 2: with two ranks a
// reduce-scatter and an all-reduce add the same two values (commutative), so NCCL's sums agree
// bit for bit; beyond two NCCL does not promise the same order. Without a GPU every test reports
// skipped (gpu_main.cpp); with one GPU it runs a world of one. The same for bf16 parameters with
// F32 master shards (zero_options::master_weights) against DDP with master weights: the CUDA
// master-copy kernels on each rank's shard, NCCL's bf16 reduce-scatter and all-gather.
#include "test_zero_common.hpp"
#include "zero_train.cuh"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/optim/cuda/kernels.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;

namespace {

using namespace test::zero_cuda;

/// The GPUs of the world: one per device present, at most 2.
std::vector<dpl::device> world_gpus() {
  int n = 0;
  dpl::cuda::check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  std::vector<dpl::device> out;
  for (int i = 0; i < n && i < 2; ++i) out.push_back({dpl::device_kind::cuda, i, 0});
  return out;
}

/// Runs fn(r) on one thread per rank r of `world`; rethrows the first rank's failure.
template <class F>
void on_ranks(std::size_t world, F fn) {
  std::vector<std::exception_ptr> failed(world);
  std::vector<std::thread> ranks;
  for (std::size_t r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        failed[r] = std::current_exception();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (auto const& e : failed)
    if (e) std::rethrow_exception(e);
}

/// Every rank's parameters after `steps` steps of `rule` (zero_train.cuh), one thread per rank.
template <class Rule>
std::vector<std::vector<float>> train(bool zero, Rule const& rule, dpl::options opts) {
  auto const gpus = world_gpus();
  auto groups = dpl::nccl::make_groups(gpus);
  std::vector<std::vector<float>> out(gpus.size());
  on_ranks(gpus.size(), [&](std::size_t r) { out[r] = train_rank(zero, rule, opts, groups[r], gpus[r]); });
  return out;
}

template <class Rule>
void check_zero_equals_ddp(Rule const& rule) {
  dpl::options const tiny{.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024)};
  for (bool small : {false, true}) {
    INFO((small ? "tiny buckets" : "default buckets") << ", world " << world_gpus().size());
    auto const ddp = train(false, rule, small ? tiny : dpl::options{});
    auto const zero = train(true, rule, small ? tiny : dpl::options{});
    auto const start = bits_of(model(dim, 3));
    CHECK(!same_bits(ddp[0], start));  // it trained
    for (std::size_t r = 0; r < zero.size(); ++r) {
      INFO("rank " << r);
      CHECK(same_bits(zero[r], ddp[0]));
      CHECK(same_bits(ddp[r], ddp[0]));
    }
  }
}

/// test::half_chunked's bf16 parameters and gradients in GPU memory. Its gradients are computed on
/// the host (half_chunked's arithmetic, from the parameters downloaded) and uploaded on the
/// current stream: what this test exercises is the optimizer's path on the GPU, not model kernels.
struct gpu_half {
  using buf = dpl::cuda::device_buffer<dpl::bf16>;
  dpl::device dev;
  test::half_chunked<dpl::bf16> host;
  std::vector<buf> w, g;
  gpu_half(dpl::device d, std::uint64_t seed) : dev(d), host(test::zero_sizes(), seed) {
    dpl::cuda::device_guard const guard(dev.index);
    for (auto const& v : host.w) {
      w.emplace_back(v.size(), dev);
      g.emplace_back(v.size(), dev);
      dpl::cuda::check(cudaMemcpy(w.back().data(), v.data(), v.size() * 2, cudaMemcpyHostToDevice), "upload");
    }
  }
  std::vector<dpl::tensor_view<dpl::bf16>> parameters() {
    std::vector<dpl::tensor_view<dpl::bf16>> out;
    for (auto& b : w) out.push_back(b.view());
    return out;
  }
  std::vector<dpl::tensor_view<dpl::bf16>> gradients() {
    std::vector<dpl::tensor_view<dpl::bf16>> out;
    for (auto& b : g) out.push_back(b.view());
    return out;
  }
  void forward_backward(test::samples<float> const& s) {
    dpl::cuda::device_guard const guard(dev.index);
    cudaStream_t const st = dpl::cuda::current_stream();
    dpl::cuda::check(cudaStreamSynchronize(st), "sync");
    dpl::cuda::check(cudaDeviceSynchronize(), "sync");  // the last update and gather, whatever their stream
    for (std::size_t k = 0; k < w.size(); ++k)
      dpl::cuda::check(cudaMemcpy(host.w[k].data(), w[k].data(), host.w[k].size() * 2, cudaMemcpyDeviceToHost), "down");
    host.forward_backward(s);
    for (std::size_t k = 0; k < g.size(); ++k)
      dpl::cuda::check(cudaMemcpyAsync(g[k].data(), host.g[k].data(), host.g[k].size() * 2, cudaMemcpyHostToDevice, st),
                       "up");
    dpl::cuda::check(cudaStreamSynchronize(st), "sync");
  }
  std::vector<std::uint16_t> bits() {
    dpl::cuda::device_guard const guard(dev.index);
    dpl::cuda::check(cudaDeviceSynchronize(), "sync");
    std::vector<std::uint16_t> out;
    for (auto const& b : w) {
      std::vector<std::uint16_t> v(b.size());
      dpl::cuda::check(cudaMemcpy(v.data(), b.data(), v.size() * 2, cudaMemcpyDeviceToHost), "down");
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
};

/// Every rank's bf16 parameter bits after `steps` steps of AdamW with master weights: ZeRO-1 with
/// master shards, or DDP with optim::optimizer<adamw, cuda::backend> and master weights.
std::vector<std::vector<std::uint16_t>> train_half(bool zero, dpl::options opts) {
  auto const gpus = world_gpus();
  auto groups = dpl::nccl::make_groups(gpus);
  auto const world = gpus.size();
  optim::adamw const rule({.weight_decay = 0.05});
  std::vector<std::vector<std::uint16_t>> out(world);
  on_ranks(world, [&](std::size_t r) {
    dpl::options o = opts;
    o.local_device = gpus[r];
    gpu_half m(gpus[r], 7 + r);  // differs until broadcast
    auto run = [&](auto& w, auto& opt) {
      for (int t = 1; t <= steps; ++t) {
        auto const d = test::dataset<float>::make(4 * world, m.host.dim, static_cast<std::uint64_t>(t), false);
        w.step(dpl::slice_batch(d.all(), r * 4, (r + 1) * 4), [](gpu_half& x, test::samples<float> s) { x.forward_backward(s); });
        opt.step(w, lr_at(t));
      }
    };
    if (zero) {
      dpl::parallel<gpu_half, dpl::ddp_zero1, gpu> w(m, groups[r], o);
      dpl::optim::zero_redundancy_optimizer opt(w, rule, {.master_weights = true});
      run(w, opt);
    } else {
      dpl::parallel<gpu_half, dpl::ddp, gpu> w(m, groups[r], o);
      optim::optimizer<optim::adamw, gpu> opt(w, rule, {.master_weights = true});
      run(w, opt);
    }
    out[r] = m.bits();
  });
  return out;
}

}  // namespace

TEST_CASE("ZeRO-1 over bf16 parameters with F32 master shards on the CUDA backend equals DDP with master weights",
          "[cuda][nccl][zero][master]") {
  for (bool small : {false, true}) {
    INFO((small ? "tiny buckets" : "default buckets") << ", world " << world_gpus().size());
    dpl::options const o = small ? test::zero_tiny_buckets() : dpl::options{};
    auto const ddp = train_half(false, o);
    auto const zero = train_half(true, o);
    CHECK(ddp[0] != gpu_half(world_gpus()[0], 7).bits());  // it trained
    for (std::size_t r = 0; r < zero.size(); ++r) {
      INFO("rank " << r);
      CHECK(zero[r] == ddp[0]);
      CHECK(ddp[r] == ddp[0]);
    }
  }
}

TEST_CASE("ZeRO-1 on the CUDA backend equals DDP bitwise after 20 steps", "[cuda][nccl][zero]") {
  SECTION("adamw") { check_zero_equals_ddp(optim::adamw({.weight_decay = 0.05})); }
  SECTION("sgd with momentum") { check_zero_equals_ddp(optim::sgd({.momentum = 0.9, .nesterov = true})); }
}

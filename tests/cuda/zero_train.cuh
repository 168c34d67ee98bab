#pragma once
// One rank's training for the ZeRO-1 vs DDP check on the CUDA backend over any NCCL group (thread
// ranks in test_zero.cu, processes in nccl_ranks.cu): `steps` steps of `rule` over
// test::cuda_linreg<float>, each rank on its rows of the same global batches; with `zero`,
// ddp_zero1 + zero_redundancy_optimizer, else ddp + optim::optimizer. Returns the parameters' bits.
#include "cuda_linreg.cuh"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/optim/cuda/kernels.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace test::zero_cuda {

using gpu = dparallel::cuda::backend;
using model = test::cuda_linreg<float>;

constexpr std::size_t dim = 37;
constexpr std::size_t rows_per_rank = 6;
constexpr int steps = 20;

inline double lr_at(int t) { return 0.01 / (1.0 + 0.1 * t); }

inline std::vector<float> bits_of(model const& m) {
  auto const h = m.to_host();
  std::vector<float> out = h.w;
  out.insert(out.end(), h.b.begin(), h.b.end());
  return out;
}

inline bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// This rank's parameters after `steps` steps (rank group.rank() of group.size(), on `d`).
template <class Rule>
std::vector<float> train_rank(bool zero, Rule const& rule, dparallel::options o, dparallel::process_group const& group,
                              dparallel::device d) {
  namespace dpl = dparallel;
  auto const r = static_cast<std::size_t>(group.rank());
  auto const world = static_cast<std::size_t>(group.size());
  o.local_device = d;
  model m(dim, 3, d);
  auto run = [&](auto& w, auto& opt) {
    for (int t = 1; t <= steps; ++t) {
      auto const data = test::dataset<float>::make(rows_per_rank * world, dim, 70 + static_cast<std::uint64_t>(t), false);
      w.step(dpl::slice_batch(data.all(), r * rows_per_rank, (r + 1) * rows_per_rank),
             [](model& x, test::samples<float> s) { return x.forward_backward(s); });
      opt.step(w, lr_at(t));
    }
  };
  if (zero) {
    dpl::parallel<model, dpl::ddp_zero1, gpu> w(m, group, o);
    dpl::optim::zero_redundancy_optimizer opt(w, rule);
    run(w, opt);
  } else {
    dpl::parallel<model, dpl::ddp, gpu> w(m, group, o);
    dpl::optim::optimizer<Rule, gpu> opt(w, rule);
    run(w, opt);
  }
  dpl::cuda::check(cudaDeviceSynchronize(), "test");
  return bits_of(m);
}

}  // namespace test::zero_cuda

// gpu_dp: DataParallel's per-step data movement on the CUDA backend against the GPU's own
// device-to-device copy bandwidth, measured in the same run (run by scripts/gpu-check).
//
// A synthetic model holds S bytes of float parameters (and as many of gradients) in GPU memory;
// its step function does no work, so a DP step is replicate (the master's parameters copied to
// N-1 replicas) plus reduce (the shard-weighted sum of N gradients onto the master, split across
// the devices), plus a negligible scatter (each device's 256-byte host shard copied to it). The bytes such a step must move are
//   replicate: (N-1) * S read + (N-1) * S written;  reduce: N * S read + S written,
// and "moved / time" is compared with cudaMemcpyAsync's device-to-device rate (S read + S written
// per copy). Devices: N logical devices on GPU 0 (lanes) and, when there are N GPUs, N GPUs.
//   gpu_dp [--mib 256] [--reps 10] [--csv FILE]
#include "bench_util.hpp"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/dparallel.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

namespace {

namespace dpl = dparallel;

/// Four parameter tensors of S/4 bytes each, gradients alike, all on one GPU.
struct flat_model {
  dpl::device dev{dpl::device_kind::cuda, 0, 0};
  std::size_t elems = 0;
  std::array<dpl::cuda::device_buffer<float>, 4> p, g;
  flat_model(std::size_t n, dpl::device d) : dev(d), elems(n) {
    for (auto& b : p) b = dpl::cuda::device_buffer<float>(n / 4, d);
    for (auto& b : g) b = dpl::cuda::device_buffer<float>(n / 4, d);
    dpl::cuda::device_guard guard(d.index);
    dpl::cuda::check(cudaDeviceSynchronize(), "gpu_dp");
  }
  flat_model(flat_model const& o) : flat_model(o.elems, o.dev) {}
  flat_model make_replica(dpl::device d) const { return flat_model(elems, d); }
  std::vector<dpl::tensor_ref> parameters() {
    std::vector<dpl::tensor_ref> out;
    for (auto& b : p) out.push_back(b.view());
    return out;
  }
  std::vector<dpl::tensor_ref> gradients() {
    std::vector<dpl::tensor_ref> out;
    for (auto& b : g) out.push_back(b.view());
    return out;
  }
};

double copy_seconds(std::size_t bytes, int reps) {
  dpl::device const d{dpl::device_kind::cuda, 0, 0};
  dpl::cuda::device_buffer<std::byte> a(bytes, d), b(bytes, d);
  cudaEvent_t t0, t1;
  dpl::cuda::check(cudaEventCreate(&t0), "gpu_dp");
  dpl::cuda::check(cudaEventCreate(&t1), "gpu_dp");
  std::vector<double> s;
  for (int r = 0; r < reps + 1; ++r) {
    dpl::cuda::check(cudaEventRecord(t0), "gpu_dp");
    dpl::cuda::check(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice), "gpu_dp");
    dpl::cuda::check(cudaEventRecord(t1), "gpu_dp");
    dpl::cuda::check(cudaEventSynchronize(t1), "gpu_dp");
    float ms = 0;
    dpl::cuda::check(cudaEventElapsedTime(&ms, t0, t1), "gpu_dp");
    if (r > 0) s.push_back(ms / 1e3);  // the first one warms up
  }
  (void)cudaEventDestroy(t0);
  (void)cudaEventDestroy(t1);
  return *std::min_element(s.begin(), s.end());
}

double step_seconds(std::vector<dpl::device> const& devs, std::size_t elems, int reps) {
  flat_model master(elems, devs[0]);
  dpl::data_parallel<flat_model, dpl::cuda::backend> dp(master, devs);
  std::vector<float> batch(devs.size() * 64);
  auto const noop = [](flat_model&, dpl::tensor_view<float const>) {};
  std::vector<double> s;
  for (int r = 0; r < reps + 1; ++r) {
    auto const t0 = bench::clock::now();
    dp.step(dpl::tensor_view<float const>(batch.data(), batch.size()), noop);
    if (r > 0) s.push_back(bench::seconds_since(t0));
  }
  return *std::min_element(s.begin(), s.end());
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv, "gpu_dp [--mib 256] [--reps 10] [--csv FILE]\n");
  double const mib = a.num("mib", 256);
  int const reps = static_cast<int>(a.num("reps", 10));
  std::string const csv = a.str("csv", "");
  a.done();
  if (dpl::cuda::device_count() == 0) {
    std::printf("gpu_dp: no GPU (%s): nothing to measure\n", dpl::cuda::no_device_reason().c_str());
    return 0;
  }
  std::size_t const elems = static_cast<std::size_t>(mib * 1024 * 1024 / sizeof(float)) / 4 * 4;
  std::size_t const bytes = elems * sizeof(float);
  double const copy_s = copy_seconds(bytes, reps);
  double const copy_bw = 2.0 * static_cast<double>(bytes) / copy_s;
  std::printf("gpu_dp: %s, %.0f MiB of parameters; device-to-device copy %.1f GB/s (read + written)\n",
              dpl::cuda::describe_device(dpl::device{dpl::device_kind::cuda, 0, 0}).name.c_str(), mib, copy_bw / 1e9);
  bench::table t({"devices", "kind", "step_ms", "moved_GB", "moved_GB_per_s", "ratio_to_copy"});
  for (int n : {2, 4}) {
    std::vector<std::pair<std::string, std::vector<dpl::device>>> sets{{"lanes of GPU 0", dpl::cuda::logical_devices(n, 0)}};
    if (dpl::cuda::device_count() >= n) sets.emplace_back("GPUs", dpl::cuda::devices(n));
    for (auto const& [kind, devs] : sets) {
      double const s = step_seconds(devs, elems, reps);
      double const moved = 2.0 * (n - 1) * static_cast<double>(bytes) + (n + 1.0) * static_cast<double>(bytes);
      char c0[32], c1[32], c2[32], c3[32];
      std::snprintf(c0, sizeof c0, "%.3f", s * 1e3);
      std::snprintf(c1, sizeof c1, "%.3f", moved / 1e9);
      std::snprintf(c2, sizeof c2, "%.1f", moved / s / 1e9);
      std::snprintf(c3, sizeof c3, "%.2f", moved / s / copy_bw);
      t.add({std::to_string(n), kind, c0, c1, c2, c3});
    }
  }
  t.print();
  if (!csv.empty()) t.write_csv(csv);
  return 0;
}

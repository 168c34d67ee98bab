// gpu_dp: DataParallel's per-step data movement on the CUDA backend against the copy bandwidth
// of the same path, measured in the same run (run by scripts/gpu-check).
//
// A synthetic model holds S bytes of float parameters (and as many of gradients) in GPU memory;
// its step function does no work, so a DP step is replicate (the master's parameters copied to
// N-1 replicas) plus reduce (the shard-weighted sum of N gradients onto the master, one slice per
// device), plus a negligible scatter (each device's 256-byte host shard copied to it).
//  - N lanes of GPU 0: every byte stays in the GPU's memory. A step reads and writes
//      replicate: (N-1) * S read + (N-1) * S written;  reduce: N * S read + S written,
//    compared with cudaMemcpyAsync's device-to-device rate (S read + S written per copy).
//  - N GPUs (when there are N): what limits a step is what crosses between GPUs, by
//    cudaMemcpyPeerAsync on the receiving GPU's stream:
//      replicate: (N-1) * S (GPU 0 to each replica);  reduce: (N-1) * S (each device stages the
//      other GPUs' parts of its slice) + (N-1) * S / N (the slices summed off GPU 0 go back),
//    compared with one cudaMemcpyPeerAsync of S bytes from GPU 0 to GPU 1 (S crossing per copy).
//    Several pairs copy at once in a step, so the ratio can exceed 1 on NVLink/NVSwitch.
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

/// The fastest of `reps` copies of `bytes` from GPU `from` into GPU `to` (one GPU: device to
/// device; two: cudaMemcpyPeerAsync, peer access enabled as the backend does), timed on `to`.
double copy_seconds(std::size_t bytes, int reps, int from, int to) {
  dpl::device const src_dev{dpl::device_kind::cuda, from, 0}, dst_dev{dpl::device_kind::cuda, to, 0};
  dpl::cuda::device_buffer<std::byte> a(bytes, src_dev), b(bytes, dst_dev);
  (void)dpl::cuda::link(from, to);
  dpl::cuda::device_guard guard(to);
  dpl::cuda::check(cudaDeviceSynchronize(), "gpu_dp");
  cudaEvent_t t0, t1;
  dpl::cuda::check(cudaEventCreate(&t0), "gpu_dp");
  dpl::cuda::check(cudaEventCreate(&t1), "gpu_dp");
  std::vector<double> s;
  for (int r = 0; r < reps + 1; ++r) {
    dpl::cuda::check(cudaEventRecord(t0), "gpu_dp");
    if (from == to)
      dpl::cuda::check(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice), "gpu_dp");
    else
      dpl::cuda::check(cudaMemcpyPeerAsync(b.data(), to, a.data(), from, bytes), "gpu_dp");
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
  double const copy_bw = 2.0 * static_cast<double>(bytes) / copy_seconds(bytes, reps, 0, 0);
  std::printf("gpu_dp: %s, %.0f MiB of parameters; device-to-device copy %.1f GB/s (read + written)\n",
              dpl::cuda::describe_device(dpl::device{dpl::device_kind::cuda, 0, 0}).name.c_str(), mib, copy_bw / 1e9);
  double peer_bw = 0;
  if (dpl::cuda::device_count() >= 2) {
    peer_bw = static_cast<double>(bytes) / copy_seconds(bytes, reps, 0, 1);
    std::printf("gpu_dp: GPU 0 to GPU 1 peer copy %.1f GB/s (%s)\n", peer_bw / 1e9,
                dpl::cuda::peer_access(0, 1) ? "direct" : "staged by the driver");
  }
  bench::table t({"devices", "kind", "step_ms", "moved_GB", "moved_GB_per_s", "compared_with", "ratio"});
  for (int n : {2, 4}) {
    struct row {
      std::string kind;
      std::vector<dpl::device> devs;
      double moved, rate;
      char const* against;
    };
    double const sb = static_cast<double>(bytes);
    std::vector<row> rows{{"lanes of GPU 0", dpl::cuda::logical_devices(n, 0),
                           2.0 * (n - 1) * sb + (n + 1.0) * sb, copy_bw, "device-to-device copy"}};
    if (dpl::cuda::device_count() >= n)
      rows.push_back({"GPUs", dpl::cuda::devices(n), (n - 1) * sb * (2.0 + 1.0 / n), peer_bw, "GPU 0 to 1 peer copy"});
    for (auto const& r : rows) {
      double const s = step_seconds(r.devs, elems, reps);
      char c0[32], c1[32], c2[32], c3[32];
      std::snprintf(c0, sizeof c0, "%.3f", s * 1e3);
      std::snprintf(c1, sizeof c1, "%.3f", r.moved / 1e9);
      std::snprintf(c2, sizeof c2, "%.1f", r.moved / s / 1e9);
      std::snprintf(c3, sizeof c3, "%.2f", r.moved / s / r.rate);
      t.add({std::to_string(n), r.kind, c0, c1, c2, r.against, c3});
    }
  }
  t.print();
  if (!csv.empty()) t.write_csv(csv);
  return 0;
}

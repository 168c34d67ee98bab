// Checks of several NCCL ranks, one process per rank, started torchrun-style (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the unique id goes through dparallel's
// TCP rendezvous) by scripts/gpu-check. On a machine with one GPU every rank runs on it, with the
// environment `--shared-gpu-env` prints (docs/gpu-check.md says what that proves and what not).
//
//   nccl_ranks --shared-gpu-env RANK   prints `export NAME=VALUE` lines for the NCCL found at run time
//   nccl_ranks CHECK                    runs CHECK as this process's rank; exit status 0 = passed
//
// CHECK:
//   collectives  all_reduce, broadcast, reduce_scatter and all_gather of device and host memory
//                give the arithmetic's values on every rank (each rank adds distinct integers)
//   zero         ZeRO-1 gives bitwise DDP's parameters after 20 steps (AdamW and SGD, default and
//                tiny buckets; zero_train.cuh, as test_cuda_zero), and every rank holds rank 0's
//   desync       ranks issue all_reduces of different sizes under desync detection: every rank
//                fails with the desync report naming the odd rank, and nothing runs
//   stop         the last rank stops issuing collectives: every other rank's all_reduce fails with
//                a timeout_error within the timeout, and a later collective fails at once
//   hooks        cuda::fp16_compress and bf16_compress over 2 NCCL ranks against the host hooks over
//                2 thread ranks of this process on the same inputs (spawn): the residuals of error
//                feedback bitwise, averages that 16 bits hold exactly bitwise, rounded averages
//                within one 16-bit step (NCCL's native 16-bit average is within rounding of the
//                host's float sum); every rank holds rank 0's bits
#include "zero_train.cuh"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/policy/cuda/compress_hooks.hpp>
#include <dparallel/comm/detail/launch_gpu.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/policy/compress_hooks.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace dpl = dparallel;

namespace {

int failures = 0;
std::string me = "nccl_ranks";

void expect(bool ok, std::string const& what) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "%s: FAILED: %s\n", me.c_str(), what.c_str());
}

std::vector<float> down(float const* p, std::size_t n) {
  std::vector<float> out(n);
  dpl::cuda::check(cudaMemcpy(out.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), "test");
  return out;
}

dpl::cuda::device_buffer<float> up(std::vector<float> const& v, dpl::device d) {
  dpl::cuda::device_buffer<float> b(v.size(), d);
  dpl::cuda::check(cudaMemcpy(b.data(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice), "test");
  return b;
}

// Rank r's k-th value: small integers, so every order of the sums gives the same float.
float value(int r, std::size_t k) { return static_cast<float>(r * 100 + static_cast<int>(k)); }

void check_collectives(dpl::distributed_group const& g) {
  int const n = g.size(), r = g.rank();
  dpl::device const d = *g.bound_device();
  constexpr std::size_t per = 1000;
  std::vector<float> mine(per * static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < mine.size(); ++k) mine[k] = value(r, k);
  std::vector<float> sum(mine.size());
  for (std::size_t k = 0; k < sum.size(); ++k)
    for (int j = 0; j < n; ++j) sum[k] += value(j, k);
  for (bool host : {false, true}) {
    std::string const where = host ? " (host memory)" : " (device memory)";
    // all_reduce
    std::vector<float> h = mine;
    auto dev = up(mine, d);
    g.all_reduce(host ? dpl::view(h) : dev.view()).wait();
    expect((host ? h : down(dev.data(), dev.size())) == sum, "all_reduce" + where);
    // broadcast from the last rank
    std::vector<float> b = mine;
    auto db = up(mine, d);
    g.broadcast(host ? dpl::view(b) : db.view(), n - 1).wait();
    std::vector<float> want_b(mine.size());
    for (std::size_t k = 0; k < want_b.size(); ++k) want_b[k] = value(n - 1, k);
    expect((host ? b : down(db.data(), db.size())) == want_b, "broadcast" + where);
    // reduce_scatter: block r of the sum
    std::vector<float> out(per);
    auto dout = up(out, d);
    auto din = up(mine, d);
    std::vector<float> hin = mine;
    if (host) {
      g.reduce_scatter(dpl::view(out), dpl::view(hin)).wait();
    } else {
      g.reduce_scatter(dout.view(), din.view()).wait();
    }
    std::vector<float> const block(sum.begin() + static_cast<std::ptrdiff_t>(per) * r,
                                   sum.begin() + static_cast<std::ptrdiff_t>(per) * (r + 1));
    expect((host ? out : down(dout.data(), per)) == block, "reduce_scatter" + where);
    // all_gather of each rank's first block
    std::vector<float> gathered(mine.size());
    std::vector<float> first(mine.begin(), mine.begin() + static_cast<std::ptrdiff_t>(per));
    auto dg = up(gathered, d);
    auto df = up(first, d);
    if (host) {
      g.all_gather(dpl::view(gathered), dpl::view(first)).wait();
    } else {
      g.all_gather(dg.view(), df.view()).wait();
    }
    std::vector<float> want_g(mine.size());
    for (int j = 0; j < n; ++j)
      for (std::size_t k = 0; k < per; ++k) want_g[static_cast<std::size_t>(j) * per + k] = value(j, k);
    expect((host ? gathered : down(dg.data(), dg.size())) == want_g, "all_gather" + where);
  }
  g.barrier().wait();
}

template <class Rule>
void check_zero(dpl::distributed_group const& g, Rule const& rule, char const* name) {
  using namespace test::zero_cuda;
  dpl::device const d = *g.bound_device();
  for (bool small : {false, true}) {
    std::string const what = std::string(name) + (small ? ", tiny buckets" : ", default buckets");
    dpl::options const o = small ? dpl::options{.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024)}
                                 : dpl::options{};
    auto const ddp = train_rank(false, rule, o, g, d);
    auto const zero = train_rank(true, rule, o, g, d);
    expect(!same_bits(ddp, bits_of(model(dim, 3, d))), what + ": DDP trained");
    expect(same_bits(zero, ddp), what + ": ZeRO-1 bitwise DDP on this rank");
    std::vector<float> r0 = ddp;  // every rank holds rank 0's parameters
    g.broadcast(dpl::view(r0), 0).wait();
    expect(same_bits(ddp, r0), what + ": this rank's DDP parameters bitwise rank 0's");
  }
}

void check_desync(dpl::distributed_group const& g) {
  int const r = g.rank();
  std::size_t const n = r == g.size() - 1 ? 5 : 4;  // the last rank is odd
  std::vector<float> v(n, 1.0F);
  try {
    g.all_reduce(dpl::view(v)).wait();
    expect(false, "a desynchronised all_reduce completed");
  } catch (dpl::comm_error const& e) {
    std::string const m = e.what();
    expect(m.find("desync detected") != std::string::npos, "the desync report, found: " + m);
    expect(m.find("rank " + std::to_string(g.size() - 1) + " differs") != std::string::npos,
           "the report names the odd rank, found: " + m);
  }
  expect(v == std::vector<float>(n, 1.0F), "nothing ran: the buffer is unchanged");
}

void check_stop(dpl::distributed_group& g, std::chrono::milliseconds timeout) {
  g.barrier().wait();  // everybody is there, the connections made (under the long timeout)
  g.set_timeout(timeout);
  if (g.rank() == g.size() - 1) {
    // Alive but silent, until the others have timed out; then gone without a word (no destroy).
    std::this_thread::sleep_for(3 * timeout + std::chrono::seconds(5));
    std::fflush(stdout);
    std::_Exit(0);
  }
  std::vector<float> v(16, 1.0F);
  auto const t0 = std::chrono::steady_clock::now();
  try {
    g.all_reduce(dpl::view(v)).wait();
    expect(false, "an all_reduce without the last rank completed");
  } catch (dpl::timeout_error const& e) {
    auto const took = std::chrono::steady_clock::now() - t0;
    std::string const m = e.what();
    std::printf("%s: timed out as expected after %.1f s: %s\n", me.c_str(),
                std::chrono::duration<double>(took).count(), m.c_str());
    expect(took < timeout + std::chrono::seconds(20), "the timeout came within the timeout + 20 s");
    expect(took >= timeout - std::chrono::milliseconds(100), "not before the timeout");
    expect(m.find("rank " + std::to_string(g.rank())) != std::string::npos, "the timeout names this rank, found: " + m);
  } catch (std::exception const& e) {
    expect(false, std::string("expected a timeout_error, found: ") + e.what());
  }
  auto const t1 = std::chrono::steady_clock::now();
  try {
    g.barrier().wait();
    expect(false, "a collective after the timeout completed");
  } catch (dpl::comm_error const&) {
    expect(std::chrono::steady_clock::now() - t1 < std::chrono::seconds(5), "a later collective fails at once");
  }
}

// The hooks' bucket: two parameters (600 and 401 elements). Rank r's value i at step s: `exact`
// values (multiples of 1/4 below 8, rank r adding r/2) whose average over 2 ranks 16 bits hold
// exactly; else values of both signs, of magnitude 2^-10/1.1 to about 1, that 16 bits do not hold
// (magnitudes where the sum of two 16-bit values is exact in float, so the host's average is
// rounded once).
std::vector<std::size_t> const hook_params{0, 1}, hook_offsets{0, 600}, hook_sizes{600, 401};
constexpr std::size_t hook_len = 1001;

float hook_input(int r, int s, std::size_t i, bool exact) {
  if (exact) return static_cast<float>(static_cast<int>((i + 7 * static_cast<std::size_t>(s)) % 61) - 30) * 0.25f + 0.5f * static_cast<float>(r);
  float const w = std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(s) + 2.1f * static_cast<float>(r));
  return std::copysign(0.0009765625f + std::fabs(w) * (1.0f + 1e-4f * static_cast<float>(i)), w) / 1.1f;
}

// The position of 16-bit bits in the order of their values (+0 and -0 both 0).
int ordinal16(std::uint16_t b) { return (b & 0x8000u) != 0 ? -static_cast<int>(b & 0x7fffu) : static_cast<int>(b); }

// One 16-bit type's three steps, host hooks (reference) against CUDA hooks.
void check_hook(dpl::distributed_group const& g, bool bf, bool feedback, bool exact) {
  int const n = g.size(), r = g.rank();
  dpl::device const d = *g.bound_device();
  std::string const what = std::string(bf ? "bf16" : "fp16") + (feedback ? ", error feedback" : "") +
                           (exact ? ", exact averages" : ", rounded averages");
  auto const bits16 = [bf](float v) { return bf ? dpl::bf16(v).bits : dpl::f16(v).bits; };
  // The reference: the host hooks over n thread ranks of this process, each on its rank's inputs;
  // kept: rank r's results and residuals per step.
  std::vector<std::vector<float>> host(3), host_res(3);
  dpl::spawn(n, [&](dpl::rank_context& rank) {
    dpl::compress_state st{.error_feedback = feedback};
    for (int s = 0; s < 3; ++s) {
      std::vector<float> x(hook_len);
      for (std::size_t i = 0; i < hook_len; ++i) x[i] = hook_input(rank.rank(), s, i, exact);
      dpl::grad_bucket const b{0, dpl::tensor_ref(x.data(), hook_len, dpl::dtype::f32, dpl::host_memory), hook_params,
                               hook_offsets, hook_sizes};
      auto const out = (bf ? dpl::bf16_compress(st, rank.group(), b) : dpl::fp16_compress(st, rank.group(), b)).get();
      if (rank.rank() != r) continue;
      auto const* y = static_cast<float const*>(out.data());
      host[static_cast<std::size_t>(s)].assign(y, y + hook_len);
      for (auto const& res : st.residual) host_res[static_cast<std::size_t>(s)].insert(host_res[static_cast<std::size_t>(s)].end(), res.begin(), res.end());
    }
  });
  dpl::cuda::compress_state st{.error_feedback = feedback};
  for (int s = 0; s < 3; ++s) {
    std::string const at = what + ", step " + std::to_string(s);
    std::vector<float> x(hook_len);
    for (std::size_t i = 0; i < hook_len; ++i) x[i] = hook_input(r, s, i, exact);
    auto dx = up(x, d);
    dpl::grad_bucket const b{0, dpl::tensor_ref(dx.data(), hook_len, dpl::dtype::f32, d), hook_params, hook_offsets,
                             hook_sizes};
    auto const out = (bf ? dpl::cuda::bf16_compress(st, g, b) : dpl::cuda::fp16_compress(st, g, b)).get();
    dpl::cuda::check(cudaDeviceSynchronize(), "test");
    std::vector<float> const got = down(static_cast<float const*>(out.data()), hook_len);
    auto const& want = host[static_cast<std::size_t>(s)];
    expect(want != x, at + ": the host hooks averaged (the result is not this rank's input)");
    if (exact) {
      bool analytic = true;  // the host reference itself: the exact average of the ranks' inputs
      for (std::size_t i = 0; i < hook_len; ++i) {
        float sum = 0;
        for (int j = 0; j < n; ++j) sum += hook_input(j, s, i, true);
        analytic = analytic && want[i] == sum / static_cast<float>(n);
      }
      expect(analytic, at + ": the host hooks give the exact average");
      expect(got == want, at + ": the CUDA hook's average bitwise the host hooks'");
    } else {
      int worst = 0;
      std::size_t differ = 0;
      for (std::size_t i = 0; i < hook_len; ++i) {
        int const gap = std::abs(ordinal16(bits16(got[i])) - ordinal16(bits16(want[i])));
        worst = std::max(worst, gap);
        differ += gap != 0 ? 1 : 0;
      }
      std::printf("%s: %s: %zu of %zu values differ from the host's, by at most %d 16-bit step(s)\n", me.c_str(),
                  at.c_str(), differ, hook_len, worst);
      expect(worst <= 1, at + ": the CUDA hook's average within one 16-bit step of the host hooks' (found " +
                             std::to_string(worst) + ")");
    }
    if (feedback) {
      std::vector<float> res;
      for (auto const& rb : st.residual) {
        auto const part = down(rb.data(), rb.size());
        res.insert(res.end(), part.begin(), part.end());
      }
      expect(res == host_res[static_cast<std::size_t>(s)], at + ": the residuals bitwise the host hooks'");
      expect(exact || res != std::vector<float>(res.size(), 0.0f), at + ": the inputs were rounded (residuals not zero)");
    }
    std::vector<float> r0 = got;  // every rank holds rank 0's bits
    g.broadcast(dpl::view(r0), 0).wait();
    expect(std::memcmp(got.data(), r0.data(), hook_len * sizeof(float)) == 0, at + ": this rank's average bitwise rank 0's");
  }
}

void check_hooks(dpl::distributed_group const& g) {
  if (g.size() != 2) {
    expect(false, "hooks: expected 2 ranks (its tolerance is a 2-rank average's), found " + std::to_string(g.size()));
    return;
  }
  for (bool bf : {false, true})
    for (bool feedback : {false, true})
      for (bool exact : {true, false}) check_hook(g, bf, feedback, exact);
}

int shared_gpu_env(char const* rank) {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return 1;
  std::printf("# NCCL %s\n", dpl::detail::nccl_version_string(v).c_str());
  for (auto const& e : dpl::detail::shared_gpu_environment(v, std::atoi(rank))) std::printf("export %s=%s\n", e.name.c_str(), e.value.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string_view(argv[1]) == "--shared-gpu-env") return shared_gpu_env(argv[2]);
  if (argc != 2) {
    std::fprintf(stderr, "usage: nccl_ranks --shared-gpu-env RANK | nccl_ranks collectives|zero|desync|stop|hooks\n");
    return 2;
  }
  std::string const check = argv[1];
  try {
    dpl::distributed_group g =
        dpl::nccl::init_process_group({.timeout = std::chrono::seconds(60), .desync_detection = check == "desync"});
    me = "nccl_ranks " + check + " rank " + std::to_string(g.rank()) + "/" + std::to_string(g.size()) + " on " +
         dpl::to_string(*g.bound_device());
    if (check == "collectives") {
      check_collectives(g);
    } else if (check == "zero") {
      check_zero(g, dpl::optim::adamw({.weight_decay = 0.05}), "adamw");
      check_zero(g, dpl::optim::sgd({.momentum = 0.9, .nesterov = true}), "sgd with momentum");
    } else if (check == "desync") {
      check_desync(g);
    } else if (check == "hooks") {
      check_hooks(g);
    } else if (check == "stop") {
      check_stop(g, std::chrono::seconds(4));
    } else {
      std::fprintf(stderr, "nccl_ranks: unknown check '%s'\n", check.c_str());
      return 2;
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "%s: FAILED: %s\n", me.c_str(), e.what());
    return 1;
  }
  std::printf("%s: %s\n", me.c_str(), failures == 0 ? "passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}

// overhead: the fixed per-step cost of dp and ddp on the host backend, with the compute and the
// communication taken out.
//
// A synthetic model of P parameters holding G bytes of F32 gradients in all (split evenly) is
// stepped with a step function that does nothing ("empty") or busy-waits a fixed wall time on its
// device ("busy", --busy-us; wall time, so oversubscribed cores do not stretch it). For each
// configuration the same run also measures the data movement alone, on plain threads in lock
// step, without the library's streams and hand-offs:
//   dp:  every replica device copies the master's parameters into its replica, then each of the N
//        threads sums its 1/N slice of every device's gradients into the master (what the
//        replicate and reduce policies do, on N threads);
//   ddp: the host communicator's all-reduce of DDP's own buckets (sizes taken from the wrapper's
//        bucket plan), issued together and waited for as DDP waits (drain, then each work), on
//        N thread ranks of a fresh group.
// overhead = step time - busy wait - data movement: what the library adds per step (thread
// hand-offs, wake-ups, allocations, bookkeeping, DDP's copies into and out of its buckets).
//
// Modes take turns inside each round (dp, then ddp, then the data movement of each); the median
// of --rounds rounds is reported. Each round times --steps steps after --warmup untimed ones.
//
// On a loaded machine every hand-off that puts a thread to sleep can cost a scheduler time slice,
// so wall times swing by orders of magnitude; two columns per mode are steadier: the process's
// CPU time per step (cpu_us) and its voluntary context switches per step (sleeps: each one a
// thread that blocked and had to be woken).

#include "bench_util.hpp"
#include "timing.hpp"

#include <dparallel/dparallel.hpp>

#include <sys/resource.h>

#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace dp = dparallel;

namespace {

char const* const usage =
    "usage: overhead [--params 1,8] [--bytes 1024,65536,1048576,16777216] [--devices 2,4]\n"
    "                [--busy-us 0,200] [--steps 200] [--warmup 20] [--rounds 5] [--csv FILE]\n"
    "  --params   parameter counts (the gradient bytes are split evenly over them)\n"
    "  --bytes    gradient bytes in all (F32)\n"
    "  --devices  devices (dp) and thread ranks (ddp)\n"
    "  --busy-us  the step function's busy wait per device, microseconds (0: an empty step)\n"
    "  --steps    timed steps per round (fewer for large gradients: at most 64 MiB moved), after --warmup\n"
    "  --rounds   rounds, modes interleaved in each; the median is reported\n"
    "  --csv      write the table as CSV\n";

/// P parameters of G/P bytes each, and their gradients.
struct synthetic {
  std::vector<std::vector<float>> p, g;
  synthetic(std::size_t params, std::size_t bytes) {
    std::size_t const each = std::max<std::size_t>(1, bytes / sizeof(float) / params);
    for (std::size_t i = 0; i < params; ++i) {
      p.emplace_back(each, 0.5f + static_cast<float>(i));
      g.emplace_back(each, 0.25f);
    }
  }
  std::vector<dp::tensor_ref> parameters() { return refs(p); }
  std::vector<dp::tensor_ref> gradients() { return refs(g); }

 private:
  static std::vector<dp::tensor_ref> refs(std::vector<std::vector<float>>& v) {
    std::vector<dp::tensor_ref> out;
    out.reserve(v.size());
    for (auto& x : v) out.emplace_back(dp::view(x));
    return out;
  }
};

/// A batch of n one-element samples (the step function ignores it).
using batch = dp::tensor_view<float const>;

/// Busy-waits `us` microseconds of wall time.
void busy(double us) {
  if (us <= 0) return;
  auto const end = bench::clock::now() + std::chrono::duration<double, std::micro>(us);
  while (bench::clock::now() < end) {
  }
}

/// Process-wide CPU seconds and voluntary context switches so far (every thread).
struct proc_usage {
  double cpu = 0;
  double sleeps = 0;
  static proc_usage now() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    auto const sec = [](timeval t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
    return {sec(u.ru_utime) + sec(u.ru_stime), static_cast<double>(u.ru_nvcsw)};
  }
};

/// One timed run of a mode: wall seconds, CPU seconds and sleeps per step.
struct sample {
  double wall = 0, cpu = 0, sleeps = 0;
};

struct config {
  std::size_t params = 1, bytes = 1024;
  int devices = 2;
  double busy_us = 0;
  std::size_t steps = 200, warmup = 20;
};

std::vector<float> const& samples(std::size_t n) {
  static std::vector<float> x(1024, 1.0f);
  if (x.size() < n) x.resize(n, 1.0f);
  return x;
}

/// dp: per step.
sample time_dp(config const& c) {
  synthetic model(c.params, c.bytes);
  dp::data_parallel<synthetic> wrapper(model, dp::host::devices(c.devices));
  auto const& x = samples(static_cast<std::size_t>(c.devices));
  batch const b(x.data(), static_cast<std::size_t>(c.devices), static_cast<std::size_t>(c.devices));
  double const us = c.busy_us;
  auto step = [&] { wrapper.step(b, [us](synthetic&, batch) { busy(us); }); };
  for (std::size_t i = 0; i < c.warmup; ++i) step();
  auto const u0 = proc_usage::now();
  auto const t0 = bench::clock::now();
  for (std::size_t i = 0; i < c.steps; ++i) step();
  double const wall = bench::seconds_since(t0);
  auto const u1 = proc_usage::now();
  auto const n = static_cast<double>(c.steps);
  return {wall / n, (u1.cpu - u0.cpu) / n, (u1.sleeps - u0.sleeps) / n};
}

/// ddp over thread ranks: per step (rank 0's clock, between two barriers); `buckets` receives
/// the bucket sizes in elements.
sample time_ddp(config const& c, std::vector<std::size_t>& buckets) {
  std::barrier sync(c.devices);
  sample result;
  proc_usage u0;
  dp::spawn(c.devices, [&](dp::rank_context& rank) {
    synthetic model(c.params, c.bytes);
    dp::distributed_data_parallel<synthetic> wrapper(model, rank.group());
    auto const& x = samples(1);
    batch const b(x.data(), 1, 1);
    double const us = c.busy_us;
    auto step = [&] { wrapper.step(b, [us](synthetic&, batch) { busy(us); }); };
    for (std::size_t i = 0; i < c.warmup; ++i) step();
    sync.arrive_and_wait();
    if (rank.rank() == 0) u0 = proc_usage::now();
    auto const t0 = bench::clock::now();
    for (std::size_t i = 0; i < c.steps; ++i) step();
    sync.arrive_and_wait();
    if (rank.rank() == 0) {
      auto const n = static_cast<double>(c.steps);
      auto const u1 = proc_usage::now();
      result = {bench::seconds_since(t0) / n, (u1.cpu - u0.cpu) / n, (u1.sleeps - u0.sleeps) / n};
      buckets.clear();
      for (auto const& s : wrapper.reducer().buckets()) buckets.push_back(s.elements);
    }
  });
  return result;
}

/// dp's data movement alone on N plain threads: replicate (copy) then the sliced weighted sum.
double time_dp_moves(config const& c) {
  auto const n = static_cast<std::size_t>(c.devices);
  std::vector<synthetic> dev;
  for (std::size_t i = 0; i < n; ++i) dev.emplace_back(c.params, c.bytes);
  std::vector<double> w(n, 1.0 / static_cast<double>(n));
  std::vector<std::vector<dp::tensor_ref>> srcs(c.params);
  for (std::size_t p = 0; p < c.params; ++p)
    for (std::size_t i = 0; i < n; ++i) srcs[p].push_back(dp::view(dev[i].g[p]));
  auto const op = [&](int r) {
    auto const ur = static_cast<std::size_t>(r);
    if (ur != 0)
      for (std::size_t p = 0; p < c.params; ++p) dp::host::copy(dp::view(dev[ur].p[p]), dp::view(dev[0].p[p]));
    for (std::size_t p = 0; p < c.params; ++p) {
      std::size_t const len = dev[0].g[p].size(), lo = len * ur / n, hi = len * (ur + 1) / n;
      if (lo == hi) continue;
      std::vector<dp::tensor_ref> s;  // outside the timed kernels' cost: a few pointers
      for (auto const& t : srcs[p]) s.push_back(t.subview(lo, hi - lo));
      // Thread r reads and writes only slice r: the master's slice is its own destination, as in dp.
      dp::host::weighted_sum(dp::tensor_ref(dp::view(dev[0].g[p])).subview(lo, hi - lo), s, w);
    }
  };
  return bench::time_in_lock_step(c.devices, op, 0.02, 3).median;
}

/// ddp's communication alone: all-reduce of the same buckets over N fresh thread ranks.
double time_ddp_moves(config const& c, std::vector<std::size_t> const& buckets) {
  auto comms = dp::host::make_communicators(c.devices);
  std::vector<std::vector<std::vector<float>>> bufs(static_cast<std::size_t>(c.devices));
  for (auto& r : bufs)
    for (std::size_t e : buckets) r.emplace_back(e, 0.25f);
  auto const op = [&](int r) {
    auto const ur = static_cast<std::size_t>(r);
    std::vector<dp::work> works;
    for (auto& buf : bufs[ur]) works.push_back(comms[ur]->all_reduce(dp::view(buf), dp::reduce_op::avg));
    comms[ur]->drain();  // as DDP's finalize waits: the caller runs what the comm thread has not started
    for (auto const& wk : works) wk.wait();
  };
  return bench::time_in_lock_step(c.devices, op, 0.02, 3).median;
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv, usage);
  auto const params = a.list("params", {1, 8});
  auto const bytes = a.list("bytes", {1024, 65536, 1048576, 16777216});
  auto const devices = a.list("devices", {2, 4});
  auto const busy_us = a.list("busy-us", {0, 200});
  auto const steps = static_cast<std::size_t>(a.num("steps", 200));
  auto const warmup = static_cast<std::size_t>(a.num("warmup", 20));
  int const rounds = static_cast<int>(a.num("rounds", 5));
  std::string const csv = a.str("csv", "");
  a.done();

  bench::table t({"devices", "params", "bytes", "busy_us", "dp_step_us", "dp_moves_us", "dp_overhead_us", "dp_cpu_us",
                  "dp_sleeps", "ddp_step_us", "ddp_comm_us", "ddp_overhead_us", "ddp_cpu_us", "ddp_sleeps"});
  for (double nd : devices)
    for (double np : params)
      for (double nb : bytes)
        for (double bu : busy_us) {
          config c;
          c.devices = static_cast<int>(nd);
          c.params = static_cast<std::size_t>(np);
          c.bytes = static_cast<std::size_t>(nb);
          c.busy_us = bu;
          // At most ~64 MiB of gradients per round, at least 10 steps.
          c.steps = std::max<std::size_t>(10, std::min(steps, (std::size_t{64} << 20) / c.bytes));
          c.warmup = std::max<std::size_t>(2, std::min(warmup, c.steps / 4));
          std::vector<sample> dps, ddps;
          std::vector<double> dpm, ddpm;
          std::vector<std::size_t> buckets;
          for (int r = 0; r < rounds; ++r) {
            dps.push_back(time_dp(c));
            ddps.push_back(time_ddp(c, buckets));
            dpm.push_back(time_dp_moves(c));
            ddpm.push_back(time_ddp_moves(c, buckets));
          }
          double const us = 1e6;
          auto const med = [](std::vector<sample> const& v, double sample::*f) {
            std::vector<double> x;
            for (auto const& s : v) x.push_back(s.*f);
            return bench::median(x);
          };
          double const dp_step = med(dps, &sample::wall) * us, dp_mv = bench::median(dpm) * us;
          double const ddp_step = med(ddps, &sample::wall) * us, ddp_mv = bench::median(ddpm) * us;
          t.add({bench::fmt("%d", c.devices), bench::fmt("%zu", c.params), bench::bytes_label(c.bytes),
                 bench::fmt("%.0f", bu), bench::fmt("%.1f", dp_step), bench::fmt("%.1f", dp_mv),
                 bench::fmt("%.1f", dp_step - bu - dp_mv), bench::fmt("%.1f", med(dps, &sample::cpu) * us),
                 bench::fmt("%.2f", med(dps, &sample::sleeps)), bench::fmt("%.1f", ddp_step),
                 bench::fmt("%.1f", ddp_mv), bench::fmt("%.1f", ddp_step - bu - ddp_mv),
                 bench::fmt("%.1f", med(ddps, &sample::cpu) * us), bench::fmt("%.2f", med(ddps, &sample::sleeps))});
        }
  std::printf("# per-step overhead of dp and ddp (host backend), median of %d rounds; %s\n", rounds,
              bench::load_note().c_str());
  t.print();
  t.write_csv(csv);
  return 0;
}

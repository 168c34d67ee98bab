// zero_memory: what ZeRO stage 1 (ddp_zero1 + zero_redundancy_optimizer) saves and costs against
// DDP with the same optimizer, over N thread ranks, on a model of 20 tensors (>= 20 M parameters)
// with an Adam update (two f32 state slots):
//   - optimizer-state bytes per rank (DDP: the whole state on every rank; ZeRO-1: about 1/N);
//   - heap allocations (operator new, every thread of the process) per steady-state step, and
//     the bytes of bucket and state memory allocated after the first step;
//   - step time (wrapper step + optimizer step), DDP, ZeRO-1 and ZeRO-1 with its all-gathers
//     overlapping the next forward (zero_options::overlap_gather) interleaved round by round on
//     the same ranks, the median over rounds, and their ratios to DDP.
// The step function is synthetic and memory-bound (a "forward" that reads every 16th element of
// each tensor, first to last, after opt.need(p) in the overlap mode; then one pass that writes each
// gradient from its parameter, marking it ready, last tensor first): the collectives and the
// update dominate, the case where ZeRO-1's all-gather after the update is least hidden.
#include "bench_util.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>
#include <dparallel/spawn.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <span>
#include <string>
#include <vector>

namespace dpl = dparallel;

// ---- Counting every operator new of the process ------------------------------------------------
namespace {
std::atomic<std::uint64_t> g_news{0};
std::atomic<std::uint64_t> g_new_bytes{0};

void* counted_new(std::size_t n, std::size_t align) {
  g_news.fetch_add(1, std::memory_order_relaxed);
  g_new_bytes.fetch_add(n, std::memory_order_relaxed);
  if (n == 0) n = 1;
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(n);
  } else {
    n = (n + align - 1) / align * align;
    p = std::aligned_alloc(align, n);
  }
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

// The library's array and nothrow forms call these.
void* operator new(std::size_t n) { return counted_new(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_new(n, static_cast<std::size_t>(a)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

constexpr std::size_t tensors = 20;

/// 20 tensors of `per` f32 parameters; views from std::arrays (reading them allocates nothing).
struct big_model {
  std::array<std::vector<float>, tensors> w, g;
  explicit big_model(std::size_t per) {
    for (std::size_t p = 0; p < tensors; ++p) {
      w[p].resize(per);
      g[p].assign(per, 0.0f);
      for (std::size_t i = 0; i < per; ++i) w[p][i] = 0.01f * static_cast<float>((i * 7 + p * 13) % 101) - 0.5f;
    }
  }
  static std::array<dpl::tensor_view<float>, tensors> views_of(std::array<std::vector<float>, tensors>& v) {
    std::array<dpl::tensor_view<float>, tensors> out;
    for (std::size_t p = 0; p < tensors; ++p) out[p] = dpl::view(v[p]);
    return out;
  }
  auto parameters() { return views_of(w); }
  auto gradients() { return views_of(g); }
  float sink = 0;
  /// "Forward": reads every tensor, first to last, once need(p) returned.
  template <class Need>
  void forward(Need need) {
    float s = 0;
    for (std::size_t p = 0; p < tensors; ++p) {
      need(p);
      for (std::size_t i = 0; i < w[p].size(); i += 16) s += w[p][i];
    }
    sink = s;
  }
  /// "Backward": g = 0.01 * w + x, last tensor first, each marked ready when written.
  void backward(float x, dpl::step_context& ctx) {
    for (std::size_t p = tensors; p-- > 0;) {
      for (std::size_t i = 0; i < w[p].size(); ++i) g[p][i] = 0.01f * w[p][i] + x;
      ctx.grad_ready(p);
    }
  }
};

struct result {
  std::size_t ddp_state = 0, zero_state = 0;
  double ddp_news = 0, zero_news = 0;  // per steady-state step, every thread
  double ddp_bytes = 0, zero_bytes = 0;  // the bytes those allocations asked for
  double ddp_step = 0, zero_step = 0, overlap_step = 0;  // median seconds
  bool same = false;                   // parameters bitwise equal after the run
};

result run(int world, std::size_t per, int rounds, int steps) {
  result res;
  std::vector<double> ddp_t, zero_t, overlap_t;
  std::uint64_t ddp_news = 0, zero_news = 0, ddp_bytes = 0, zero_bytes = 0;
  std::vector<char> same(static_cast<std::size_t>(world), 0);
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    big_model a(per), b(per), c(per);
    dpl::distributed_data_parallel<big_model> ddp(a, rank);
    dpl::parallel<big_model, dpl::ddp_zero1> zero(b, rank), overlap(c, rank);
    dpl::optim::optimizer ddp_opt(ddp, dpl::optim::adam{});  // DDP: the whole state on every rank
    dpl::optim::zero_redundancy_optimizer zero_opt(zero, dpl::optim::adam{});
    dpl::optim::zero_redundancy_optimizer overlap_opt(overlap, dpl::optim::adam{}, {.overlap_gather = true});
    std::vector<float> const batch{static_cast<float>(rank.rank() + 1) * 1e-3f};
    auto fn = [](big_model& m, std::span<float const> x, dpl::step_context& ctx) {
      m.forward([](std::size_t) {});
      m.backward(x[0], ctx);
    };
    auto overlap_fn = [&](big_model& m, std::span<float const> x, dpl::step_context& ctx) {
      m.forward([&](std::size_t p) { overlap_opt.need(p); });
      m.backward(x[0], ctx);
    };
    auto const ddp_step = [&] {
      ddp.step(batch, fn);
      ddp_opt.step(ddp, 1e-3);
    };
    auto const zero_step = [&] {
      zero.step(batch, fn);
      zero_opt.step(1e-3);
    };
    auto const overlap_step = [&] {
      overlap.step(batch, overlap_fn);
      overlap_opt.step(1e-3);
    };
    for (int k = 0; k < 2; ++k) {  // warm-up: the bucket rebuild, the state, the first-touch pages
      ddp_step();
      zero_step();
      overlap_step();
    }
    for (int r = 0; r < rounds; ++r) {
      for (int mode = 0; mode < 3; ++mode) {
        rank.group().barrier().wait();
        std::uint64_t const n0 = g_news.load(), b0 = g_new_bytes.load();
        auto const t0 = bench::clock::now();
        for (int k = 0; k < steps; ++k) {
          if (mode == 0) ddp_step();
          else if (mode == 1) zero_step();
          else overlap_step();
        }
        double const dt = bench::seconds_since(t0) / steps;
        std::uint64_t const news = g_news.load() - n0;  // every rank's threads: counted on rank 0
        std::uint64_t const bytes = g_new_bytes.load() - b0;
        rank.group().barrier().wait();
        if (rank.rank() == 0) {
          (mode == 0 ? ddp_t : mode == 1 ? zero_t : overlap_t).push_back(dt);
          if (mode < 2) {
            (mode == 0 ? ddp_news : zero_news) += news;
            (mode == 0 ? ddp_bytes : zero_bytes) += bytes;
          }
        }
      }
    }
    overlap_opt.wait_gathers();
    bool eq = true;
    for (std::size_t p = 0; p < tensors; ++p) eq = eq && a.w[p] == b.w[p] && a.w[p] == c.w[p];
    same[static_cast<std::size_t>(rank.rank())] = eq ? 1 : 0;
    if (rank.rank() == 0) {
      res.ddp_state = ddp_opt.state_bytes();
      res.zero_state = zero_opt.state_bytes();
    }
  });
  double const counted = static_cast<double>(rounds) * steps;
  res.ddp_news = static_cast<double>(ddp_news) / counted;
  res.zero_news = static_cast<double>(zero_news) / counted;
  res.ddp_bytes = static_cast<double>(ddp_bytes) / counted;
  res.zero_bytes = static_cast<double>(zero_bytes) / counted;
  res.ddp_step = bench::median(ddp_t);
  res.zero_step = bench::median(zero_t);
  res.overlap_step = bench::median(overlap_t);
  res.same = true;
  for (char c : same) res.same = res.same && c != 0;
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv,
                "usage: zero_memory [--ranks 2,4] [--params-per-tensor 1048576] [--rounds 5] [--steps 3] [--csv FILE]\n");
  auto const ranks = a.list("ranks", {2, 4});
  auto const per = static_cast<std::size_t>(a.num("params-per-tensor", 1048576));
  int const rounds = static_cast<int>(a.num("rounds", 5));
  int const steps = static_cast<int>(a.num("steps", 3));
  std::string const csv = a.str("csv", "");
  a.done();
  std::printf("ZeRO-1 vs DDP, Adam (2 state slots), %zu tensors x %zu = %zu parameters; %s\n", tensors, per,
              tensors * per, bench::load_note().c_str());
  bench::table t({"ranks", "ddp_state_MiB_per_rank", "zero1_state_MiB_per_rank", "state_ratio", "ddp_news_per_step",
                  "zero1_news_per_step", "ddp_new_bytes_per_step", "zero1_new_bytes_per_step", "ddp_step_ms", "zero1_step_ms", "step_time_ratio",
                  "zero1_overlap_step_ms", "overlap_step_time_ratio", "bitwise_equal"});
  for (double r : ranks) {
    int const world = static_cast<int>(r);
    auto const x = run(world, per, rounds, steps);
    double const mib = 1024.0 * 1024.0;
    t.add({std::to_string(world), bench::fmt("%.1f", static_cast<double>(x.ddp_state) / mib),
           bench::fmt("%.1f", static_cast<double>(x.zero_state) / mib),
           bench::fmt("%.4f", static_cast<double>(x.zero_state) / static_cast<double>(x.ddp_state)),
           bench::fmt("%.1f", x.ddp_news), bench::fmt("%.1f", x.zero_news), bench::fmt("%.0f", x.ddp_bytes),
           bench::fmt("%.0f", x.zero_bytes), bench::fmt("%.2f", x.ddp_step * 1e3),
           bench::fmt("%.2f", x.zero_step * 1e3), bench::fmt("%.3f", x.zero_step / x.ddp_step),
           bench::fmt("%.2f", x.overlap_step * 1e3), bench::fmt("%.3f", x.overlap_step / x.ddp_step),
           x.same ? "yes" : "NO"});
  }
  t.print();
  t.write_csv(csv);
  return 0;
}

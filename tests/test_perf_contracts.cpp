// The contracts behind the library's performance, stated as equalities, never as timings:
// - DDP's gradient_as_bucket_view gives the same bits as the copying mode, and refuses (on every
//   rank, with a clear error) ranks whose buckets would differ;
// - DP's reduction, split by elements over the devices, gives the bits of one weighted_sum, and a
//   backend that replaces the coalesced copy and weighted_sum is called with the same bits;
// - the host communicator's small-message path gives the bits of the serial rank-order reference
//   on both sides of its threshold.
// What the same work allocates is test_perf_allocations'.
#include "models.hpp"
#include "perf_common.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dpl = dparallel;

namespace {

using test::flat_model;  // tests/models.hpp: parameters and gradients in flat buffers

/// DDP reducing onto rank 0 only; every step starts from rank 0's parameters.
struct to_root : dpl::ddp {
  using replicate = dpl::policy::broadcast_each_step;
  using reduce = dpl::policy::bucketed_reduce_to_root;
};
static_assert(dpl::semantics<to_root>);

using test::rank_slice;
using test::tiny_buckets;

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// What one rank saw over a short training run: its gradients after every step, its final
/// parameters.
struct trace {
  std::vector<std::vector<float>> grads;
  std::vector<float> params;
};

/// Three synchronised steps, then two no_sync micro-steps and a synchronised one, SGD after each
/// synchronised step; `skip` is a parameter the step never marks ready (needs
/// find_unused_parameters).
template <class Semantics = dpl::ddp>
std::vector<trace> train(int world, bool view, bool hook, dpl::options opts, std::size_t skip = static_cast<std::size_t>(-1)) {
  opts.gradient_as_bucket_view = view;
  std::vector<trace> out(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    flat_model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(3 + rank.rank()));
    dpl::parallel<flat_model, Semantics> ddp(m, rank.group(), opts);
    auto& mine = out[static_cast<std::size_t>(rank.rank())];
    auto fn = [&](flat_model& r, test::samples<float> s, dpl::step_context& ctx) {
      return hook ? r.forward_backward(s, &ctx, skip) : r.forward_backward(s, nullptr, skip);
    };
    for (int step = 0; step < 6; ++step) {
      auto const data = test::dataset<float>::make(5 * static_cast<std::size_t>(world), m.dim,
                                                   static_cast<std::uint64_t>(40 + step), false);
      if (step == 3 || step == 4) {
        auto scope = ddp.no_sync();
        ddp.step(rank_slice(data, rank.rank(), 5), fn);
        continue;
      }
      ddp.step(rank_slice(data, rank.rank(), 5), fn);
      mine.grads.push_back(m.flat_grads());
      m.sgd(0.05f);
    }
    mine.params = m.w;
  });
  return out;
}

}  // namespace

TEST_CASE("gradient_as_bucket_view gives bitwise the results of the copying mode", "[host][ddp][perf][contract]") {
  for (int world = 1; world <= 4; ++world) {
    for (bool hook : {false, true}) {
      for (bool many : {false, true}) {
        INFO("world = " << world << ", grad_ready = " << hook << ", many buckets = " << many);
        auto const opts = many ? tiny_buckets() : dpl::options{};
        auto const copying = train(world, false, hook, opts);
        auto const viewing = train(world, true, hook, opts);
        for (int r = 0; r < world; ++r) {
          auto const& c = copying[static_cast<std::size_t>(r)];
          auto const& v = viewing[static_cast<std::size_t>(r)];
          REQUIRE(c.grads.size() == v.grads.size());
          for (std::size_t k = 0; k < c.grads.size(); ++k) CHECK(same_bits(c.grads[k], v.grads[k]));
          CHECK(same_bits(c.params, v.params));
          CHECK(same_bits(v.params, viewing[0].params));  // replicas identical
        }
      }
    }
  }
}

TEST_CASE("gradient_as_bucket_view: unused parameters and reduce-to-root give the copying mode's bits",
          "[host][ddp][perf][contract]") {
  dpl::options opts = tiny_buckets();
  opts.find_unused_parameters = true;
  auto const copying = train(3, false, true, opts, 2);
  auto const viewing = train(3, true, true, opts, 2);
  for (std::size_t r = 0; r < 3; ++r) {
    for (std::size_t k = 0; k < copying[r].grads.size(); ++k) CHECK(same_bits(copying[r].grads[k], viewing[r].grads[k]));
    CHECK(same_bits(copying[r].params, viewing[r].params));
  }

  auto const root_copying = train<to_root>(3, false, true, tiny_buckets());
  auto const root_viewing = train<to_root>(3, true, true, tiny_buckets());
  for (std::size_t k = 0; k < root_copying[0].grads.size(); ++k)
    CHECK(same_bits(root_copying[0].grads[k], root_viewing[0].grads[k]));  // rank 0 holds the reduction
}

TEST_CASE("DP's reduction split over the devices gives the bits of one weighted_sum", "[host][dp][perf][contract]") {
  using model = test::chunked<float>;
  for (int n = 1; n <= 4; ++n) {
    for (std::size_t b : {std::size_t{3}, std::size_t{10}, std::size_t{37}}) {
      INFO("devices = " << n << ", batch = " << b);
      model master({700, 3, 1, 129}, 11);
      auto const data = test::dataset<float>::make(b, master.dim, 77 + b, false);
      // The reference: every shard's gradient on a copy of the master, then one weighted_sum.
      auto const sizes = dpl::partition(b, static_cast<std::size_t>(n), dpl::chunking::torch_chunk, {}, {});
      std::vector<model> shards;
      std::vector<double> weights;
      std::size_t off = 0;
      for (std::size_t sz : sizes) {
        if (sz == 0) continue;
        shards.push_back(master);
        shards.back().forward_backward(dpl::slice_batch(data.all(), off, off + sz));
        weights.push_back(static_cast<double>(sz) / static_cast<double>(b));
        off += sz;
      }
      std::vector<std::vector<float>> want;
      for (std::size_t p = 0; p < master.g.size(); ++p) {
        std::vector<float> dst(master.g[p].size());
        std::vector<dpl::tensor_ref> src;
        for (auto& s : shards) src.push_back(dpl::view(s.g[p]));
        dpl::host::weighted_sum(dpl::view(dst), src, weights);
        want.push_back(dst);
      }
      dpl::data_parallel<model> dp(master, dpl::host::devices(n));
      dp.step(data.all(), [](model& m, test::samples<float> s) { return m.forward_backward(s); });
      for (std::size_t p = 0; p < want.size(); ++p) CHECK(same_bits(master.g[p], want[p]));
    }
  }
}

TEST_CASE("gradient_as_bucket_view: ranks whose buckets differ fail construction on every rank, saying why",
          "[host][ddp][perf][error]") {
  SECTION("a different gradient layout") {
    std::vector<std::string> seen(3);
    std::mutex mu;
    CHECK_THROWS(dpl::spawn(3, [&](dpl::rank_context& rank) {
      flat_model m({3, 5, 1, 8, 2, 4}, 1, rank.rank() == 2);  // rank 2: gaps between its gradients
      try {
        dpl::distributed_data_parallel<flat_model> ddp(m, rank.group(), {.gradient_as_bucket_view = true});
      } catch (std::exception const& e) {
        std::lock_guard lock(mu);
        seen[static_cast<std::size_t>(rank.rank())] = e.what();
        throw;
      }
    }));
    for (auto const& s : seen)
      CHECK_THAT(s, Catch::Contains("rank 2 planned 6 gradient buckets, rank 0 planned 1") &&
                        Catch::Contains("lay out its gradients the same way"));
  }
  SECTION("gradients that share memory on one rank") {
    std::vector<std::string> seen(2);
    std::mutex mu;
    CHECK_THROWS(dpl::spawn(2, [&](dpl::rank_context& rank) {
      flat_model m;
      m.overlapping = rank.rank() == 1;
      try {
        dpl::distributed_data_parallel<flat_model> ddp(m, rank.group(), {.gradient_as_bucket_view = true});
      } catch (std::exception const& e) {
        std::lock_guard lock(mu);
        seen[static_cast<std::size_t>(rank.rank())] = e.what();
        throw;
      }
    }));
    // The model check refuses it on rank 1 before any bucket is planned; rank 0 hears why.
    CHECK_THAT(seen[1], Catch::Contains("DDP on rank 1") && Catch::Contains("gradient 1 shares memory with gradient 0"));
    CHECK_THAT(seen[0], Catch::Contains("rank 1 aborted the process group") &&
                            Catch::Contains("gradient 1 shares memory with gradient 0"));
  }
  SECTION("a different option") {
    std::vector<std::string> seen(2);
    std::mutex mu;
    CHECK_THROWS(dpl::spawn(2, [&](dpl::rank_context& rank) {
      flat_model m;
      try {
        dpl::distributed_data_parallel<flat_model> ddp(m, rank.group(), {.gradient_as_bucket_view = rank.rank() == 1});
      } catch (std::exception const& e) {
        std::lock_guard lock(mu);
        seen[static_cast<std::size_t>(rank.rank())] = e.what();
        throw;
      }
    }));
    for (auto const& s : seen)
      CHECK_THAT(s, Catch::Contains("rank 1 has gradient_as_bucket_view = true, rank 0 has false"));
  }
}

TEST_CASE("gradient_as_bucket_view: gradients moved relative to each other fail the step on every rank",
          "[host][ddp][perf][error]") {
  std::vector<std::string> seen(2);
  std::mutex mu;
  CHECK_THROWS(dpl::spawn(
      2,
      [&](dpl::rank_context& rank) {
        flat_model m;
        dpl::distributed_data_parallel<flat_model> ddp(m, rank.group(), {.gradient_as_bucket_view = true});
        auto const data = test::dataset<float>::make(4, m.dim, 2, false);
        auto fn = [](flat_model& r, test::samples<float> s, dpl::step_context& ctx) { return r.forward_backward(s, &ctx); };
        ddp.step(rank_slice(data, rank.rank(), 2), fn);
        m.relayout(false);  // the whole buffer moves: the buckets move with it, fine
        ddp.step(rank_slice(data, rank.rank(), 2), fn);
        if (rank.rank() == 1) m.relayout(true);  // gaps: the plan no longer describes rank 1's memory
        try {
          ddp.step(rank_slice(data, rank.rank(), 2), fn);
        } catch (std::exception const& e) {
          std::lock_guard lock(mu);
          seen[static_cast<std::size_t>(rank.rank())] = e.what();
          throw;
        }
      },
      {.timeout = std::chrono::seconds(30)}));
  CHECK_THAT(seen[1], Catch::Contains("is no longer where it was"));
  CHECK_THAT(seen[0], Catch::Contains("rank 1"));
}

namespace {
/// Deterministic values spanning several decades and both signs (summation order shows in the bits).
template <class T>
T value(int rank, std::size_t i, unsigned salt) {
  std::uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(rank) + 1) * 0xC2B2AE3D27D4EB4Full ^
                    salt * 0x165667B19E3779F9ull;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  double const m = static_cast<double>(h % 1000003) / 500001.0 - 1.0;
  constexpr double scale[5] = {1e-3, 1e-1, 1.0, 1e2, 1e4};
  return static_cast<T>(m * scale[(h >> 20) % 5]);
}

template <class T>
void check_around_threshold(int n) {
  std::size_t const edge = dpl::detail::host_group::small_collective_bytes / sizeof(T);
  auto groups = dpl::host::make_group(n, std::chrono::seconds(60));
  unsigned salt = 0;
  for (std::size_t count : {edge - 1, edge, edge + 1, 3 * edge}) {
    for (auto op : {dpl::reduce_op::sum, dpl::reduce_op::avg}) {
      ++salt;
      INFO("ranks = " << n << ", elements = " << count << ", avg = " << (op == dpl::reduce_op::avg)
                      << ", bytes per element = " << sizeof(T));
      std::vector<std::vector<T>> ar(static_cast<std::size_t>(n)), rd(ar.size()), rs(ar.size()), ag(ar.size());
      std::vector<std::vector<T>> rs_out(ar.size(), std::vector<T>(count));
      std::vector<T> want(count), want_rs(static_cast<std::size_t>(n) * count), gathered;
      for (int r = 0; r < n; ++r) {
        auto& a = ar[static_cast<std::size_t>(r)];
        for (std::size_t i = 0; i < count; ++i) a.push_back(value<T>(r, i, salt));
        rd[static_cast<std::size_t>(r)] = a;
        for (std::size_t i = 0; i < static_cast<std::size_t>(n) * count; ++i)
          rs[static_cast<std::size_t>(r)].push_back(value<T>(r, i, salt + 1000));
        for (std::size_t i = 0; i < count; ++i) ag[static_cast<std::size_t>(r)].push_back(value<T>(r, i, salt + 2000));
        gathered.insert(gathered.end(), ag[static_cast<std::size_t>(r)].begin(), ag[static_cast<std::size_t>(r)].end());
      }
      auto const scale = T(1) / static_cast<T>(n);
      for (std::size_t i = 0; i < count; ++i) {  // ((x0 + x1) + x2) + ..., then the average's factor
        T v = ar[0][i];
        for (int r = 1; r < n; ++r) v += ar[static_cast<std::size_t>(r)][i];
        want[i] = op == dpl::reduce_op::avg ? v * scale : v;
      }
      for (std::size_t i = 0; i < want_rs.size(); ++i) {
        T v = rs[0][i];
        for (int r = 1; r < n; ++r) v += rs[static_cast<std::size_t>(r)][i];
        want_rs[i] = op == dpl::reduce_op::avg ? v * scale : v;
      }
      std::vector<std::vector<T>> ag_out(ar.size(), std::vector<T>(static_cast<std::size_t>(n) * count));
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          auto const u = static_cast<std::size_t>(r);
          auto& g = groups[u];
          auto w1 = g.all_reduce(dpl::view(ar[u]), op);
          auto w2 = g.reduce(dpl::view(rd[u]), n - 1, op);
          auto w3 = g.reduce_scatter(dpl::view(rs_out[u]), dpl::view(rs[u]), op);
          auto w4 = g.all_gather(dpl::view(ag_out[u]), dpl::view(ag[u]));
          w1.wait();
          w2.wait();
          w3.wait();
          w4.wait();
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < n; ++r) {
        auto const u = static_cast<std::size_t>(r);
        CHECK(std::memcmp(ar[u].data(), want.data(), count * sizeof(T)) == 0);
        if (r == n - 1) CHECK(std::memcmp(rd[u].data(), want.data(), count * sizeof(T)) == 0);
        CHECK(std::memcmp(rs_out[u].data(), want_rs.data() + u * count, count * sizeof(T)) == 0);
        CHECK(std::memcmp(ag_out[u].data(), gathered.data(), gathered.size() * sizeof(T)) == 0);
      }
    }
  }
}
}  // namespace

TEST_CASE("host communicator: both sides of the small-message threshold give the rank-order bits",
          "[host][comm][perf][contract]") {
  for (int n = 1; n <= 4; ++n) {
    check_around_threshold<float>(n);
    check_around_threshold<double>(n);
  }
}

namespace {
/// A host backend that replaces copy_all and weighted_sum (counting the calls): its replacements
/// hide host::backend's borrowed overloads, so the policies must call them, on the per-step path.
struct replacing_backend : dpl::host::backend {
  static inline std::atomic<std::size_t> copies{0}, sums{0};
  static event_type copy_all(stream_type& s, std::vector<dpl::tensor_ref> dst, std::vector<dpl::tensor_ref> src) {
    ++copies;
    return dpl::host::backend::copy_all(s, std::move(dst), std::move(src));
  }
  static event_type weighted_sum(stream_type& s, dpl::tensor_ref dst, std::vector<dpl::tensor_ref> srcs,
                                 std::vector<double> w) {
    ++sums;
    return dpl::host::backend::weighted_sum(s, dst, std::move(srcs), std::move(w));
  }
};
static_assert(dpl::detail::borrowed_copy_all<dpl::host::backend> && dpl::detail::borrowed_weighted_sum<dpl::host::backend>);
static_assert(!dpl::detail::borrowed_copy_all<replacing_backend> && !dpl::detail::borrowed_weighted_sum<replacing_backend>);
}  // namespace

TEST_CASE("a backend that replaces copy_all and weighted_sum is called by DP's policies, with the same bits",
          "[host][dp][perf][contract]") {
  using model = test::chunked<float>;
  std::vector<std::size_t> const sizes{700, 3, 1, 129};
  model borrowed_master(sizes, 11), replaced_master(sizes, 11);
  dpl::data_parallel<model> borrowed(borrowed_master, dpl::host::devices(3));
  dpl::parallel<model, dpl::dp, replacing_backend> replaced(replaced_master, dpl::host::devices(3));
  replacing_backend::copies = 0;
  replacing_backend::sums = 0;
  auto fn = [](model& m, test::samples<float> s) { return m.forward_backward(s); };
  for (int step = 0; step < 2; ++step) {
    auto const data = test::dataset<float>::make(10, borrowed_master.dim, 30 + static_cast<std::uint64_t>(step), false);
    auto const a = borrowed.step(data.all(), fn);
    auto const b = replaced.step(data.all(), fn);
    CHECK(same_bits(a, b));
    for (std::size_t p = 0; p < sizes.size(); ++p) CHECK(same_bits(borrowed_master.g[p], replaced_master.g[p]));
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      borrowed_master.w[p][0] += 0.5f;  // the replicas must see the master's new values
      replaced_master.w[p][0] += 0.5f;
    }
  }
  // Per step: one coalesced copy per replica (2), one weighted_sum per non-empty slice of each
  // gradient (700, 3 and 129 elements: 3 slices each; 1 element: 1).
  CHECK(replacing_backend::copies == 2 * 2);
  CHECK(replacing_backend::sums == 2 * 10);
}

namespace {
/// A host backend with begin_step (as cuda::backend has, to order its streams after the caller's
/// work): it records, at each call, the calling thread and how many step functions had started.
struct begin_step_backend : dpl::host::backend {
  static inline std::atomic<int> started{0};
  static inline std::vector<int> started_at_call;  // written on the calling thread only
  static inline std::vector<std::thread::id> callers;
  static void begin_step(stream_type&) {
    started_at_call.push_back(started.load());
    callers.push_back(std::this_thread::get_id());
  }
};
/// One thread rank's log of begin_step calls (thread_local: each rank runs on its thread).
struct per_rank_backend : dpl::host::backend {
  static inline thread_local std::vector<int>* log = nullptr;
  static void begin_step(stream_type&) { log->push_back(1); }
};
template <class B>
concept has_begin_step = requires(typename B::stream_type& s) { B::begin_step(s); };
static_assert(!has_begin_step<dpl::host::backend> && has_begin_step<begin_step_backend>);
}  // namespace

TEST_CASE("a backend's begin_step runs on the calling thread for every stream before each step's work",
          "[host][dp][ddp][contract]") {
  using model = test::chunked<float>;
  SECTION("DataParallel over 3 devices") {
    begin_step_backend::started = 0;
    begin_step_backend::started_at_call.clear();
    begin_step_backend::callers.clear();
    model master({5, 3}, 1);
    dpl::parallel<model, dpl::dp, begin_step_backend> dp(master, dpl::host::devices(3));
    auto const data = test::dataset<float>::make(9, master.dim, 3, false);
    for (int step = 0; step < 4; ++step)
      dp.step(data.all(), [](model& m, test::samples<float> s) {
        ++begin_step_backend::started;
        return m.forward_backward(s);
      });
    CHECK(begin_step_backend::started_at_call == std::vector<int>{0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9, 9});
    CHECK(begin_step_backend::callers == std::vector<std::thread::id>(12, std::this_thread::get_id()));
  }
  SECTION("DDP over 2 thread ranks: each rank's one stream, on the rank's thread") {
    std::vector<std::vector<int>> calls(2);
    std::mutex mu;
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      std::vector<int> mine;
      per_rank_backend::log = &mine;
      model m({5, 3}, 1);
      dpl::parallel<model, dpl::ddp, per_rank_backend> ddp(m, rank.group());
      auto const data = test::dataset<float>::make(4, m.dim, 3, false);
      for (int step = 0; step < 3; ++step)
        ddp.step(rank_slice(data, rank.rank(), 2),
                 [](model& r, test::samples<float> s) { return r.forward_backward(s); });
      std::lock_guard lock(mu);
      calls[static_cast<std::size_t>(rank.rank())] = mine;
    });
    CHECK(calls == std::vector<std::vector<int>>(2, std::vector<int>(3, 1)));
  }
  SECTION("DDP join(): every shadow step begins as a step does") {
    // Rank 0 steps twice, then joins; rank 1 joins at once and shadows those two steps. Each
    // rank's join ends with one more round (which finds every rank joined), also begun.
    std::vector<std::vector<int>> calls(2);
    std::mutex mu;
    dpl::options o;
    o.uneven_inputs = true;
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      std::vector<int> mine;
      per_rank_backend::log = &mine;
      model m({5, 3}, 1);
      dpl::parallel<model, dpl::ddp, per_rank_backend> ddp(m, rank.group(), o);
      auto const data = test::dataset<float>::make(4, m.dim, 3, false);
      if (rank.rank() == 0)
        for (int step = 0; step < 2; ++step)
          ddp.step(data.all(), [](model& r, test::samples<float> s) { return r.forward_backward(s); });
      ddp.join();
      std::lock_guard lock(mu);
      calls[static_cast<std::size_t>(rank.rank())] = mine;
    });
    CHECK(calls == std::vector<std::vector<int>>(2, std::vector<int>(3, 1)));
  }
}

// The engine-neutral progress piece (comm/detail/progress.hpp) and the device staging planner
// (comm/detail/staging_plan.hpp), on the host: a fake engine whose collectives complete when the
// test says so stands in for NCCL's events.
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/detail/staging_plan.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/error.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using dparallel::detail::collective_poller;
using dparallel::detail::poll_result;

// A collective of the fake engine: completes once the test sets `state`.
struct fake_op {
  int id = 0;
  std::atomic<int> state{0};  // 0 running, 1 done, 2 failed on the device
};

// The fake engine, recording the order of what the poller asks of it.
struct fake_driver {
  using handle = std::shared_ptr<fake_op>;
  std::mutex m;
  std::vector<std::string> log;
  std::atomic<int> aborts{0};
  std::atomic<int> releases{0};
  std::string async;  // engine-wide error (under m)

  void note(std::string s) {
    std::lock_guard lock(m);
    log.push_back(std::move(s));
  }
  poll_result poll(handle& h) {
    int const s = h->state.load();
    if (s == 1) return poll_result::done();
    if (s == 2) return poll_result::failed("the device reported an illegal address");
    return poll_result::pending();
  }
  std::string async_error() {
    std::lock_guard lock(m);
    return async;
  }
  void finish(handle& h) { note("finish " + std::to_string(h->id)); }
  void release(handle& h) noexcept {
    ++releases;
    note("release " + std::to_string(h->id));
  }
  void abort_native() noexcept {
    ++aborts;
    note("abort");
  }
  std::vector<std::string> snapshot() {
    std::lock_guard lock(m);
    return log;
  }
};

constexpr auto long_timeout = std::chrono::minutes(10);

std::shared_ptr<fake_op> make_op(int id) {
  auto op = std::make_shared<fake_op>();
  op->id = id;
  return op;
}

dparallel::work launch(collective_poller<fake_driver>& p, std::shared_ptr<fake_op> const& op,
                       std::chrono::milliseconds timeout = long_timeout) {
  return p.launch("all_reduce of 4 x F32", timeout, [&] { return op; });
}

template <class E>
std::string error_of(dparallel::work const& w, int* rank = nullptr) {
  try {
    w.wait();
  } catch (E const& e) {
    if constexpr (std::is_base_of_v<dparallel::comm_error, E>) {
      if (rank != nullptr) *rank = e.rank();
    }
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("collective_poller: a launch goes through while an earlier collective is pending", "[progress]") {
  // The NCCL poller this replaces held its mutex while a collective was pending, so this second
  // launch (and pending(), abort(), drain()) waited for the first collective: it deadlocked here.
  fake_driver d;
  collective_poller<fake_driver> p(0, d);
  auto a = make_op(1), b = make_op(2), c = make_op(3);
  auto const wa = launch(p, a);
  auto const wb = launch(p, b);
  auto const wc = launch(p, c);
  CHECK(p.pending() == 3);
  CHECK_FALSE(wa.ready());
  // Completion follows the order of issue: b done before a stays pending until a is.
  b->state = 1;
  c->state = 1;
  a->state = 1;
  wa.wait();
  wb.wait();
  wc.wait();
  p.drain();
  CHECK(p.pending() == 0);
  CHECK(p.completed() == 3);
  CHECK(d.snapshot() ==
        std::vector<std::string>{"finish 1", "release 1", "finish 2", "release 2", "finish 3", "release 3"});
  CHECK(d.aborts == 0);
}

TEST_CASE("collective_poller: launches from several threads while collectives are pending", "[progress]") {
  fake_driver d;
  collective_poller<fake_driver> p(1, d);
  std::vector<std::shared_ptr<fake_op>> ops;
  for (int i = 0; i < 64; ++i) ops.push_back(make_op(i));
  auto const first = launch(p, ops[0]);
  std::vector<dparallel::work> works(ops.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([&, t] {
      for (std::size_t i = 1 + static_cast<std::size_t>(t); i < ops.size(); i += 3) works[i] = launch(p, ops[i]);
    });
  for (auto& t : threads) t.join();
  CHECK(p.pending() == ops.size());  // every launch returned while ops[0] was still pending
  CHECK_FALSE(first.ready());
  for (auto& op : ops) op->state = 1;
  p.drain();
  CHECK(p.completed() == ops.size());
  CHECK(d.releases == static_cast<int>(ops.size()));
}

TEST_CASE("collective_poller: abort with pending work aborts the engine first then releases and fails each",
          "[progress]") {
  fake_driver d;
  collective_poller<fake_driver> p(3, d);
  auto a = make_op(1), b = make_op(2);
  auto const wa = launch(p, a);
  auto const wb = launch(p, b);
  p.abort("the step threw");
  // abort() returns once every pending work completed: no wait needed to see them failed.
  REQUIRE(wa.ready());
  REQUIRE(wb.ready());
  int rank = -1;
  std::string const ea = error_of<dparallel::comm_error>(wa, &rank);
  CHECK(rank == 3);
  CHECK_THAT(ea, Catch::Contains("rank 3 aborted the process group: the step threw"));
  CHECK_THAT(ea, Catch::Contains("all_reduce of 4 x F32 (collective #1)"));
  CHECK_THAT(error_of<dparallel::comm_error>(wb), Catch::Contains("(collective #2)"));
  CHECK(d.snapshot() == std::vector<std::string>{"abort", "release 1", "release 2"});
  CHECK(d.aborts == 1);
  // Sticky: a later launch fails at once, without reaching the engine.
  bool made = false;
  auto const late = p.launch("barrier", long_timeout, [&] {
    made = true;
    return make_op(9);
  });
  CHECK_FALSE(made);
  CHECK_THAT(error_of<dparallel::comm_error>(late), Catch::Contains("the step threw"));
  p.abort("again");  // the first failure wins; the engine is not aborted twice
  CHECK(d.aborts == 1);
  CHECK(p.aborted());
}

TEST_CASE("collective_poller: abort without pending work aborts the engine once", "[progress]") {
  fake_driver d;
  collective_poller<fake_driver> p(0, d);
  auto a = make_op(1);
  a->state = 1;
  launch(p, a).wait();
  p.abort("done with it");
  CHECK(d.aborts == 1);
  CHECK(p.failed());
  CHECK(d.snapshot() == std::vector<std::string>{"finish 1", "release 1", "abort"});
}

TEST_CASE("collective_poller: a collective past its timeout fails the group naming the rank", "[progress]") {
  fake_driver d;
  collective_poller<fake_driver> p(2, d);
  auto a = make_op(1), b = make_op(2);
  auto const wa = launch(p, a, std::chrono::milliseconds(1));  // never completes
  auto const wb = launch(p, b);
  int rank = -1;
  std::string const ea = error_of<dparallel::timeout_error>(wa, &rank);
  CHECK(rank == 2);
  CHECK_THAT(ea, Catch::Contains("did not complete within 1 ms on rank 2"));
  CHECK_THAT(ea, Catch::Contains("all_reduce of 4 x F32 (collective #1)"));
  CHECK_THAT(error_of<dparallel::timeout_error>(wb), Catch::Contains("(collective #2) failed"));
  p.drain();
  CHECK(d.snapshot() == std::vector<std::string>{"abort", "release 1", "release 2"});
}

TEST_CASE("collective_poller: device and engine errors fail the group", "[progress]") {
  SECTION("the collective failed on the device") {
    fake_driver d;
    collective_poller<fake_driver> p(1, d);
    auto a = make_op(1);
    auto const wa = launch(p, a);
    a->state = 2;
    CHECK_THAT(error_of<dparallel::comm_error>(wa), Catch::Contains("illegal address"));
    p.drain();
    CHECK(d.aborts == 1);
  }
  SECTION("an engine-wide (asynchronous) error") {
    fake_driver d;
    collective_poller<fake_driver> p(1, d);
    auto a = make_op(1);
    auto const wa = launch(p, a);
    {
      std::lock_guard lock(d.m);
      d.async = "unhandled system error";
    }
    std::string const e = error_of<dparallel::comm_error>(wa);
    CHECK_THAT(e, Catch::Contains("unhandled system error"));
    CHECK_THAT(e, Catch::Contains("rank 1"));
    p.drain();
    CHECK(d.aborts == 1);
  }
}

TEST_CASE("collective_poller: a launch that throws fails only its own work", "[progress]") {
  fake_driver d;
  collective_poller<fake_driver> p(0, d);
  auto const bad = p.launch("broadcast", long_timeout, []() -> std::shared_ptr<fake_op> {
    throw dparallel::invalid_argument("dparallel: bad root");
  });
  CHECK(error_of<dparallel::invalid_argument>(bad) == "dparallel: bad root");
  CHECK_FALSE(p.failed());
  auto a = make_op(1);
  a->state = 1;
  launch(p, a).wait();
  CHECK(p.completed() == 2);
}

TEST_CASE("collective_poller: destruction drains (each collective ends at its timeout at the latest)", "[progress]") {
  fake_driver d;
  dparallel::work w;
  {
    collective_poller<fake_driver> p(0, d);
    w = launch(p, make_op(1), std::chrono::milliseconds(1));
  }
  REQUIRE(w.ready());
  CHECK_THAT(error_of<dparallel::timeout_error>(w), Catch::Contains("did not complete within 1 ms"));
}

namespace {

// An enqueue that blocks, as NCCL's does while it waits for a peer that never joins: it returns
// only once the engine is aborted (the fake's abort_native), or after `bail` so that a poller
// that never aborts fails this test instead of hanging it.
std::shared_ptr<fake_op> blocked_enqueue(fake_driver& d, int id, std::atomic<bool>& inside,
                                         std::chrono::seconds bail = std::chrono::seconds(20)) {
  inside = true;
  auto const until = std::chrono::steady_clock::now() + bail;
  while (d.aborts == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  d.note(d.aborts == 0 ? "enqueue gave up" : "enqueue ended by the abort");
  return make_op(id);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("collective_poller: an enqueue blocked behind a hung peer is aborted at its timeout", "[progress][blocked]") {
  // The launch holds the launch mutex while it is inside the engine; the watchdog must abort the
  // engine without waiting for that mutex, or the blocked enqueue and the watchdog wait forever.
  using namespace std::chrono_literals;
  auto const bound = 5.0;  // seconds: the timeout plus the grace, with room for a loaded machine
  SECTION("the only collective: nothing queued, the launch itself is watched") {
    fake_driver d;
    collective_poller<fake_driver> p(4, d);
    std::atomic<bool> inside{false};
    auto const t0 = std::chrono::steady_clock::now();
    auto const w = p.launch("all_reduce of 8 x F32", 200ms, [&] { return blocked_enqueue(d, 1, inside); });
    double const took = seconds_since(t0);
    REQUIRE(w.ready());
    int rank = -1;
    std::string const e = error_of<dparallel::timeout_error>(w, &rank);
    CHECK(rank == 4);
    CHECK_THAT(e, Catch::Contains("all_reduce of 8 x F32 (collective #1) did not complete within 200 ms"));
    CHECK_THAT(e, Catch::Contains("rank 4 was still inside the engine's call that launches it"));
    CHECK(took >= 0.2);
    CHECK(took < bound);
    CHECK(d.aborts == 1);
    auto const log = d.snapshot();
    CHECK(std::count(log.begin(), log.end(), "enqueue ended by the abort") == 1);
    CHECK(log.back() == "release 1");  // released by the launch once it came out, after the abort
    CHECK_THAT(error_of<dparallel::timeout_error>(launch(p, make_op(2))), Catch::Contains("(collective #2) failed"));
  }
  SECTION("a queued collective times out while the next launch is blocked") {
    fake_driver d;
    collective_poller<fake_driver> p(4, d);
    std::atomic<bool> inside{false};
    auto const t0 = std::chrono::steady_clock::now();
    auto const wa = launch(p, make_op(1), 1000ms);  // never completes
    dparallel::work wb;
    std::thread issuer([&] { wb = p.launch("broadcast of 2 x F64", long_timeout, [&] { return blocked_enqueue(d, 2, inside); }); });
    for (int i = 0; !inside && i < 900; ++i) std::this_thread::sleep_for(1ms);
    REQUIRE(inside);  // the second launch is inside the engine before the first's deadline
    std::string const ea = error_of<dparallel::timeout_error>(wa);
    double const took = seconds_since(t0);
    issuer.join();
    CHECK_THAT(ea, Catch::Contains("(collective #1) did not complete within 1000 ms"));
    CHECK(took >= 1.0);
    CHECK(took < 1.0 + bound);
    REQUIRE(wb.ready());
    CHECK_THAT(error_of<dparallel::timeout_error>(wb), Catch::Contains("broadcast of 2 x F64 (collective #2) failed"));
    CHECK(d.aborts == 1);
    auto const log = d.snapshot();
    CHECK(std::count(log.begin(), log.end(), "enqueue ended by the abort") == 1);
    CHECK(std::count(log.begin(), log.end(), "release 2") == 1);
  }
  SECTION("abort() while a launch is blocked returns and ends the launch") {
    fake_driver d;
    collective_poller<fake_driver> p(4, d);
    std::atomic<bool> inside{false};
    dparallel::work w;
    std::thread issuer([&] { w = p.launch("barrier", long_timeout, [&] { return blocked_enqueue(d, 1, inside); }); });
    for (int i = 0; !inside && i < 10'000; ++i) std::this_thread::sleep_for(1ms);
    REQUIRE(inside);
    auto const t0 = std::chrono::steady_clock::now();
    p.abort("giving up on a hung peer");
    double const took = seconds_since(t0);
    issuer.join();
    CHECK(took < bound);
    CHECK_THAT(error_of<dparallel::comm_error>(w), Catch::Contains("rank 4 aborted the process group: giving up on a hung peer"));
    CHECK(d.aborts == 1);
  }
}

// --- the staging plan ---------------------------------------------------------------------------

using dparallel::detail::plan_staging;
using dparallel::detail::staging_side;

TEST_CASE("plan_staging: only the host side is staged and sized for that side", "[progress][staging]") {
  std::vector<float> host(8);
  float dev[32];  // stands for device memory: the planner only compares addresses
  SECTION("both sides on the device: nothing staged") {
    auto const p = plan_staging({dev, 32, false}, {dev, 32, false}, "t");
    CHECK_FALSE(p.any());
    CHECK(p.bytes == 0);
  }
  SECTION("device in, host out (e.g. all_gather into host memory)") {
    auto const p = plan_staging({dev, 8, false}, {host.data(), 32, true}, "t");
    CHECK_FALSE(p.stage_in);
    CHECK(p.stage_out);
    CHECK(p.bytes == 32);
    CHECK(p.out_offset == 0);
  }
  SECTION("host in, device out") {
    auto const p = plan_staging({host.data(), 32, true}, {dev, 8, false}, "t");
    CHECK(p.stage_in);
    CHECK_FALSE(p.stage_out);
    CHECK(p.bytes == 32);
  }
  SECTION("both on the host, disjoint: out after in, aligned") {
    std::vector<float> out(24);
    auto const p = plan_staging({host.data(), 32, true}, {out.data(), 96, true}, "t");
    CHECK(p.stage_in);
    CHECK(p.stage_out);
    CHECK(p.in_offset == 0);
    CHECK(p.out_offset == 256);
    CHECK(p.bytes == 256 + 96);
  }
  SECTION("empty sides are never staged") {
    auto const p = plan_staging({nullptr, 0, true}, {nullptr, 0, true}, "t");
    CHECK_FALSE(p.any());
  }
}

TEST_CASE("plan_staging: in place on the host stages one region as large as the larger side",
          "[progress][staging]") {
  SECTION("all_reduce: one buffer") {
    std::vector<float> t(4);
    auto const p = plan_staging({t.data(), 16, true}, {t.data(), 16, true}, "t");
    CHECK((p.stage_in && p.stage_out));
    CHECK(p.bytes == 16);
    CHECK(p.in_offset == 0);
    CHECK(p.out_offset == 0);
  }
  SECTION("all_gather in place: in is block rank of out, on every rank including 0") {
    int const n = 4;
    std::size_t const m = 3;
    std::vector<float> out(n * m);
    for (int rank = 0; rank < n; ++rank) {
      float* in = out.data() + static_cast<std::size_t>(rank) * m;
      auto const p = plan_staging({in, m * 4, true}, {out.data(), n * m * 4, true}, "all_gather");
      CHECK(p.bytes == n * m * 4);  // the whole output (the old code staged `in`'s size on rank 0)
      CHECK(p.out_offset == 0);
      CHECK(p.in_offset == static_cast<std::size_t>(rank) * m * 4);  // sendbuff == recvbuff + rank * m
    }
  }
  SECTION("reduce_scatter in place: out is block rank of in") {
    std::vector<float> in(12);
    auto const p = plan_staging({in.data(), 48, true}, {in.data() + 6, 24, true}, "reduce_scatter");
    CHECK(p.bytes == 48);
    CHECK(p.in_offset == 0);
    CHECK(p.out_offset == 24);
  }
  SECTION("a partial overlap is rejected") {
    std::vector<float> t(8);
    CHECK_THROWS_AS(plan_staging({t.data(), 16, true}, {t.data() + 2, 16, true}, "all_gather"),
                    dparallel::invalid_argument);
  }
}

// The host communicator's failures (timeout, abort, mismatch, invalid arguments, a rank that
// throws) reach every rank as errors naming the rank at fault, and no thread is left behind;
// spawn; process_group, the type-erased handle. The results of the collectives:
// test_comm_host.cpp.
//
// Catch2 assertions are not thread-safe, so rank threads only record what they saw; every
// REQUIRE runs on the test's own thread after the rank threads have been joined.

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include "host_comm_checks.hpp"
#include "rank_threads.hpp"
#include "threads.hpp"

#include <chrono>
#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

namespace {

using test::caught;
using test::contains;
using test::inputs;
using test::inspect;
using test::inspect_wait;
using test::on_ranks;
using test::rethrow_first;
using test::same_bits;
using test::serial_reduce;
using test::thread_count;
using test::thread_count_settled;

}  // namespace

// -----------------------------------------------------------------------------------------------
// Failures

TEST_CASE("host: a rank that never calls makes the others time out, naming it", "[host][comm]") {
  auto groups = dp::host::make_group(3, 200ms);
  std::vector<std::vector<float>> x(3, std::vector<float>(8, 1.0f));
  std::vector<caught> seen(3);
  // All three meet at a barrier; then ranks 0 and 1 call all_reduce (issued together with the
  // barrier, so their threads post it right after) and rank 2 never does.
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    dp::work const first = g.barrier();
    if (r == 2) return first.wait();
    dp::work const second = g.all_reduce(dp::view(x[static_cast<std::size_t>(r)]));
    first.wait();
    seen[static_cast<std::size_t>(r)] = inspect_wait(second);
  }));
  for (int r : {0, 1}) {
    auto const& c = seen[static_cast<std::size_t>(r)];
    INFO(c.what);
    REQUIRE(c.timeout);
    REQUIRE(c.rank == 2);
    REQUIRE(contains(c.what, "rank 2 did not call collective #2 within 200 ms"));
    REQUIRE(contains(c.what, "all_reduce(8 x F32, sum)"));
  }
  // The group stays failed: rank 2's late call fails too, with the same diagnosis.
  auto const late = inspect_wait(groups[2].all_reduce(dp::view(x[2])));
  REQUIRE(late.timeout);
  REQUIRE(late.rank == 2);
  // The data was not touched.
  for (auto const& v : x) REQUIRE(v == std::vector<float>(8, 1.0f));
}

TEST_CASE("host: a timeout names every missing rank, the first as rank()", "[host][comm]") {
  auto groups = dp::host::make_group(4, 200ms);
  std::vector<caught> seen(4);
  // All four meet at a barrier, then ranks 1 and 3 stop calling.
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    dp::work const first = g.barrier();
    if (r == 1 || r == 3) return first.wait();
    dp::work const second = g.barrier();
    first.wait();
    seen[static_cast<std::size_t>(r)] = inspect_wait(second);
  }));
  for (int r : {0, 2}) {
    auto const& c = seen[static_cast<std::size_t>(r)];
    INFO(c.what);
    REQUIRE(c.timeout);
    REQUIRE(c.rank == 1);
    REQUIRE(contains(c.what, "ranks 1 and 3 did not call collective #2"));
    REQUIRE(contains(c.what, "barrier()"));
  }
}

TEST_CASE("host: abort fails every pending and future collective on every rank", "[host][comm]") {
  auto groups = dp::host::make_group(3, 120s);  // long: the abort, not the timeout, ends the waits
  std::vector<std::vector<double>> x(3, std::vector<double>(100, 2.0));
  std::vector<std::vector<caught>> seen(3);
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    auto& mine = seen[static_cast<std::size_t>(r)];
    if (r == 2) {
      g.abort("stop now");
      mine.push_back(inspect_wait(g.all_reduce(dp::view(x[2]))));  // a future one, on the aborting rank
      return;
    }
    // Several pending collectives each, whatever the order relative to the abort.
    std::vector<dp::work> works{g.all_reduce(dp::view(x[static_cast<std::size_t>(r)])), g.barrier(),
                                g.broadcast(dp::view(x[static_cast<std::size_t>(r)]), 0)};
    for (auto const& w : works) mine.push_back(inspect_wait(w));
    mine.push_back(inspect_wait(g.barrier()));  // a future one
  }));
  for (int r = 0; r < 3; ++r) {
    for (auto const& c : seen[static_cast<std::size_t>(r)]) {
      INFO("rank " << r << ": " << c.what);
      REQUIRE(c.comm);
      REQUIRE_FALSE(c.timeout);
      REQUIRE(c.rank == 2);
      REQUIRE(contains(c.what, "rank 2 aborted the process group: stop now"));
    }
  }
  REQUIRE(seen[0].size() == 4);
  REQUIRE(groups[0].completed_ops() == 4);  // failed collectives are finished too
}

TEST_CASE("host: mismatched collectives fail on every rank, showing both calls", "[host][comm]") {
  struct mismatch {
    char const* name;
    int odd_rank;
    char const* expected_call;
    char const* odd_call;
  };
  for (auto const& mm : {mismatch{"op", 2, "all_reduce(100 x F32, sum)", "broadcast(100 x F32, root 0)"},
                         mismatch{"count", 1, "all_reduce(100 x F32, sum)", "all_reduce(99 x F32, sum)"},
                         mismatch{"dtype", 2, "all_reduce(100 x F32, sum)", "all_reduce(100 x F64, sum)"},
                         mismatch{"reduce op", 1, "all_reduce(100 x F32, sum)", "all_reduce(100 x F32, avg)"},
                         mismatch{"root", 2, "broadcast(100 x F32, root 0)", "broadcast(100 x F32, root 1)"}}) {
    INFO("mismatched " << mm.name);
    std::string const name = mm.name;
    auto groups = dp::host::make_group(3, 120s);
    std::vector<std::vector<float>> xf(3, std::vector<float>(100, 3.0f));
    std::vector<double> xd(100, 3.0);
    std::vector<caught> seen(3);
    rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
      auto const ur = static_cast<std::size_t>(r);
      bool const odd = r == mm.odd_rank;
      dp::work w;
      if (name == "op") {
        w = odd ? g.broadcast(dp::view(xf[ur]), 0) : g.all_reduce(dp::view(xf[ur]));
      } else if (name == "count") {
        w = g.all_reduce(dp::tensor_ref(dp::view(xf[ur])).subview(0, odd ? 99 : 100));
      } else if (name == "dtype") {
        w = odd ? g.all_reduce(dp::view(xd)) : g.all_reduce(dp::view(xf[ur]));
      } else if (name == "reduce op") {
        w = g.all_reduce(dp::view(xf[ur]), odd ? dp::reduce_op::avg : dp::reduce_op::sum);
      } else {
        w = g.broadcast(dp::view(xf[ur]), odd ? 1 : 0);
      }
      seen[ur] = inspect_wait(w);
    }));
    for (int r = 0; r < 3; ++r) {
      auto const& c = seen[static_cast<std::size_t>(r)];
      INFO("rank " << r << ": " << c.what);
      REQUIRE(c.comm);
      REQUIRE_FALSE(c.timeout);
      REQUIRE(c.rank == mm.odd_rank);
      REQUIRE(contains(c.what, std::string("rank 0 called ") + mm.expected_call));
      REQUIRE(contains(c.what, "rank " + std::to_string(mm.odd_rank) + " called " + mm.odd_call));
    }
    // Nothing was read or written.
    for (auto const& v : xf) REQUIRE(v == std::vector<float>(100, 3.0f));
    REQUIRE(xd == std::vector<double>(100, 3.0));
  }
}

TEST_CASE("host: invalid arguments throw on the caller and fail its peers at once", "[host][comm]") {
  SECTION("a dtype the host communicator cannot reduce") {
    auto groups = dp::host::make_group(2, 120s);
    std::vector<std::int32_t> xi(10, 1);
    std::vector<float> xf(10, 1.0f);
    std::vector<caught> seen(2);
    rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
      if (r == 1) {
        try {
          (void)g.all_reduce(dp::view(xi));
        } catch (...) {
          seen[1] = inspect(std::current_exception());
        }
      } else {
        seen[0] = inspect_wait(g.all_reduce(dp::view(xf)));
      }
    }));
    INFO(seen[1].what);
    REQUIRE(seen[1].invalid);
    REQUIRE(contains(seen[1].what, "reduces F32, F64, F16 and BF16, found I32"));
    INFO(seen[0].what);
    REQUIRE(seen[0].comm);
    REQUIRE(seen[0].rank == 1);
    REQUIRE(contains(seen[0].what, "found I32"));
  }
  SECTION("inconsistent sizes, a bad root, overlapping buffers") {
    auto groups = dp::host::make_group(2, 120s);
    std::vector<float> big(10), small(4);
    REQUIRE_THROWS_AS(groups[0].reduce_scatter(dp::view(small), dp::view(big)), dp::invalid_argument);
    REQUIRE_THROWS_AS(groups[0].all_gather(dp::view(big), dp::view(small)), dp::invalid_argument);
    REQUIRE_THROWS_AS(groups[0].broadcast(dp::view(small), 2), dp::invalid_argument);
    REQUIRE_THROWS_AS(groups[0].reduce(dp::view(small), -1), dp::invalid_argument);
    dp::tensor_ref const whole = dp::view(big);  // 10 = 2 * 5; block 0 is [0, 5)
    REQUIRE_THROWS_AS(groups[0].all_gather(whole, whole.subview(1, 5)), dp::invalid_argument);
    REQUIRE_THROWS_AS(groups[0].reduce_scatter(whole.subview(3, 5), whole), dp::invalid_argument);
    // The group was aborted by the first of them: the other rank fails at once.
    auto const c = inspect_wait(groups[1].barrier());
    REQUIRE(c.comm);
    REQUIRE(c.rank == 0);
    REQUIRE(contains(c.what, "reduce_scatter on rank 0: expected `in` to hold size() * out.size() = 2 * 4 = 8"));
  }
}

TEST_CASE("host: destroying a group with collectives pending fails them and joins its threads", "[host][comm]") {
  int const before = thread_count();
  std::vector<float> x(16, 1.0f);
  dp::work pending;
  {
    auto groups = dp::host::make_group(2, 120s);
    pending = groups[0].all_reduce(dp::view(x));  // rank 1 never calls
    groups.clear();                               // must neither hang nor leak
  }
  auto const c = inspect_wait(pending);
  INFO(c.what);
  REQUIRE(c.comm);
  REQUIRE(c.rank == 0);
  REQUIRE(contains(c.what, "destroyed with 1 collective pending"));
  REQUIRE(thread_count_settled(before) == before);
}

// -----------------------------------------------------------------------------------------------
// spawn

TEST_CASE("spawn: ranks run the function and see their rank and world size", "[host][comm]") {
  int const n = 4;
  std::vector<std::vector<double>> data(n);
  std::vector<int> ranks(n, -1), sizes_seen(n, -1);
  for (int r = 0; r < n; ++r) data[static_cast<std::size_t>(r)] = inputs<double>(99, r, 5000);
  std::vector<std::vector<double> const*> srcs;
  auto const copies = data;
  for (auto const& v : copies) srcs.push_back(&v);

  dp::spawn(n, [&](dp::rank_context& ctx) {
    auto const r = static_cast<std::size_t>(ctx.rank());
    ranks[r] = ctx.rank();
    sizes_seen[r] = ctx.world_size();
    ctx.group().all_reduce(dp::view(data[r]), dp::reduce_op::avg).wait();
  });
  auto const expected = serial_reduce<double>(srcs, 0, 5000, dp::reduce_op::avg);
  for (int r = 0; r < n; ++r) {
    REQUIRE(ranks[static_cast<std::size_t>(r)] == r);
    REQUIRE(sizes_seen[static_cast<std::size_t>(r)] == n);
    REQUIRE(same_bits(data[static_cast<std::size_t>(r)], expected));
  }
}

TEST_CASE("spawn: a rank that throws fails the others' collectives and is rethrown, naming it", "[host][comm]") {
  int const before = thread_count();
  int const n = 4;
  std::vector<caught> seen(n);
  std::vector<std::vector<float>> x(n, std::vector<float>(1000, 1.0f));
  bool const others_rethrow = GENERATE(false, true);
  INFO("the other ranks " << (others_rethrow ? "rethrow" : "swallow") << " their comm_errors");

  caught thrown;
  std::string nested;
  try {
    dp::spawn(
        n,
        [&](dp::rank_context& ctx) {
          auto const r = static_cast<std::size_t>(ctx.rank());
          if (ctx.rank() == 2) throw std::runtime_error("boom");
          dp::work const w = ctx.group().all_reduce(dp::view(x[r]));  // blocked: rank 2 never calls
          seen[r] = inspect(w.wait_nothrow());
          if (others_rethrow) w.wait();
        },
        {.timeout = 120s});  // long: the abort, not the timeout, ends the waits
  } catch (...) {
    thrown = inspect(std::current_exception());
    // The original exception is nested inside the comm_error.
    try {
      std::rethrow_exception(std::current_exception());
    } catch (std::exception const& e) {
      try {
        std::rethrow_if_nested(e);
      } catch (std::runtime_error const& inner) {
        nested = inner.what();
      }
    }
  }
  INFO(thrown.what);
  REQUIRE(nested == "boom");
  REQUIRE(thrown.comm);
  REQUIRE(thrown.rank == 2);
  REQUIRE(contains(thrown.what, "rank 2 of 4 threw: boom"));
  for (int r : {0, 1, 3}) {
    auto const& c = seen[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << c.what);
    REQUIRE(c.comm);
    REQUIRE_FALSE(c.timeout);
    REQUIRE(c.rank == 2);
    REQUIRE(contains(c.what, "rank 2 aborted the process group: its function threw: boom"));
  }
  // spawn joined the rank threads and the communication threads.
  REQUIRE(thread_count_settled(before) == before);
}

TEST_CASE("spawn: a rank that returns without calling makes the others fail, naming it", "[host][comm]") {
  int const n = 3;
  std::vector<caught> seen(n);
  caught thrown;
  try {
    dp::spawn(
        n,
        [&](dp::rank_context& ctx) {
          if (ctx.rank() == 1) return;  // issues no collective at all
          seen[static_cast<std::size_t>(ctx.rank())] = inspect_wait(ctx.group().barrier());
          ctx.group().barrier().wait();
        },
        {.timeout = 120s});
  } catch (...) {
    thrown = inspect(std::current_exception());
  }
  INFO(thrown.what);
  REQUIRE(thrown.comm);
  REQUIRE_FALSE(thrown.timeout);  // a known cause, found at once: comm_error, as on shared memory
  REQUIRE(thrown.rank == 1);
  for (int r : {0, 2}) {
    auto const& c = seen[static_cast<std::size_t>(r)];
    INFO(c.what);
    REQUIRE(c.comm);
    REQUIRE_FALSE(c.timeout);
    REQUIRE(c.rank == 1);
    REQUIRE(contains(c.what, "rank 1 finished"));
    REQUIRE(contains(c.what, "will never call collective #1"));
  }
}

TEST_CASE("spawn: a short timeout with a rank that stays away is rethrown, naming it", "[host][comm]") {
  // Rank 1 stays alive without calling until rank 0 has its verdict, so rank 0's barrier fails by
  // the timeout (not because rank 1 finished); spawn rethrows that timeout_error as it is.
  std::promise<void> verdict;
  auto const verdict_seen = verdict.get_future().share();
  caught seen;
  caught thrown;
  try {
    dp::spawn(
        2,
        [&](dp::rank_context& ctx) {
          if (ctx.rank() == 1) {
            verdict_seen.wait();
            return;
          }
          dp::work const w = ctx.group().barrier();
          seen = inspect(w.wait_nothrow());
          verdict.set_value();
          w.wait();
        },
        {.timeout = 200ms});
  } catch (...) {
    thrown = inspect(std::current_exception());
  }
  INFO(seen.what);
  REQUIRE(seen.timeout);
  REQUIRE(seen.rank == 1);
  REQUIRE(contains(seen.what, "rank 1 did not call collective #1 within 200 ms"));
  REQUIRE(thrown.timeout);
  REQUIRE(thrown.rank == 1);
  REQUIRE(thrown.what == seen.what);
}

// -----------------------------------------------------------------------------------------------
// process_group and work

namespace {
/// A one-rank communicator with none of the optional members: process_group must adapt it.
struct solo_communicator {
  int calls = 0;
  std::string aborted;
  int rank() { return 0; }
  int size() { return 1; }
  dp::work all_reduce(dp::tensor_ref, dp::reduce_op) { return ++calls, dp::work{}; }
  dp::work reduce(dp::tensor_ref, int, dp::reduce_op) { return ++calls, dp::work{}; }
  dp::work broadcast(dp::tensor_ref, int) { return ++calls, dp::work{}; }
  dp::work reduce_scatter(dp::tensor_ref, dp::tensor_ref, dp::reduce_op) { return ++calls, dp::work{}; }
  dp::work all_gather(dp::tensor_ref, dp::tensor_ref) { return ++calls, dp::work{}; }
  dp::work barrier() { return ++calls, dp::work{}; }
  void abort(std::string why) { aborted = std::move(why); }
};
}  // namespace

static_assert(dp::communicator<dp::host::communicator>);
static_assert(dp::communicator<dp::process_group>);
static_assert(dp::communicator<solo_communicator>);
static_assert(!dp::communicator<int>);

TEST_CASE("process_group: a type-erased handle to any communicator", "[host][comm]") {
  auto solo = std::make_shared<solo_communicator>();
  dp::process_group g(solo);
  dp::process_group copy = g;  // copies share the communicator
  std::vector<float> x(3);
  copy.all_reduce(dp::view(x)).wait();
  copy.barrier().wait();
  g.abort("why");
  REQUIRE(solo->calls == 2);
  REQUIRE(solo->aborted == "why");
  REQUIRE(g.rank() == 0);
  REQUIRE(g.size() == 1);
  REQUIRE(g.timeout() == 300s);  // stand-ins for the members solo_communicator lacks
  g.set_timeout(5s);
  REQUIRE(g.timeout() == 5s);
  REQUIRE(g.completed_ops() == 0);

  dp::process_group empty;
  REQUIRE_FALSE(empty.valid());
  REQUIRE_THROWS_AS(empty.rank(), dp::invalid_argument);
  REQUIRE(dp::work{}.ready());
  REQUIRE_NOTHROW(dp::work{}.wait());
}

TEST_CASE("process_group: timeout of the host communicator", "[host][comm]") {
  auto groups = dp::host::make_group(2, 1234ms);
  REQUIRE(groups[0].timeout() == 1234ms);
  groups[1].set_timeout(5s);
  REQUIRE(groups[1].timeout() == 5s);
  REQUIRE(groups[0].timeout() == 1234ms);
  REQUIRE_THROWS_AS(groups[0].set_timeout(0ms), dp::invalid_argument);
  // A timeout too large for the clock means "wait as long as it takes", not "already expired".
  for (auto& g : groups) g.set_timeout(std::chrono::milliseconds::max());
  rethrow_first(on_ranks(groups, [](int, dp::process_group& g) { g.barrier().wait(); }));
  REQUIRE_THROWS_AS(dp::host::make_group(0), dp::invalid_argument);
  REQUIRE(groups[0].rank() == 0);
  REQUIRE(groups[1].rank() == 1);
  REQUIRE(groups[1].size() == 2);
}

// How host collectives share their work (stripes dealt out round robin) and when they run
// (hold(): on the thread that drains). The results of every collective against the serial
// reference are in test_comm_host.cpp; these check the two mechanisms themselves.

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/stripes.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <thread>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

namespace {

/// Runs fn(rank, group) on one thread per rank, joins them, rethrows the first exception.
template <class F>
void on_ranks(std::vector<dp::process_group>& groups, F const& fn) {
  std::vector<std::exception_ptr> errors(groups.size());
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < groups.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(static_cast<int>(r), groups[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto const& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace

TEST_CASE("stripes: every element goes to exactly one rank, in whole-line stripes of at most 64 KiB",
          "[host][comm]") {
  for (std::size_t const esz : {std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
    std::size_t const line = 64 / esz;
    std::size_t const most = (std::size_t{64} << 10) / esz;
    for (std::size_t const count : {std::size_t{0}, std::size_t{1}, line - 1, line, line + 1, std::size_t{1000},
                                    3 * most + 5, (std::size_t{1} << 20) + 3}) {
      for (int n = 1; n <= 7; ++n) {
        INFO("element size " << esz << ", count " << count << ", ranks " << n);
        std::vector<int> owner(count, -1);
        std::vector<std::size_t> stripes(static_cast<std::size_t>(n), 0);
        bool twice = false, misaligned = false, too_wide = false;
        for (int r = 0; r < n; ++r) {
          dp::detail::for_each_stripe(count, n, r, esz, [&](std::size_t lo, std::size_t hi) {
            ++stripes[static_cast<std::size_t>(r)];
            misaligned = misaligned || lo % line != 0 || lo >= hi || (hi != count && (hi - lo) % line != 0);
            too_wide = too_wide || hi - lo > most;
            for (std::size_t i = lo; i < hi; ++i) {
              twice = twice || owner[i] != -1;
              owner[i] = r;
            }
          });
        }
        CHECK_FALSE(twice);
        CHECK_FALSE(misaligned);
        CHECK_FALSE(too_wide);
        std::size_t unowned = 0;
        for (int o : owner) unowned += o < 0 ? 1 : 0;
        CHECK(unowned == 0);
        // Enough elements for a line per rank: no rank idles.
        if (count >= static_cast<std::size_t>(n) * line) {
          for (std::size_t s : stripes) CHECK(s >= 1);
        }
      }
    }
  }
}

TEST_CASE("host: held collectives run in drain() on the caller; release() hands them to the thread",
          "[host][comm]") {
  constexpr std::size_t count = std::size_t{1} << 16;  // over the one-meeting size: two meetings
  auto groups = dp::host::make_group(2, 60s);
  std::vector<std::vector<float>> data(2, std::vector<float>(count));
  auto const fill = [&] {
    for (std::size_t r = 0; r < 2; ++r)
      for (std::size_t i = 0; i < count; ++i) data[r][i] = static_cast<float>((i % 97) * (r + 1));
  };
  auto const summed = [&] {
    for (std::size_t r = 0; r < 2; ++r)
      for (std::size_t i = 0; i < count; ++i)
        if (data[r][i] != static_cast<float>((i % 97) * 3)) return false;
    return true;
  };

  SECTION("held: rank 1's work cannot complete before rank 0 drains") {
    fill();
    std::atomic<int> issued{0};
    bool peer_done_early = true, peer_done_after = false;
    on_ranks(groups, [&](int r, dp::process_group& g) {
      if (r == 0) {
        g.hold();
        dp::work const w = g.all_reduce(dp::view(data[0]));
        issued.store(1);
        std::this_thread::sleep_for(100ms);  // rank 0's communication thread, if woken, would run it
        g.drain();
        w.wait();
      } else {
        while (issued.load() == 0) std::this_thread::yield();
        dp::work const w = g.all_reduce(dp::view(data[1]));
        std::this_thread::sleep_for(50ms);
        peer_done_early = w.ready();
        w.wait();
        peer_done_after = w.ready();
      }
    });
    CHECK_FALSE(peer_done_early);
    CHECK(peer_done_after);
    CHECK(summed());
  }

  SECTION("released: the communication thread runs it, a plain wait() suffices") {
    fill();
    on_ranks(groups, [&](int r, dp::process_group& g) {
      g.hold();
      dp::work const w = g.all_reduce(dp::view(data[static_cast<std::size_t>(r)]));
      g.release();
      w.wait();
    });
    CHECK(summed());
  }

  SECTION("a hold with a collective pending changes nothing: wait() completes both") {
    fill();
    std::vector<float> one(4, 1.0f), two(4, 1.0f);
    std::atomic<int> first_issued{0};
    on_ranks(groups, [&](int r, dp::process_group& g) {
      if (r == 0) {
        dp::work const a = g.all_reduce(dp::view(data[0]));  // pending: rank 1 is not there yet
        first_issued.store(1);
        g.hold();  // ignored: a collective is pending
        dp::work const b = g.all_reduce(dp::view(one));
        b.wait();
        a.wait();
      } else {
        while (first_issued.load() == 0) std::this_thread::yield();
        std::this_thread::sleep_for(20ms);
        dp::work const a = g.all_reduce(dp::view(data[1]));
        dp::work const b = g.all_reduce(dp::view(two));
        b.wait();
        a.wait();
      }
    });
    CHECK(summed());
    CHECK(one == std::vector<float>(4, 2.0f));
    CHECK(two == std::vector<float>(4, 2.0f));
  }
}

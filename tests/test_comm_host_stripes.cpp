// How host collectives share their work (stripes dealt out round robin) and when they run
// (hold(): on the thread that drains). The results of every collective against the serial
// reference are in test_comm_host.cpp; these check the two mechanisms themselves.

#include "rank_threads.hpp"

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/stripes.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

TEST_CASE("stripes: every element goes to exactly one rank, in whole-line stripes, no rank over its share",
          "[host][comm]") {
  for (std::size_t const esz : {std::size_t{2}, std::size_t{4}, std::size_t{8}}) {
    std::size_t const line = 64 / esz;
    std::size_t const least = (std::size_t{64} << 10) / esz;
    for (std::size_t const count : {std::size_t{0}, std::size_t{1}, line - 1, line, line + 1, std::size_t{1000},
                                    3 * least + 5, std::size_t{407050}, (std::size_t{1} << 20) + 3,
                                    (std::size_t{1} << 24) + 17}) {
      for (int n = 1; n <= 7; ++n) {
        INFO("element size " << esz << ", count " << count << ", ranks " << n);
        std::size_t const w = dp::detail::stripe_width(count, n, esz);
        std::size_t const share = (count + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n);
        // At least 64 KiB (or the whole share), at most an eighth of the share (or 64 KiB), in lines.
        CHECK(w % line == 0);
        CHECK(w >= std::min(least, share));
        CHECK(w <= std::max(least, (share + 7) / 8) + line);
        std::vector<std::uint8_t> owner(count, 0);
        std::vector<std::size_t> mine(static_cast<std::size_t>(n), 0);
        bool misplaced = false;
        for (int r = 0; r < n; ++r) {
          dp::detail::for_each_stripe(count, n, r, esz, [&](std::size_t lo, std::size_t hi) {
            misplaced = misplaced || lo % w != 0 || lo >= hi || (hi != count && hi - lo != w) ||
                        (lo / w) % static_cast<std::size_t>(n) != static_cast<std::size_t>(r);
            mine[static_cast<std::size_t>(r)] += hi - lo;
            for (std::size_t i = lo; i < hi; ++i) ++owner[i];
          });
        }
        CHECK_FALSE(misplaced);
        CHECK(std::count(owner.begin(), owner.end(), std::uint8_t{1}) == static_cast<std::ptrdiff_t>(count));
        for (std::size_t m : mine) CHECK(m <= share + w);
      }
    }
  }
  // The reference workload's gradient (407 050 F32) over 2 ranks: several stripes each.
  std::size_t stripes = 0;
  dp::detail::for_each_stripe(407050, 2, 1, 4, [&](std::size_t, std::size_t) { ++stripes; });
  CHECK(stripes >= 8);
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
    test::rethrow_first(test::on_ranks(groups, [&](int r, dp::process_group& g) {
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
    }));
    CHECK_FALSE(peer_done_early);
    CHECK(peer_done_after);
    CHECK(summed());
  }

  SECTION("released: the communication thread runs it, a plain wait() suffices") {
    fill();
    test::rethrow_first(test::on_ranks(groups, [&](int r, dp::process_group& g) {
      g.hold();
      dp::work const w = g.all_reduce(dp::view(data[static_cast<std::size_t>(r)]));
      g.release();
      w.wait();
    }));
    CHECK(summed());
  }

  SECTION("a hold with a collective pending changes nothing: wait() completes both") {
    fill();
    std::vector<float> one(4, 1.0f), two(4, 1.0f);
    std::atomic<int> first_issued{0};
    test::rethrow_first(test::on_ranks(groups, [&](int r, dp::process_group& g) {
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
    }));
    CHECK(summed());
    CHECK(one == std::vector<float>(4, 2.0f));
    CHECK(two == std::vector<float>(4, 2.0f));
  }
}

// loader: batches in input order for every num_workers, the prefetch bound, errors delivered at
// their batch, prompt shutdown, and bad input.

#include <dparallel/data/distributed_sampler.hpp>
#include <dparallel/data/loader.hpp>

#include "threads.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <iterator>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <ranges>
#include <set>
#include <span>
#include <stdexcept>
#include <system_error>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <unistd.h>

namespace {

using index_list = std::vector<std::size_t>;
using batch_list = std::vector<index_list>;

index_list iota_list(std::size_t len) {
  index_list v(len);
  std::iota(v.begin(), v.end(), std::size_t{0});
  return v;
}

/// The ids of this process's threads (Linux /proc/self/task).
std::set<std::string> thread_ids() {
  std::set<std::string> ids;
  std::error_code ec;
  for (auto const& e : std::filesystem::directory_iterator("/proc/self/task", ec)) ids.insert(e.path().filename());
  return ids;
}

/// The thread count once no thread of ours is on its way out. test::thread_count() starts and
/// joins a warm-up thread on its first call, and a joined thread can stay listed for a moment
/// after pthread_join returns: counting right then gave one thread too many (2 instead of 1).
/// So: start (and join) a thread of our own first, so that a sanitizer's helper thread exists,
/// and wait until that thread is gone; note the threads left; let thread_count() warm up; and
/// wait until exactly the noted threads are left again (bounded; what is compared is the set of
/// threads, not a time).
int settled_thread_count() {
  std::string tid;
  std::thread([&tid] { tid = std::to_string(static_cast<long>(::gettid())); }).join();
  for (int i = 0; i < 2000 && thread_ids().contains(tid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto const live = thread_ids();
  (void)test::thread_count();
  for (int i = 0; i < 2000 && thread_ids() != live; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return test::thread_count();
}

// The reference: `indices` cut into batches of batch_size, the last one smaller or dropped.
batch_list reference_batches(index_list const& indices, std::size_t batch_size, bool drop_last) {
  batch_list out;
  for (std::size_t b = 0; b < indices.size(); b += batch_size) {
    std::size_t const e = std::min(indices.size(), b + batch_size);
    if (e - b < batch_size && drop_last) break;
    out.emplace_back(indices.begin() + static_cast<std::ptrdiff_t>(b), indices.begin() + static_cast<std::ptrdiff_t>(e));
  }
  return out;
}

// A batch's content, computed from its indices: each sample i becomes 1000 + 3 i.
index_list content_of(std::span<std::size_t const> indices) {
  index_list out;
  for (std::size_t i : indices) out.push_back(1000 + 3 * i);
  return out;
}

// Sleeps 0..3 times 300 us depending on the batch's first index, so that with several workers
// later batches are often finished before earlier ones.
void uneven_delay(std::span<std::size_t const> indices) {
  if (!indices.empty()) std::this_thread::sleep_for(std::chrono::microseconds(300 * (indices[0] * 7 % 4)));
}

struct made_batch {
  index_list values;
  std::thread::id made_on;
};

struct staged_batch {
  index_list values;
  std::thread::id made_on;
  std::thread::id staged_on;
};

// A Stage that changes the type and records the thread it ran on.
struct recording_stage {
  staged_batch operator()(made_batch&& b) const {
    return staged_batch{std::move(b.values), b.made_on, std::this_thread::get_id()};
  }
};

struct not_a_std_exception {
  int code;
};

}  // namespace

TEST_CASE("loader: the same batches in the same order for 0, 1, 2 and 4 workers", "[host][loader]") {
  for (bool drop_last : {false, true}) {
    dparallel::distributed_sampler sampler(103, 2, 1, {.seed = 5});
    sampler.set_epoch(2);
    std::size_t const batch_size = 7;
    batch_list const expected = reference_batches(sampler.indices(), batch_size, drop_last);
    REQUIRE(expected.size() == (drop_last ? 7u : 8u));  // 52 indices: 7 full batches and 3 left
    for (std::size_t workers : {0u, 1u, 2u, 4u}) {
      INFO("num_workers " << workers << ", drop_last " << drop_last);
      auto make = [](std::span<std::size_t const> idx) {
        uneven_delay(idx);
        return content_of(idx);
      };
      // next()
      {
        dparallel::loader batches(sampler, batch_size, make, {.num_workers = workers, .drop_last = drop_last});
        static_assert(std::is_same_v<decltype(batches)::value_type, index_list>);
        REQUIRE(batches.size() == expected.size());
        batch_list got;
        while (auto b = batches.next()) got.push_back(std::move(*b));
        REQUIRE(got.size() == expected.size());
        for (std::size_t k = 0; k < expected.size(); ++k) {
          CHECK(got[k] == content_of(expected[k]));
          CHECK(index_list(batches.batch_indices(k).begin(), batches.batch_indices(k).end()) == expected[k]);
        }
        CHECK(batches.position() == expected.size());
        CHECK_FALSE(batches.next().has_value());
      }
      // Range interface, with a Stage that changes the type and runs on the making thread.
      {
        auto make_tagged = [](std::span<std::size_t const> idx) {
          uneven_delay(idx);
          return made_batch{content_of(idx), std::this_thread::get_id()};
        };
        dparallel::loader batches(sampler, batch_size, make_tagged, {.num_workers = workers, .drop_last = drop_last},
                                  recording_stage{});
        static_assert(std::is_same_v<decltype(batches)::value_type, staged_batch>);
        static_assert(std::ranges::input_range<decltype(batches)>);
        std::size_t k = 0;
        for (auto& b : batches) {
          REQUIRE(k < expected.size());
          CHECK(b.values == content_of(expected[k]));
          CHECK(b.staged_on == b.made_on);
          if (workers == 0) {
            CHECK(b.made_on == std::this_thread::get_id());
          } else {
            CHECK(b.made_on != std::this_thread::get_id());
          }
          ++k;
        }
        CHECK(k == expected.size());
      }
    }
  }
}

TEST_CASE("loader: explicit index lists, in the order given", "[host][loader]") {
  batch_list const lists{{5, 1}, {2}, {9, 9, 3}, {0}, {7, 4, 8, 6}};
  for (std::size_t workers : {0u, 1u, 2u, 4u}) {
    INFO("num_workers " << workers);
    dparallel::loader batches(
        lists,
        [](std::span<std::size_t const> idx) {
          uneven_delay(idx);
          return content_of(idx);
        },
        {.num_workers = workers, .prefetch = 1, .drop_last = true});  // drop_last: no effect here
    REQUIRE(batches.size() == lists.size());
    std::size_t k = 0;
    for (auto& b : batches) {
      REQUIRE(k < lists.size());
      CHECK(b == content_of(lists[k]));
      ++k;
    }
    CHECK(k == lists.size());
  }
}

TEST_CASE("loader: number of batches with and without drop_last", "[host][loader]") {
  auto make = [](std::span<std::size_t const> idx) { return index_list(idx.begin(), idx.end()); };
  for (std::size_t len = 0; len <= 20; ++len) {
    for (std::size_t bs = 1; bs <= 7; ++bs) {
      for (bool drop_last : {false, true}) {
        INFO("len " << len << ", batch size " << bs << ", drop_last " << drop_last);
        index_list const indices = iota_list(len);
        dparallel::loader batches(indices, bs, make, {.drop_last = drop_last});
        std::size_t const expected = drop_last ? len / bs : (len + bs - 1) / bs;
        CHECK(batches.size() == expected);
        batch_list const ref = reference_batches(indices, bs, drop_last);
        REQUIRE(ref.size() == expected);
        batch_list got;
        while (auto b = batches.next()) got.push_back(std::move(*b));
        CHECK(got == ref);
      }
    }
  }
  // An empty epoch: no batch, no thread.
  int const before = test::thread_count();
  dparallel::loader empty(index_list{}, 4, make, {.num_workers = 3});
  CHECK(test::thread_count() == before);
  CHECK(empty.size() == 0);
  CHECK(empty.begin() == empty.end());
  CHECK_FALSE(empty.next().has_value());
}

TEST_CASE("loader: an exception while making batch k reaches the caller at batch k", "[host][loader]") {
  std::size_t const batch_size = 3;
  std::size_t const n = 10;
  index_list const indices = iota_list(batch_size * n);
  batch_list const expected = reference_batches(indices, batch_size, false);
  for (std::size_t workers : {0u, 2u, 4u}) {
    for (std::size_t bad : {0u, 4u, 9u}) {
      INFO("num_workers " << workers << ", failing batch " << bad);
      auto make = [bad](std::span<std::size_t const> idx) {
        uneven_delay(idx);
        if (idx[0] == bad * batch_size) throw std::runtime_error("no such sample " + std::to_string(idx[0]));
        return content_of(idx);
      };
      // next(): batches 0..bad-1, then the failure, then the loader goes on with bad + 1.
      {
        dparallel::loader batches(indices, batch_size, make, {.num_workers = workers});
        for (std::size_t k = 0; k < bad; ++k) {
          auto b = batches.next();
          REQUIRE(b.has_value());
          CHECK(*b == content_of(expected[k]));
        }
        std::optional<std::size_t> failed_at;
        std::string what, nested_what;
        try {
          (void)batches.next();
        } catch (dparallel::loader_error const& e) {
          failed_at = e.batch_index();
          what = e.what();
          try {
            std::rethrow_if_nested(e);
          } catch (std::runtime_error const& inner) {
            nested_what = inner.what();
          }
        }
        CHECK(failed_at == std::optional<std::size_t>(bad));
        CHECK(what == "dparallel: loader: making batch " + std::to_string(bad) +
                          " (of 10, counting from 0) failed: no such sample " + std::to_string(bad * batch_size));
        CHECK(nested_what == "no such sample " + std::to_string(bad * batch_size));
        CHECK(batches.position() == bad + 1);
        if (bad + 1 < n) {
          auto b = batches.next();
          REQUIRE(b.has_value());
          CHECK(*b == content_of(expected[bad + 1]));
        }
      }
      // Range interface: the loop body saw exactly batches 0..bad-1.
      {
        dparallel::loader batches(indices, batch_size, make, {.num_workers = workers});
        batch_list seen;
        std::optional<std::size_t> failed_at;
        try {
          for (auto& b : batches) seen.push_back(b);
        } catch (dparallel::loader_error const& e) {
          failed_at = e.batch_index();
        }
        CHECK(failed_at == std::optional<std::size_t>(bad));
        REQUIRE(seen.size() == bad);
        for (std::size_t k = 0; k < bad; ++k) CHECK(seen[k] == content_of(expected[k]));
      }
    }
    // Something that is not a std::exception, thrown by the Stage: kept as the nested exception.
    {
      INFO("num_workers " << workers);
      dparallel::loader batches(
          indices, batch_size, [](std::span<std::size_t const> idx) { return content_of(idx); },
          {.num_workers = workers}, [](index_list&& b) {
            if (b[0] == 1000 + 3 * 6) throw not_a_std_exception{42};
            return std::move(b);
          });
      std::size_t delivered = 0;
      std::optional<std::size_t> failed_at;
      int code = 0;
      std::string what;
      try {
        while (batches.next()) ++delivered;
      } catch (dparallel::loader_error const& e) {
        failed_at = e.batch_index();
        what = e.what();
        try {
          std::rethrow_if_nested(e);
        } catch (not_a_std_exception const& inner) {
          code = inner.code;
        }
      }
      CHECK(delivered == 2);
      CHECK(failed_at == std::optional<std::size_t>(2));
      CHECK(code == 42);
      CHECK(what == "dparallel: loader: making batch 2 (of 10, counting from 0) failed: an exception not derived "
                    "from std::exception");
    }
  }
}

TEST_CASE("loader: at most num_workers * prefetch batches made and not yet consumed", "[host][loader]") {
  std::size_t const n = 24;
  index_list const indices = iota_list(n);
  for (std::size_t workers : {0u, 1u, 2u, 3u}) {
    for (std::size_t prefetch : {1u, 2u, 3u}) {
      INFO("num_workers " << workers << ", prefetch " << prefetch);
      std::size_t const bound = workers * prefetch;
      // consumed counts the batches the consumer asked for: it is raised before each next(), so
      // it is never behind the loader's own count of batches handed out. made is raised when a
      // make() starts; the loader starts batch k only after batch k - bound was handed out.
      std::atomic<std::size_t> made{0}, consumed{0};
      std::mutex m;
      std::vector<std::ptrdiff_t> ahead;  // made - consumed, seen by each make()
      auto make = [&](std::span<std::size_t const> idx) {
        std::size_t const now_made = made.fetch_add(1) + 1;
        std::size_t const now_consumed = consumed.load();
        {
          std::lock_guard lock(m);
          ahead.push_back(static_cast<std::ptrdiff_t>(now_made) - static_cast<std::ptrdiff_t>(now_consumed));
        }
        return content_of(idx);
      };
      std::vector<std::size_t> made_when_settled;  // after batch j was handed out and the workers are idle
      std::vector<std::size_t> expected_settled;
      {
        dparallel::loader batches(indices, 1, make, {.num_workers = workers, .prefetch = prefetch});
        for (std::size_t j = 0; j < n; ++j) {
          consumed.fetch_add(1);
          auto b = batches.next();
          REQUIRE(b.has_value());
          CHECK(*b == content_of(std::span<std::size_t const>(&indices[j], 1)));
          // The workers make exactly up to bound batches beyond those handed out: wait for
          // them to get there (a bound against hanging, not a timing threshold), then give an
          // over-eager loader time to go further before counting.
          std::size_t const target = std::min(n, j + 1 + bound);
          for (int spin = 0; spin < 4000 && made.load() < target; ++spin)
            std::this_thread::sleep_for(std::chrono::microseconds(500));
          std::this_thread::sleep_for(std::chrono::microseconds(500));
          made_when_settled.push_back(made.load());
          expected_settled.push_back(target);
        }
        CHECK_FALSE(batches.next().has_value());
      }
      CHECK(made.load() == n);
      CHECK(made_when_settled == expected_settled);
      REQUIRE(ahead.size() == n);
      std::ptrdiff_t const most = *std::max_element(ahead.begin(), ahead.end());
      CHECK(most <= static_cast<std::ptrdiff_t>(bound));
      if (workers == 0) CHECK(most == 0);  // made on demand: never ahead
    }
  }
}

TEST_CASE("loader: destroyed mid-epoch, it stops its workers and leaves no thread", "[host][loader]") {
  std::size_t const n = 200;
  index_list const indices = iota_list(n);
  int const before = settled_thread_count();
  for (std::size_t workers : {1u, 4u}) {
    INFO("num_workers " << workers);
    std::atomic<std::size_t> made{0};
    auto make = [&](std::span<std::size_t const> idx) {
      made.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      return content_of(idx);
    };
    int during = 0;
    {
      dparallel::loader batches(indices, 1, make, {.num_workers = workers, .prefetch = 2});
      during = test::thread_count();
      auto b = batches.next();
      REQUIRE(b.has_value());
      CHECK(*b == content_of(std::span<std::size_t const>(&indices[0], 1)));
    }  // destroyed after one batch
    CHECK(during == before + static_cast<int>(workers));
    CHECK(test::thread_count_settled(before) == before);
    // The bound held up to the end: nothing beyond it was started.
    CHECK(made.load() <= 1 + workers * 2);
    // Destroyed by an exception unwinding out of the loop.
    bool caught = false;
    try {
      dparallel::loader batches(indices, 1, make, {.num_workers = workers});
      for (auto& b : batches)
        if (b[0] == 1000 + 3 * 3) throw std::logic_error("stop");
    } catch (std::logic_error const&) {
      caught = true;
    }
    CHECK(caught);
    CHECK(test::thread_count_settled(before) == before);
  }
}

TEST_CASE("loader: wait times add up", "[host][loader]") {
  index_list const indices = iota_list(12);
  for (std::size_t workers : {0u, 2u}) {
    INFO("num_workers " << workers);
    dparallel::loader batches(
        indices, 4,
        [](std::span<std::size_t const> idx) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          return content_of(idx);
        },
        {.num_workers = workers});
    CHECK(batches.total_wait() == std::chrono::nanoseconds{0});
    std::chrono::nanoseconds sum{0};
    while (auto b = batches.next()) {
      sum += batches.last_wait();
      if (workers == 0) CHECK(batches.last_wait() >= std::chrono::milliseconds(2));  // made inside next()
    }
    CHECK(batches.last_wait() == std::chrono::nanoseconds{0});  // the call that found the end
    CHECK(batches.total_wait() == sum);
  }
}

TEST_CASE("loader: bad input is an invalid_argument that says what was expected", "[host][loader]") {
  using Catch::Matchers::Contains;
  auto make = [](std::span<std::size_t const> idx) { return content_of(idx); };
  index_list const indices = iota_list(10);
  CHECK_THROWS_WITH(dparallel::loader(indices, 0, make), Contains("expected a batch size >= 1, found 0"));
  CHECK_THROWS_AS(dparallel::loader(indices, 0, make), dparallel::invalid_argument);
  CHECK_THROWS_WITH(dparallel::loader(indices, 2, make, {.num_workers = 2, .prefetch = 0}),
                    Contains("expected prefetch >= 1") && Contains("found 0"));
  CHECK_THROWS_AS(dparallel::loader(indices, 2, make, {.prefetch = 0}), dparallel::invalid_argument);
  CHECK_THROWS_WITH(
      dparallel::loader(indices, 2, make, {.num_workers = std::numeric_limits<std::size_t>::max(), .prefetch = 2}),
      Contains("expected num_workers * prefetch to fit"));
  CHECK_THROWS_WITH(dparallel::loader(batch_list{{1, 2}, {}, {3}}, make),
                    Contains("expected every batch to hold at least one index, found batch 1 of 3 empty"));
  CHECK_THROWS_AS(dparallel::loader(batch_list{{}}, make, {.num_workers = 2}), dparallel::invalid_argument);
  dparallel::loader ok(indices, 4, make);
  CHECK_THROWS_WITH(ok.batch_indices(3), Contains("expected a batch index below 3, found 3"));
}

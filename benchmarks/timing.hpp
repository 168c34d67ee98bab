#pragma once
// Timing of an operation that `n` threads run in lock step: each thread calls op(rank) the same
// number of times between two barriers, and the time between the barriers, divided by that
// number, is one sample. The count is calibrated so that one sample lasts about `target`
// seconds; the result is the best and the median of `reps` samples.

#include "bench_util.hpp"

#include <algorithm>
#include <barrier>
#include <cstdint>
#include <thread>
#include <vector>

namespace bench {

struct op_time {
  double best = 0;    ///< seconds per operation, fastest sample
  double median = 0;  ///< seconds per operation, median sample
  std::int64_t iters = 0;
};

template <class Op>
op_time time_in_lock_step(int n, Op const& op, double target, int reps) {
  std::barrier sync(n);
  std::int64_t iters = 1;
  bool calibrating = true;
  std::vector<double> samples;
  auto body = [&](int r) {
    op(r);  // warm-up: caches, page tables, the threads of the communicator
    while (true) {
      sync.arrive_and_wait();
      auto const t0 = clock::now();
      for (std::int64_t i = 0; i < iters; ++i) op(r);
      sync.arrive_and_wait();
      if (r == 0) {
        double const t = seconds_since(t0);
        if (t >= target / 4 || iters >= (std::int64_t{1} << 24)) {
          calibrating = false;
          iters = std::max<std::int64_t>(1, static_cast<std::int64_t>(static_cast<double>(iters) * target / t));
        } else {
          iters *= 2;
        }
      }
      sync.arrive_and_wait();
      if (!calibrating) break;
    }
    for (int k = 0; k < reps; ++k) {
      sync.arrive_and_wait();
      auto const t0 = clock::now();
      for (std::int64_t i = 0; i < iters; ++i) op(r);
      sync.arrive_and_wait();
      if (r == 0) samples.push_back(seconds_since(t0) / static_cast<double>(iters));
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < n; ++r) threads.emplace_back(body, r);
  body(0);
  for (auto& t : threads) t.join();
  return {*std::min_element(samples.begin(), samples.end()), median(samples), iters};
}

}  // namespace bench

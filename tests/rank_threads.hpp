#pragma once
// Running a test body on one thread per rank of a set of thread-rank process groups.
#include <dparallel/comm/communicator.hpp>

#include <cstddef>
#include <exception>
#include <thread>
#include <vector>

namespace test {

/// Runs fn(rank, group) on one thread per rank listed in `ranks` (default: all), joins them all,
/// and returns what each rank threw (null where it did not).
template <class F>
std::vector<std::exception_ptr> on_ranks(std::vector<dparallel::process_group>& groups, F const& fn,
                                         std::vector<int> ranks = {}) {
  if (ranks.empty()) {
    for (int r = 0; r < static_cast<int>(groups.size()); ++r) ranks.push_back(r);
  }
  std::vector<std::exception_ptr> errors(groups.size());
  std::vector<std::thread> threads;
  for (int r : ranks) {
    threads.emplace_back([&, r] {
      try {
        fn(r, groups[static_cast<std::size_t>(r)]);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

/// Rethrows the first of `errors` that holds an exception.
inline void rethrow_first(std::vector<std::exception_ptr> const& errors) {
  for (auto const& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace test

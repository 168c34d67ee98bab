#pragma once
// spawn: runs a function as `world_size` thread ranks of one host process group, the in-process
// counterpart of torch.multiprocessing.spawn for DDP.
//
//   dparallel::spawn(4, [&](dparallel::rank_context& rank) {
//     auto grads = local_gradients(rank.rank());
//     rank.group().all_reduce(dparallel::view(grads), dparallel::reduce_op::avg).wait();
//   });
//
// spawn joins every rank before it returns or throws, and releases the group (its communication
// threads are joined), so it leaves no thread behind, unless `fn` kept a copy of its
// process_group beyond its return (the copy keeps that rank's communicator and thread alive). A rank whose function throws aborts the
// group: the other ranks' pending and later collectives fail at once with a comm_error naming it.
// A rank whose function returns is closed: peers that wait for a collective it never issued fail
// at once with a comm_error naming it ("rank k finished ..."), rather than at the timeout.

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Options of spawn().
struct spawn_options {
  /// How long any collective waits for its peers before failing with timeout_error.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
};

/// What a spawned rank knows about itself: its rank, the world size and its process group.
class rank_context {
 public:
  /// The context of the rank `group` belongs to.
  explicit rank_context(process_group group) : group_(std::move(group)) {}

  /// This rank.
  [[nodiscard]] int rank() const { return group_.rank(); }
  /// Number of ranks.
  [[nodiscard]] int world_size() const { return group_.size(); }
  /// This rank's process group.
  [[nodiscard]] process_group& group() noexcept { return group_; }
  /// This rank's process group.
  [[nodiscard]] process_group const& group() const noexcept { return group_; }

 private:
  process_group group_;
};

namespace detail {

inline std::string spawn_what(std::exception_ptr const& e) {
  try {
    std::rethrow_exception(e);
  } catch (std::exception const& ex) {
    return ex.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

/// Whether the failure of rank `r` is its own, rather than a comm_error another rank caused.
inline bool spawn_own_failure(std::exception_ptr const& e, int r) {
  try {
    std::rethrow_exception(e);
  } catch (comm_error const& c) {
    return c.rank() == r;
  } catch (...) {
    return true;
  }
}

/// Rethrows rank r's failure so that it names the rank: comm_errors as they are, anything else
/// as a comm_error naming r with the original exception nested (std::rethrow_if_nested).
[[noreturn]] inline void spawn_rethrow(std::exception_ptr const& e, int r, int world_size) {
  std::string const where = "dparallel::spawn: rank " + std::to_string(r) + " of " + std::to_string(world_size) + " threw: ";
  try {
    std::rethrow_exception(e);
  } catch (comm_error const&) {
    throw;
  } catch (std::exception const& ex) {
    std::throw_with_nested(comm_error(r, where + without_prefix(ex.what())));
  } catch (...) {
    std::throw_with_nested(comm_error(r, where + "an exception not derived from std::exception"));
  }
}

}  // namespace detail

/// Runs fn(rank_context&) on `world_size` threads, ranks 0..world_size-1 of one host process
/// group, and joins them. Rethrows the first failure: a rank's own exception (as a comm_error
/// naming it, the original nested) takes precedence over the comm_errors it caused on the others;
/// when every failure is a comm_error (a timeout, say), the first one is rethrown as is.
inline void spawn(int world_size, std::function<void(rank_context&)> fn, spawn_options options = {}) {
  dparallel::detail::require(static_cast<bool>(fn), "spawn: expected a function to run, found an empty std::function");
  auto const comms = host::make_communicators(world_size, options.timeout);  // validates the arguments

  struct failure {
    int rank;
    std::exception_ptr error;
    bool own;
  };
  std::mutex m;
  std::vector<failure> failures;  // in the order they happened

  auto const body = [&](int r) {
    auto const& comm = comms[static_cast<std::size_t>(r)];
    try {
      {
        rank_context ctx{process_group(comm)};
        fn(ctx);
      }
      comm->close();
    } catch (...) {
      std::exception_ptr const e = std::current_exception();
      {
        std::lock_guard lock(m);
        failures.push_back(failure{r, e, detail::spawn_own_failure(e, r)});
      }
      comm->abort("its function threw: " + detail::spawn_what(e));
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(comms.size());
  try {
    for (int r = 0; r < world_size; ++r) threads.emplace_back(body, r);
  } catch (...) {
    comms[0]->abort("spawn could not start all " + std::to_string(world_size) + " rank threads");
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();

  if (failures.empty()) return;
  auto const first = std::find_if(failures.begin(), failures.end(), [](failure const& f) { return f.own; });
  failure const& chosen = first != failures.end() ? *first : failures.front();
  detail::spawn_rethrow(chosen.error, chosen.rank, world_size);
}

DPARALLEL_NAMESPACE_END

// The watchdog of a clique (comm/detail/clique_watch.hpp) on a fake engine: nccl::dp's grouped
// broadcast/reduce is one collective over several communicators; a group that hangs on one of
// them or fails on one of them aborts every one, once, before the group's tokens are released,
// and fails the group naming the member(s) at fault; later groups fail at once.

#include <dparallel/comm/detail/clique_watch.hpp>
#include <dparallel/comm/detail/progress.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/error.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using dparallel::detail::clique_driver;
using dparallel::detail::collective_poller;
using dparallel::detail::poll_result;

constexpr std::size_t n_members = 3;

// One member's part of a group: completes once the test sets `state`.
struct part {
  std::atomic<int> state{0};  // 0 running, 1 done, 2 failed on the device
};

// A clique of three fake communicators, recording what the watchdog asks of them.
struct fake_members {
  using token = std::shared_ptr<part>;
  std::mutex m;
  std::vector<std::string> log;
  std::array<std::string, n_members> async{};  // engine errors (under m)

  void note(std::string s) {
    std::lock_guard lock(m);
    log.push_back(std::move(s));
  }
  [[nodiscard]] std::size_t size() const { return n_members; }
  [[nodiscard]] std::string name(std::size_t i) const { return "device " + std::to_string(i) + " (gpu" + std::to_string(i) + ")"; }
  poll_result poll(std::size_t, token& t) {
    int const s = t->state.load();
    if (s == 1) return poll_result::done();
    if (s == 2) return poll_result::failed("an illegal address");
    return poll_result::pending();
  }
  std::string async_error(std::size_t i) {
    std::lock_guard lock(m);
    return async[i];
  }
  void release(std::size_t i, token&) noexcept { note("release " + std::to_string(i)); }
  void abort(std::size_t i) noexcept { note("abort " + std::to_string(i)); }
  std::vector<std::string> snapshot() {
    std::lock_guard lock(m);
    return log;
  }
};

using driver = clique_driver<fake_members>;
using group = std::vector<std::shared_ptr<part>>;

group make_group() {
  group g;
  for (std::size_t i = 0; i < n_members; ++i) g.push_back(std::make_shared<part>());
  return g;
}

dparallel::work launch(collective_poller<driver>& p, group const& g, std::chrono::milliseconds timeout) {
  return p.launch("nccl::dp reduce over gpu0 gpu1 gpu2", timeout, [&] { return g; });
}

template <class E>
std::string error_of(dparallel::work const& w) {
  try {
    w.wait();
  } catch (E const& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<std::string> const aborted_then_released{"abort 0",   "abort 1",   "abort 2",
                                                     "release 0", "release 1", "release 2"};

}  // namespace

TEST_CASE("clique watchdog: a group done on every member succeeds and aborts nothing", "[clique]") {
  fake_members m;
  driver d{m};
  collective_poller<driver> p(0, d);
  auto const g = make_group();
  auto const w = launch(p, g, std::chrono::minutes(10));
  for (auto const& t : g) t->state = 1;
  w.wait();
  p.drain();
  CHECK(m.snapshot() == std::vector<std::string>{"release 0", "release 1", "release 2"});
  CHECK_FALSE(p.aborted());
}

TEST_CASE("clique watchdog: a group hung on one member times out, aborts every member, names the member",
          "[clique]") {
  fake_members m;
  driver d{m};
  collective_poller<driver> p(0, d);
  auto const g = make_group();
  g[0]->state = 1;
  g[2]->state = 1;  // member 1 never completes
  std::string const e = error_of<dparallel::timeout_error>(launch(p, g, std::chrono::milliseconds(1)));
  CHECK_THAT(e, Catch::Contains("nccl::dp reduce over gpu0 gpu1 gpu2 (collective #1) did not complete within 1 ms"));
  CHECK_THAT(e, Catch::Contains("on device 1 (gpu1); the clique's communicators were aborted"));
  CHECK_THAT(e, !Catch::Contains("device 0") && !Catch::Contains("device 2"));
  p.drain();
  CHECK(m.snapshot() == aborted_then_released);  // abort before any token is released

  // Later groups fail at once with the first failure's reason; the engine is not touched again.
  auto const later = make_group();
  std::string const e2 = error_of<dparallel::timeout_error>(launch(p, later, std::chrono::minutes(10)));
  CHECK_THAT(e2, Catch::Contains("(collective #2) failed") && Catch::Contains("on device 1 (gpu1)"));
  CHECK(m.snapshot() == aborted_then_released);
}

TEST_CASE("clique watchdog: a member's engine error or device fault fails the group naming it", "[clique]") {
  fake_members m;
  driver d{m};
  collective_poller<driver> p(0, d);
  auto const g = make_group();
  bool const engine = GENERATE(true, false);
  if (engine) {
    std::lock_guard lock(m.m);
    m.async[2] = "NCCL reported remote process exited";
  } else {
    g[2]->state = 2;
  }
  std::string const e = error_of<dparallel::comm_error>(launch(p, g, std::chrono::minutes(10)));
  CHECK_THAT(e, Catch::Contains(engine ? "device 2 (gpu2): NCCL reported remote process exited"
                                       : "device 2 (gpu2): an illegal address"));
  p.drain();
  CHECK(m.snapshot() == aborted_then_released);
}

TEST_CASE("clique watchdog: groups queued behind a hung one fail with it, each released once", "[clique]") {
  fake_members m;
  driver d{m};
  collective_poller<driver> p(0, d);
  auto const a = make_group(), b = make_group();
  for (auto const& t : b) t->state = 1;  // b would complete, but runs behind a on the devices
  auto const wa = launch(p, a, std::chrono::milliseconds(1));
  auto const wb = launch(p, b, std::chrono::minutes(10));
  CHECK_THAT(error_of<dparallel::timeout_error>(wa), Catch::Contains("on device 0 (gpu0), device 1 (gpu1), device 2 (gpu2)"));
  CHECK_THAT(error_of<dparallel::timeout_error>(wb), Catch::Contains("(collective #2) failed"));
  p.drain();
  auto const log = m.snapshot();
  REQUIRE(log.size() == 9);
  CHECK(std::vector<std::string>(log.begin(), log.begin() + 3) ==
        std::vector<std::string>{"abort 0", "abort 1", "abort 2"});
}

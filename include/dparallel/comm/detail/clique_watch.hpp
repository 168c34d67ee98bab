#pragma once
// The watchdog of a clique: several communicators (one per device) that launch one group of
// collectives together and can only fail together (nccl::dp's grouped broadcast and reduce).
// clique_driver adapts such a clique to collective_poller (comm/detail/progress.hpp), so the
// clique gets the same deadline, failure and abort handling as a process group's communicator:
// a group is one collective whose handle holds one completion token per member; it is done when
// every member's token is, fails when any member reports a failure or an engine error, and is
// late past its deadline. On the first failure the poller calls abort_native() once, which
// aborts EVERY member (for NCCL, ncclCommAbort is the only way to end a collective that hangs,
// and a group is only usable as a whole), then fails the group's work; later launches fail at
// once. Everything here is engine-neutral: the members are a template parameter, so the
// decisions are tested on the host with a fake engine (tests/test_clique_watch.cpp).

#include <dparallel/config.hpp>
#include <dparallel/comm/detail/progress.hpp>

#include <cstddef>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// collective_poller's Driver for a clique. `Members` is the engine, member i being one device's
/// communicator; every hook is nonblocking except abort:
///   typename Members::token                           a member's completion marker (an event)
///   std::size_t size() const                          the number of members
///   std::string name(std::size_t i) const             how errors name member i ("device 1 (cuda:1)")
///   poll_result poll(std::size_t i, token&)           member i's part of a group
///   std::string async_error(std::size_t i)            member i's engine-wide error, empty when none
///   void release(std::size_t i, token&) noexcept      always, last
///   void abort(std::size_t i) noexcept                ends member i's communicator for good
template <class Members>
struct clique_driver {
  /// One group: a token per member.
  using handle = std::vector<typename Members::token>;
  /// The clique's engine; must outlive the driver.
  Members& members;

  /// Done when every member is done; failed, naming the member, when one failed.
  poll_result poll(handle& h) {
    bool all = true;
    for (std::size_t i = 0; i < h.size(); ++i) {
      poll_result r = members.poll(i, h[i]);
      if (r.st == poll_result::state::failed) return poll_result::failed(members.name(i) + ": " + r.why);
      all = all && r.st == poll_result::state::done;
    }
    return all ? poll_result::done() : poll_result::pending();
  }
  /// The first member's engine-wide error, naming the member; empty when none.
  std::string async_error() {
    for (std::size_t i = 0; i < members.size(); ++i)
      if (std::string e = members.async_error(i); !e.empty()) return members.name(i) + ": " + e;
    return {};
  }
  /// Nothing to copy out: a group's results are in device memory.
  void finish(handle&) {}
  /// Gives back every member's token.
  void release(handle& h) noexcept {
    for (std::size_t i = 0; i < h.size(); ++i) members.release(i, h[i]);
  }
  /// Aborts every member: a group never completes on some members only.
  void abort_native() noexcept {
    for (std::size_t i = 0; i < members.size(); ++i) members.abort(i);
  }
  /// Why a group past its deadline is late: the members whose part has not completed.
  std::string late(handle& h) {
    std::string who;
    for (std::size_t i = 0; i < h.size(); ++i)
      if (members.poll(i, h[i]).st != poll_result::state::done) who += (who.empty() ? "" : ", ") + members.name(i);
    return " on " + (who.empty() ? std::string("no member (it completed at the deadline)") : who) +
           "; the clique's communicators were aborted (a hung collective ends only so). If the work is only slow, "
           "raise the wrapper's options::timeout";
  }
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// work: the wait handle every communicator returns for an asynchronous collective.
//
// A work is a cheap, copyable handle to shared completion state. The engine that runs the
// collective completes it exactly once, successfully or with an exception, through
// detail::work_promise. Waiting never needs its own clock: every engine fails a collective
// whose peers have not arrived within the group's timeout (and one that was aborted), so
// wait() returns or throws within about that timeout after the collective started.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/spin.hpp>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <typeinfo>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {
class work_promise;
}  // namespace detail

/// Completion of one collective on one rank. A default-constructed work is complete and
/// successful (what a collective with nothing to do may return).
class work {
 public:
  work() = default;

  /// True when the collective finished, successfully or not; never blocks for long.
  [[nodiscard]] bool ready() const { return !s_ || s_->ready(); }

  /// Blocks until the collective finished; rethrows its failure: a comm_error (or timeout_error)
  /// whose rank() names the rank at fault. May be called any number of times, from any thread.
  void wait() const {
    if (auto e = wait_nothrow()) std::rethrow_exception(e);
  }

  /// Blocks until the collective finished; returns its failure (null on success) instead of
  /// throwing it. Meant for clean-up paths (destructors) that must not throw.
  [[nodiscard]] std::exception_ptr wait_nothrow() const {
    if (!s_) return nullptr;
    auto const lock = s_->wait_done();
    switch (s_->kind) {
      case failure_kind::comm: return std::make_exception_ptr(comm_error(s_->rank, s_->what));
      case failure_kind::timeout: return std::make_exception_ptr(timeout_error(s_->rank, s_->what));
      case failure_kind::other: return s_->error;
      case failure_kind::none: break;
    }
    return nullptr;
  }

 private:
  friend class detail::work_promise;
  // A comm_error or timeout_error is kept as its parts, and each wait makes its own exception
  // object from them: waiters on different threads never share one, so no thread destroys an
  // exception another may still be reading (std::exception_ptr's reference count is hidden from
  // ThreadSanitizer, which would otherwise report such hand-overs). Other failures are kept as is.
  enum class failure_kind : std::uint8_t { none, comm, timeout, other };
  struct state : dparallel::detail::completion {
    failure_kind kind = failure_kind::none;
    int rank = -1;
    std::string what;
    std::exception_ptr error;
  };
  std::shared_ptr<state> s_;
};

namespace detail {

/// The engine's side of a work: make one per collective, hand get_work() to the caller, and
/// complete() it once when the collective finished (null: success).
class work_promise {
 public:
  work_promise() : s_(std::make_shared<work::state>()) {}

  [[nodiscard]] work get_work() const {
    work w;
    w.s_ = s_;
    return w;
  }

  /// Completes the work, successfully when `error` is null. Call once.
  void complete(std::exception_ptr error = nullptr) const {
    auto kind = work::failure_kind::none;
    int rank = -1;
    std::string what;
    if (error) {
      kind = work::failure_kind::other;
      try {
        std::rethrow_exception(error);
      } catch (comm_error const& e) {  // exactly comm_error or timeout_error: rebuilt per wait
        if (typeid(e) == typeid(comm_error) || typeid(e) == typeid(timeout_error)) {
          kind = typeid(e) == typeid(comm_error) ? work::failure_kind::comm : work::failure_kind::timeout;
          rank = e.rank();
          what = e.what();
        }
      } catch (...) {
      }
      if (kind != work::failure_kind::other) error = nullptr;
    }
    s_->complete([&] {
      s_->kind = kind;
      s_->rank = rank;
      s_->what = std::move(what);
      s_->error = std::move(error);
    });
  }

 private:
  std::shared_ptr<work::state> s_;
};

}  // namespace detail

DPARALLEL_NAMESPACE_END

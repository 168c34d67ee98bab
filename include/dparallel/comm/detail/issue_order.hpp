#pragma once
// Ordering a collective after the GPU work of the thread that asked for it, when another thread
// hands it to the engine (the desync detector's worker). A device engine orders each collective
// after the work its *issuing* thread launched so far (NCCL: an event recorded on that thread's
// stream). A wrapper that forwards collectives from its own thread captures a token on the
// caller's thread (issue_order::capture()) and installs it around the forwarded call
// (issue_order::scope); the engine then orders after the token instead of after its own thread.
// The token is opaque here: the engine that installed the capture function (nccl.hpp) makes and
// reads it. Without a device engine in the program, capture() returns null and costs one load.

#include <dparallel/config.hpp>

#include <atomic>
#include <memory>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// See the top of this file.
class issue_order {
 public:
  using token = std::shared_ptr<void>;
  using capture_fn = token (*)();

  /// Called once by a device engine's header: how to capture the calling thread's position.
  static void install(capture_fn f) noexcept { fn().store(f, std::memory_order_release); }
  /// The calling thread's position in its device work (null without a device engine, or when
  /// the thread runs no device work the engine knows of).
  [[nodiscard]] static token capture() {
    capture_fn const f = fn().load(std::memory_order_acquire);
    return f == nullptr ? nullptr : f();
  }
  /// The token installed on this thread by a forwarding wrapper (null when none).
  [[nodiscard]] static token const& current() noexcept { return slot(); }

  /// Installs `t` on this thread for the scope's lifetime.
  class scope {
   public:
    explicit scope(token t) : saved_(std::exchange(slot(), std::move(t))) {}
    scope(scope const&) = delete;
    scope& operator=(scope const&) = delete;
    ~scope() { slot() = std::move(saved_); }

   private:
    token saved_;
  };

 private:
  static std::atomic<capture_fn>& fn() noexcept {
    static std::atomic<capture_fn> f{nullptr};
    return f;
  }
  static token& slot() noexcept {
    thread_local token t;
    return t;
  }
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

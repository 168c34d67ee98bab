#pragma once
// Bounded spinning before a blocking wait.
//
// Every hand-over between the library's threads (a host stream taking its next task, a caller
// waiting for an event or a collective's work, a communication thread waiting for its peers)
// first polls the condition it waits for during a short budget, and only then sleeps on a
// condition variable. Waking a sleeping thread costs tens of microseconds on a loaded or
// virtualised machine; a hand-over caught while spinning costs well under one. The budget bounds
// what a spinning thread can take from the others (it also yields the core every few polls).
//
// The budget is 20 microseconds unless the environment variable DPARALLEL_SPIN_US sets another
// (read once, at the first wait); DPARALLEL_SPIN_US=0 turns spinning off. A waiter may spin a
// multiple of it (the shared-memory group's ranks: comm/shm/detail/group.hpp).

#include <dparallel/config.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// One polite pause inside a polling loop.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  std::this_thread::yield();
#endif
}

/// The spin budget: DPARALLEL_SPIN_US microseconds (0: no spinning), else 20 microseconds.
inline std::chrono::nanoseconds spin_budget() {
  static std::chrono::nanoseconds const budget = [] {
    char const* text = std::getenv("DPARALLEL_SPIN_US");
    long us = 20;
    if (text != nullptr && *text != '\0') {
      char* end = nullptr;
      long const v = std::strtol(text, &end, 10);
      if (end != nullptr && *end == '\0' && v >= 0) us = v > 100000 ? 100000 : v;
    }
    return std::chrono::nanoseconds(std::chrono::microseconds(us));
  }();
  return budget;
}

/// Polls `ready()` until it is true (returns true) or `budget` (the spin budget unless given) has
/// passed (returns false: the caller then blocks). `ready` must be cheap and safe to call without
/// locks.
template <class Ready>
bool spin_until(Ready&& ready, std::chrono::nanoseconds budget = spin_budget()) {
  if (ready()) return true;
  if (budget.count() == 0) return false;
  auto const start = std::chrono::steady_clock::now();
  for (unsigned i = 1;; ++i) {
    cpu_relax();
    if (ready()) return true;
    if ((i & 31u) == 0) {
      if (std::chrono::steady_clock::now() - start >= budget) return false;
      std::this_thread::yield();  // a thread this one waits for may need this core
      if (ready()) return true;
    }
  }
}

/// Done-once state shared by one completer and any number of waiters: the completion part of
/// host::event and of a collective's work. Waiters spin on `finished` within the budget, then
/// sleep on the condition variable; what the completer publishes (in the derived state) is set
/// under the mutex, before `finished`.
struct completion {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<bool> finished{false};

  [[nodiscard]] bool ready() const noexcept { return finished.load(std::memory_order_acquire); }

  /// Blocks until complete; returns holding the mutex, so the published state can be read.
  [[nodiscard]] std::unique_lock<std::mutex> wait_done() {
    spin_until([&] { return ready(); });
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return ready(); });
    return lock;
  }

  /// Waits at most `timeout`; true when complete.
  template <class Rep, class Period>
  [[nodiscard]] bool wait_done_for(std::chrono::duration<Rep, Period> timeout) {
    std::unique_lock lock(m);
    return cv.wait_for(lock, timeout, [&] { return ready(); });
  }

  /// Runs publish() under the mutex, marks the state complete and wakes the waiters. Call once.
  template <class Publish>
  void complete(Publish&& publish) {
    {
      std::lock_guard lock(m);
      publish();
      finished.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

#pragma once
// Counting this process's threads, for tests that check that no thread leaks.
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

namespace test {

/// The number of threads of this process (Linux /proc), or -1 where it cannot be read.
inline int thread_count() {
  // A sanitizer runtime may start a helper thread of its own when the process creates its first
  // thread; create (and join) one before counting, so that thread is in every count.
  static bool const warmed_up = [] {
    std::thread([] {}).join();
    return true;
  }();
  (void)warmed_up;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}

/// The thread count once exited threads are gone: a joined thread may linger in /proc for a
/// moment after pthread_join returns, so poll until it reaches `expected` (a bound against
/// hanging, not a timing threshold: the value compared is the count, not a time).
inline int thread_count_settled(int expected) {
  int count = thread_count();
  for (int i = 0; i < 2000 && count != expected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    count = thread_count();
  }
  return count;
}

}  // namespace test

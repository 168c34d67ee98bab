// The host backend: streams keep order, events wait, errors surface at the wait, kernels compute.
#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <stdexcept>
#include <thread>
#include <vector>

namespace dp = dparallel;

TEST_CASE("a host stream runs work in order on its own thread", "[host][stream]") {
  dp::host::stream s(0);
  std::vector<int> seen;
  std::thread::id worker;
  for (int i = 0; i < 100; ++i) s.enqueue([&, i] {
      seen.push_back(i);
      worker = std::this_thread::get_id();
    });
  s.synchronize();
  REQUIRE(seen.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(seen[static_cast<std::size_t>(i)] == i);
  CHECK(worker != std::this_thread::get_id());
}

TEST_CASE("a stream waits for another stream's event", "[host][stream][event]") {
  dp::host::stream a(0), b(1);
  std::atomic<int> value{0};
  std::promise<void> go;
  auto gate = go.get_future().share();
  auto ev = a.enqueue([&] {
    gate.wait();
    value = 42;
  });
  int seen = -1;
  b.wait(ev);
  auto done = b.enqueue([&] { seen = value.load(); });
  CHECK_FALSE(done.wait_for(std::chrono::milliseconds(20)));  // b is held back by a's event
  go.set_value();
  done.wait();
  CHECK(seen == 42);
}

TEST_CASE("an exception in device work surfaces at the wait, names the device, and is cleared",
          "[host][stream][error]") {
  dp::host::stream s(5);
  auto bad = s.enqueue([] { throw std::runtime_error("kernel failed"); });
  int ran = 0;
  auto later = s.enqueue([&] { ++ran; });
  CHECK_THROWS_WITH(bad.wait(), Catch::Contains("on device 5") && Catch::Contains("kernel failed"));
  CHECK_THROWS_AS(later.wait(), dp::device_error);  // sticky: later work is skipped
  CHECK(ran == 0);
  try {
    s.synchronize();
    FAIL("synchronize must rethrow the stream's error");
  } catch (dp::device_error const& e) {
    CHECK(e.device() == 5);
    try {
      std::rethrow_if_nested(e);
      FAIL("the original exception must be nested");
    } catch (std::runtime_error const& inner) {
      CHECK(std::string(inner.what()) == "kernel failed");
    }
  }
  s.enqueue([&] { ++ran; });
  s.synchronize();  // the error was cleared
  CHECK(ran == 1);
}

TEST_CASE("an error carried by a waited event fails the waiting stream", "[host][stream][error]") {
  dp::host::stream a(1), b(2);
  auto bad = a.enqueue([] { throw std::logic_error("x"); });
  b.wait(bad);
  auto after = b.enqueue([] {});
  try {
    after.wait();
    FAIL("expected the error of device 1");
  } catch (dp::device_error const& e) {
    CHECK(e.device() == 1);
  }
  CHECK_THROWS_AS(a.synchronize(), dp::device_error);
  CHECK_THROWS_AS(b.synchronize(), dp::device_error);
}

TEST_CASE("a held stream's work waits for synchronize_here, which runs it on the caller, in order",
          "[host][stream][hold]") {
  dp::host::stream s(0);
  s.hold();
  std::vector<int> seen;
  std::vector<std::thread::id> where;
  dp::host::event first;
  for (int i = 0; i < 100; ++i) {
    auto e = s.enqueue([&, i] {
      seen.push_back(i);
      where.push_back(std::this_thread::get_id());
    });
    if (i == 0) first = e;
  }
  CHECK_FALSE(first.wait_for(std::chrono::milliseconds(20)));  // the worker was not woken
  s.synchronize_here();
  REQUIRE(seen.size() == 100);
  for (int i = 0; i < 100; ++i) {
    CHECK(seen[static_cast<std::size_t>(i)] == i);
    CHECK(where[static_cast<std::size_t>(i)] == std::this_thread::get_id());
  }
  CHECK(first.ready());
  // The hold ended: later work runs on the worker again.
  std::thread::id later;
  s.enqueue([&] { later = std::this_thread::get_id(); }).wait();
  CHECK(later != std::this_thread::get_id());
}

TEST_CASE("synchronize() after hold() hands the held work to the worker", "[host][stream][hold]") {
  dp::host::stream s(0);
  s.hold();
  std::vector<std::thread::id> where;
  for (int i = 0; i < 10; ++i) s.enqueue([&] { where.push_back(std::this_thread::get_id()); });
  s.synchronize();
  REQUIRE(where.size() == 10);
  for (auto const& w : where) CHECK(w != std::this_thread::get_id());
}

TEST_CASE("synchronize_here waits for the task the worker runs, then keeps the order", "[host][stream][hold]") {
  dp::host::stream s(0);
  std::promise<void> started, go;
  auto gate = go.get_future().share();
  std::vector<int> seen;
  s.enqueue([&] {
    started.set_value();
    gate.wait();
    seen.push_back(0);
  });
  started.get_future().wait();  // the worker holds the first task
  for (int i = 1; i < 50; ++i) s.enqueue([&, i] { seen.push_back(i); });
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    go.set_value();
  });
  s.synchronize_here();
  release.join();
  REQUIRE(seen.size() == 50);
  for (int i = 0; i < 50; ++i) CHECK(seen[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("synchronize_here reports and clears the sticky error as synchronize does", "[host][stream][hold][error]") {
  dp::host::stream s(3);
  s.hold();
  int ran = 0;
  auto bad = s.enqueue([] { throw std::runtime_error("held kernel failed"); });
  auto later = s.enqueue([&] { ++ran; });
  try {
    s.synchronize_here();
    FAIL("synchronize_here must rethrow the stream's error");
  } catch (dp::device_error const& e) {
    CHECK(e.device() == 3);
    CHECK_THAT(e.what(), Catch::Contains("held kernel failed"));
  }
  CHECK(ran == 0);  // sticky: later work was skipped
  CHECK_THROWS_AS(bad.wait(), dp::device_error);
  CHECK_THROWS_AS(later.wait(), dp::device_error);
  s.enqueue([&] { ++ran; });
  s.synchronize_here();  // the error was cleared
  CHECK(ran == 1);
}

TEST_CASE("record() of an idle stream is complete; of a busy one, after the work", "[host][stream][event]") {
  dp::host::stream s(0);
  CHECK(s.record().ready());
  std::promise<void> go;
  auto gate = go.get_future().share();
  std::atomic<int> value{0};
  s.enqueue([&] {
    gate.wait();
    value = 7;
  });
  auto r = s.record();
  CHECK_FALSE(r.wait_for(std::chrono::milliseconds(20)));
  go.set_value();
  r.wait();
  CHECK(value.load() == 7);
  // An idle stream holding an error records an event that carries it.
  s.enqueue([] { throw std::logic_error("y"); });
  (void)s.record().wait_nothrow();
  CHECK_THROWS_AS(s.record().wait(), dp::device_error);
  CHECK_THROWS_AS(s.synchronize(), dp::device_error);
  CHECK(s.record().ready());
}

TEST_CASE("host kernels: copy, scale, add_scaled, weighted_sum", "[host][kernels]") {
  std::vector<double> a{1, 2, 3}, b{10, 20, 30}, c(3);
  dp::host::copy(dp::view(c), dp::view(a));
  CHECK(c == a);
  dp::host::scale(dp::view(c), 2.0);
  CHECK(c == std::vector<double>{2, 4, 6});
  dp::host::add_scaled(dp::view(c), dp::view(b), 0.5);
  CHECK(c == std::vector<double>{7, 14, 21});
  std::vector<dp::tensor_ref> srcs{dp::view(a), dp::view(b)};
  std::vector<double> w{0.25, 0.75};
  dp::host::weighted_sum(dp::view(a), srcs, w);  // in place on the first source
  CHECK(a == std::vector<double>{7.75, 15.5, 23.25});

  // Longer than one tile, float.
  std::vector<float> x(5000), y(5000), z(5000);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 2.0f * static_cast<float>(i);
  }
  std::vector<dp::tensor_ref> s2{dp::view(x), dp::view(y)};
  std::vector<double> w2{0.5, 0.5};
  dp::host::weighted_sum(dp::view(z), s2, w2);
  for (std::size_t i = 0; i < z.size(); ++i) REQUIRE(z[i] == 0.5f * x[i] + 0.5f * y[i]);

  std::vector<float> shortv(3);
  CHECK_THROWS_AS(dp::host::copy(dp::view(shortv), dp::view(a)), dp::invalid_argument);
  std::vector<std::int32_t> ints(3);
  CHECK_THROWS_WITH(dp::host::scale(dp::view(ints), 2.0), Catch::Contains("reduces F32, F64, F16 and BF16, found I32"));
}

namespace {
// weighted_sum's documented order for one element: terms w_k * s_k merged as a balanced binary
// tree built left to right, the uneven rest folded right to left.
template <class T>
T pairwise_reference(std::vector<T> const& terms) {
  std::vector<T> stack;
  std::vector<std::size_t> count;
  for (T t : terms) {
    stack.push_back(t);
    count.push_back(1);
    while (stack.size() >= 2 && count[count.size() - 1] == count[count.size() - 2]) {
      stack[stack.size() - 2] += stack.back();
      count[count.size() - 2] *= 2;
      stack.pop_back();
      count.pop_back();
    }
  }
  while (stack.size() >= 2) {
    stack[stack.size() - 2] += stack.back();
    stack.pop_back();
  }
  return stack[0];
}

template <class T>
void check_weighted_sum_lengths() {
  // Lengths around the kernel's tile (256) and block (16) sizes, at every offset into the arrays
  // (misaligned starts), with 1..9 sources: every element is the reference expression, bitwise.
  std::uint64_t seed = 99;
  auto next = [&] {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<T>(static_cast<double>(seed >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  };
  for (std::size_t sources : {1u, 2u, 3u, 5u, 9u}) {
    for (std::size_t n : {1u, 15u, 16u, 17u, 255u, 256u, 257u, 272u, 529u, 1000u}) {
      std::size_t const offset = n % 3;
      std::vector<std::vector<T>> data(sources, std::vector<T>(n + offset));
      for (auto& v : data)
        for (auto& x : v) x = next();
      std::vector<double> w;
      for (std::size_t k = 0; k < sources; ++k) w.push_back(static_cast<double>(next()));
      std::vector<dp::tensor_ref> srcs;
      for (auto& v : data) srcs.push_back(dp::tensor_view<T>(v.data() + offset, n));
      std::vector<T> out(n + 1);
      dp::host::weighted_sum(dp::tensor_view<T>(out.data() + 1, n), srcs, w);
      for (std::size_t i = 0; i < n; ++i) {
        std::vector<T> terms;
        for (std::size_t k = 0; k < sources; ++k) terms.push_back(static_cast<T>(w[k]) * data[k][offset + i]);
        REQUIRE(out[1 + i] == pairwise_reference(terms));
      }
    }
  }
}
}  // namespace

TEST_CASE("host weighted_sum: the documented pairwise order at every length and alignment", "[host][kernels]") {
  check_weighted_sum_lengths<float>();
  check_weighted_sum_lengths<double>();
}

TEST_CASE("the spin budget follows DPARALLEL_SPIN_US", "[host][spin]") {
  // CTest runs this suite twice: without the variable (20 us) and with DPARALLEL_SPIN_US=0.
  char const* env = std::getenv("DPARALLEL_SPIN_US");
  auto const expected = env == nullptr ? std::chrono::microseconds(20) : std::chrono::microseconds(std::atol(env));
  CHECK(dp::detail::spin_budget() == expected);
  // Spinning reports whether the condition came true; a condition that never does ends it.
  CHECK(dp::detail::spin_until([] { return true; }));
  int polls = 0;
  CHECK(dp::detail::spin_until([&] { return ++polls == 3 || expected.count() == 0; }));
  CHECK_FALSE(dp::detail::spin_until([] { return false; }));
}

TEST_CASE("host::devices validates its count", "[host]") {
  CHECK(dp::host::devices(3).size() == 3);
  CHECK(dp::host::devices(3)[2] == dp::device{dp::device_kind::host, 2});
  CHECK_THROWS_AS(dp::host::devices(0), dp::invalid_argument);
  CHECK_FALSE(dp::host::backend::all_devices().empty());
}

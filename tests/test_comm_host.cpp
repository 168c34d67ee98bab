// The host communicator (thread ranks over shared memory) and spawn: every collective equals a
// reference computed serially in rank order, bit for bit; failures (timeout, abort, mismatch, a
// rank that throws) reach every rank as errors naming the rank at fault; no thread is left behind.
//
// Catch2 assertions are not thread-safe, so rank threads only record what they saw; every
// REQUIRE runs on the test's own thread after the rank threads have been joined.

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include "rank_threads.hpp"
#include "threads.hpp"

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <future>
#include <memory>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

namespace {

// ---------------------------------------------------------------------------------------------
// Helpers

using test::on_ranks;
using test::rethrow_first;

/// What an exception_ptr holds, in a form REQUIRE can look at.
struct caught {
  bool thrown = false;
  bool comm = false;     // a dparallel::comm_error
  bool timeout = false;  // a dparallel::timeout_error
  bool invalid = false;  // a dparallel::invalid_argument
  int rank = -1;         // comm_error::rank()
  std::string what;
};

caught inspect(std::exception_ptr const& e) {
  caught c;
  if (!e) return c;
  c.thrown = true;
  try {
    std::rethrow_exception(e);
  } catch (dp::timeout_error const& ex) {
    c.comm = c.timeout = true;
    c.rank = ex.rank();
    c.what = ex.what();
  } catch (dp::comm_error const& ex) {
    c.comm = true;
    c.rank = ex.rank();
    c.what = ex.what();
  } catch (dp::invalid_argument const& ex) {
    c.invalid = true;
    c.what = ex.what();
  } catch (std::exception const& ex) {
    c.what = ex.what();
  }
  return c;
}

caught inspect_wait(dp::work const& w) { return inspect(w.wait_nothrow()); }

bool contains(std::string const& s, std::string const& part) { return s.find(part) != std::string::npos; }

template <class T>
bool same_bits(std::vector<T> const& a, std::vector<T> const& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// Deterministic inputs. Floating values span eight decades and both signs, so a different
/// summation order gives different bits (the tests would notice).
template <class T>
T input(unsigned salt, int rank, std::size_t i) {
  std::uint64_t h = (static_cast<std::uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull;
  h ^= (static_cast<std::uint64_t>(rank) + 1) * 0xC2B2AE3D27D4EB4Full + salt * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  if constexpr (std::is_floating_point_v<T>) {
    double const mantissa = static_cast<double>(h % 2000001) / 1000000.0 - 1.0;
    constexpr double scale[9] = {1e-4, 1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3, 1e4};
    return static_cast<T>(mantissa * scale[(h >> 40) % 9]);
  } else {
    return static_cast<T>(h);
  }
}

template <class T>
std::vector<T> inputs(unsigned salt, int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = input<T>(salt, rank, i);
  return v;
}

/// The serial reference: srcs[0] + srcs[1] + ... in rank order, element by element, then one
/// multiplication by T(1)/T(n) for avg.
template <class T>
std::vector<T> serial_reduce(std::vector<std::vector<T> const*> const& srcs, std::size_t first, std::size_t count,
                             dp::reduce_op op) {
  std::vector<T> out(srcs[0]->begin() + static_cast<std::ptrdiff_t>(first),
                     srcs[0]->begin() + static_cast<std::ptrdiff_t>(first + count));
  for (std::size_t k = 1; k < srcs.size(); ++k) {
    for (std::size_t i = 0; i < count; ++i) out[i] += (*srcs[k])[first + i];
  }
  if (op == dp::reduce_op::avg) {
    T const scale = T(1) / static_cast<T>(srcs.size());
    for (auto& x : out) x *= scale;
  }
  return out;
}

enum class kind { all_reduce, reduce, broadcast, reduce_scatter, all_gather, barrier };

char const* kind_name(kind k) {
  switch (k) {
    case kind::all_reduce: return "all_reduce";
    case kind::reduce: return "reduce";
    case kind::broadcast: return "broadcast";
    case kind::reduce_scatter: return "reduce_scatter";
    case kind::all_gather: return "all_gather";
    case kind::barrier: return "barrier";
  }
  return "?";
}

/// One collective over n ranks: each rank's buffers before, and what each must hold after.
/// `a` is t (or out); `b` is in for reduce_scatter and all_gather. `m` is the per-rank block.
template <class T>
struct collective_case {
  kind k;
  std::size_t m;
  int root;
  dp::reduce_op op;
  std::vector<std::vector<T>> a, b, expected;

  collective_case(kind k_, int n, std::size_t m_, int root_, dp::reduce_op op_, unsigned salt)
      : k(k_), m(m_), root(root_), op(op_) {
    auto const un = static_cast<std::size_t>(n);
    for (int r = 0; r < n; ++r) {
      switch (k) {
        case kind::reduce_scatter:
          a.push_back(inputs<T>(salt + 1, r, m));  // overwritten
          b.push_back(inputs<T>(salt, r, un * m));
          break;
        case kind::all_gather:
          a.push_back(inputs<T>(salt + 1, r, un * m));  // overwritten
          b.push_back(inputs<T>(salt, r, m));
          break;
        default:
          a.push_back(inputs<T>(salt, r, m));
          b.emplace_back();
      }
    }
    std::vector<std::vector<T> const*> as, bs;
    for (int r = 0; r < n; ++r) {
      as.push_back(&a[static_cast<std::size_t>(r)]);
      bs.push_back(&b[static_cast<std::size_t>(r)]);
    }
    for (int r = 0; r < n; ++r) {
      auto const ur = static_cast<std::size_t>(r);
      switch (k) {
        case kind::all_reduce: expected.push_back(serial_reduce<T>(as, 0, m, op)); break;
        case kind::reduce: expected.push_back(r == root ? serial_reduce<T>(as, 0, m, op) : a[ur]); break;
        case kind::broadcast: expected.push_back(a[static_cast<std::size_t>(root)]); break;
        case kind::reduce_scatter: expected.push_back(serial_reduce<T>(bs, ur * m, m, op)); break;
        case kind::all_gather: {
          std::vector<T> all;
          for (auto const* in : bs) all.insert(all.end(), in->begin(), in->end());
          expected.push_back(all);
          break;
        }
        case kind::barrier: expected.push_back(a[ur]); break;
      }
    }
  }

  dp::work issue(dp::process_group const& g, int r) {
    auto& mine = a[static_cast<std::size_t>(r)];
    auto& in = b[static_cast<std::size_t>(r)];
    switch (k) {
      case kind::all_reduce: return g.all_reduce(dp::view(mine), op);
      case kind::reduce: return g.reduce(dp::view(mine), root, op);
      case kind::broadcast: return g.broadcast(dp::view(mine), root);
      case kind::reduce_scatter: return g.reduce_scatter(dp::view(mine), dp::view(in), op);
      case kind::all_gather: return g.all_gather(dp::view(mine), dp::view(in));
      case kind::barrier: return g.barrier();
    }
    return {};
  }

  /// Index of the first rank whose result differs from the reference in any bit, or -1.
  [[nodiscard]] int first_wrong_rank() const {
    for (std::size_t r = 0; r < a.size(); ++r) {
      if (!same_bits(a[r], expected[r])) return static_cast<int>(r);
    }
    return -1;
  }
};

template <class T>
void check_collective(std::vector<dp::process_group>& groups, kind k, std::size_t m, int root, dp::reduce_op op,
                      unsigned salt) {
  int const n = static_cast<int>(groups.size());
  collective_case<T> c(k, n, m, root, op, salt);
  INFO(kind_name(k) << " of " << m << " x " << (sizeof(T) == 4 ? "F32" : "F64") << " over " << n << " ranks, root "
                    << root << ", " << dp::name_of(op));
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) { c.issue(g, r).wait(); }));
  REQUIRE(c.first_wrong_rank() == -1);
  if (k == kind::all_reduce) {
    for (std::size_t r = 1; r < c.a.size(); ++r) REQUIRE(same_bits(c.a[r], c.a[0]));
  }
}

using test::thread_count;
using test::thread_count_settled;

// The largest size takes the two-phase path (over 64 KiB per rank), in many 64 KiB stripes and a
// short last one (for_each_stripe). Under a sanitizer, which
// makes every element access ~10x dearer, it is smaller but still two-phase for every rank count.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr std::size_t largest = (std::size_t{1} << 18) + 3;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr std::size_t largest = (std::size_t{1} << 18) + 3;
#else
constexpr std::size_t largest = (std::size_t{1} << 20) + 3;
#endif
#else
constexpr std::size_t largest = (std::size_t{1} << 20) + 3;
#endif
constexpr std::array<std::size_t, 5> sizes{0, 1, 7, 1000, largest};

}  // namespace

// -----------------------------------------------------------------------------------------------
// Results

TEST_CASE("host: every collective equals the serial rank-order reference bit for bit", "[host][comm]") {
  for (int n = 1; n <= 5; ++n) {
    auto groups = dp::host::make_group(n, 120s);
    unsigned salt = 0;
    for (std::size_t size : sizes) {
      // reduce_scatter and all_gather: `size` is the whole (in / out) array, n blocks of m.
      std::size_t const block = (size + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n);
      for (auto op : {dp::reduce_op::sum, dp::reduce_op::avg}) {
        check_collective<float>(groups, kind::all_reduce, size, 0, op, ++salt);
        check_collective<double>(groups, kind::all_reduce, size, 0, op, ++salt);
        check_collective<float>(groups, kind::reduce, size, n - 1, op, ++salt);
        check_collective<double>(groups, kind::reduce, size, n / 2, op, ++salt);
        check_collective<float>(groups, kind::reduce_scatter, block, 0, op, ++salt);
        check_collective<double>(groups, kind::reduce_scatter, block, 0, op, ++salt);
      }
      check_collective<float>(groups, kind::broadcast, size, n / 2, dp::reduce_op::sum, ++salt);
      check_collective<double>(groups, kind::broadcast, size, n - 1, dp::reduce_op::sum, ++salt);
      check_collective<float>(groups, kind::all_gather, block, 0, dp::reduce_op::sum, ++salt);
      check_collective<double>(groups, kind::all_gather, block, 0, dp::reduce_op::sum, ++salt);
      check_collective<float>(groups, kind::barrier, 0, 0, dp::reduce_op::sum, ++salt);
    }
    // Every collective above finished on every rank, successfully.
    for (auto const& g : groups) REQUIRE(g.completed_ops() == salt);
  }
}

TEST_CASE("host reduce kernel: the documented rank order at every length, source count and alignment",
          "[host][comm]") {
  // reduce_tiles works in 1 KiB tiles, then 16-element blocks, then single elements, adding the
  // first two sources and scaling in the same pass: every element must still be
  // ((s0 + s1) + ...) * scale, bit for bit, with the destinations written in place or apart.
  auto const check = [](auto zero) {
    using T = decltype(zero);
    constexpr std::size_t tile = 1024 / sizeof(T);
    for (std::size_t n = 1; n <= 5; ++n) {
      for (std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{17},
                              tile - 1, tile, tile + 1, tile + 16 + 3, 3 * tile + 47}) {
        for (std::size_t shift : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {
          for (bool avg : {false, true}) {
            for (bool in_place : {false, true}) {
              INFO(n << " sources of " << len << " x " << sizeof(T) << " bytes, shifted " << shift << ", avg " << avg
                     << ", in place " << in_place);
              std::vector<std::vector<T>> src(n), out(n);
              std::vector<T const*> sp(n);
              std::vector<T*> dsts(n);
              for (std::size_t k = 0; k < n; ++k) {
                src[k] = inputs<T>(static_cast<unsigned>(len + 7 * shift), static_cast<int>(k), len + shift);
                out[k].assign(len + shift, T(-1));
                sp[k] = src[k].data() + shift;
                dsts[k] = (in_place ? src[k].data() : out[k].data()) + shift;
              }
              T const scale = dp::detail::avg_scale<T>(static_cast<int>(n));
              std::vector<T> expected(len);
              for (std::size_t i = 0; i < len; ++i) {
                T v = sp[0][i];
                for (std::size_t k = 1; k < n; ++k) v += sp[k][i];
                expected[i] = avg ? v * scale : v;
              }
              dp::detail::reduce_tiles<T>(std::span<T const* const>(sp.data(), n), std::span<T* const>(dsts.data(), n),
                                          len, avg, scale);
              for (std::size_t k = 0; k < n; ++k) {
                std::vector<T> const got(dsts[k], dsts[k] + len);
                REQUIRE(same_bits(got, expected));
              }
            }
          }
        }
      }
    }
  };
  check(float{});
  check(double{});
}

TEST_CASE("host: broadcast and all_gather move any dtype", "[host][comm]") {
  auto groups = dp::host::make_group(3, 120s);
  for (std::size_t m : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
    unsigned const salt = static_cast<unsigned>(m);
    {
      collective_case<std::int32_t> c(kind::broadcast, 3, m, 2, dp::reduce_op::sum, salt);
      rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) { c.issue(g, r).wait(); }));
      REQUIRE(c.first_wrong_rank() == -1);
    }
    {
      collective_case<std::uint8_t> c(kind::all_gather, 3, m, 0, dp::reduce_op::sum, salt);
      rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) { c.issue(g, r).wait(); }));
      REQUIRE(c.first_wrong_rank() == -1);
    }
    {
      collective_case<std::int64_t> c(kind::all_gather, 3, m, 0, dp::reduce_op::sum, salt);
      rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) { c.issue(g, r).wait(); }));
      REQUIRE(c.first_wrong_rank() == -1);
    }
  }
}

TEST_CASE("host: in-place reduce_scatter and all_gather", "[host][comm]") {
  int const n = 4;
  std::size_t const m = 1001;
  auto groups = dp::host::make_group(n, 120s);

  // reduce_scatter into this rank's own block of the input.
  std::vector<std::vector<double>> rs(n);
  for (int r = 0; r < n; ++r) rs[static_cast<std::size_t>(r)] = inputs<double>(7, r, n * m);
  std::vector<std::vector<double> const*> srcs;
  std::vector<std::vector<double>> copies = rs;
  for (auto const& v : copies) srcs.push_back(&v);
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    dp::tensor_ref const in = dp::view(rs[static_cast<std::size_t>(r)]);
    g.reduce_scatter(in.subview(static_cast<std::size_t>(r) * m, m), in, dp::reduce_op::avg).wait();
  }));
  for (int r = 0; r < n; ++r) {
    auto const& got = rs[static_cast<std::size_t>(r)];
    std::vector<double> block(got.begin() + r * static_cast<std::ptrdiff_t>(m),
                              got.begin() + (r + 1) * static_cast<std::ptrdiff_t>(m));
    REQUIRE(same_bits(block, serial_reduce<double>(srcs, static_cast<std::size_t>(r) * m, m, dp::reduce_op::avg)));
  }

  // all_gather from this rank's own block of the output.
  std::vector<std::vector<float>> ag(n, std::vector<float>(n * m));
  std::vector<float> expected;
  for (int r = 0; r < n; ++r) {
    auto const mine = inputs<float>(8, r, m);
    std::copy(mine.begin(), mine.end(), ag[static_cast<std::size_t>(r)].begin() + r * static_cast<std::ptrdiff_t>(m));
    expected.insert(expected.end(), mine.begin(), mine.end());
  }
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    dp::tensor_ref const out = dp::view(ag[static_cast<std::size_t>(r)]);
    g.all_gather(out, out.subview(static_cast<std::size_t>(r) * m, m)).wait();
  }));
  for (auto const& got : ag) REQUIRE(same_bits(got, expected));
}

TEST_CASE("host: many collectives issued back to back, then waited, all complete correctly", "[host][comm]") {
  int const n = 4;
  int const count = 48;
  auto groups = dp::host::make_group(n, 120s);
  std::vector<collective_case<float>> f32;
  std::vector<collective_case<double>> f64;
  kind const kinds[] = {kind::all_reduce, kind::broadcast, kind::reduce_scatter, kind::all_gather, kind::reduce,
                        kind::barrier};
  for (int i = 0; i < count / 2; ++i) {
    kind const k = kinds[i % 6];
    auto const m = static_cast<std::size_t>(100 + 977 * i);
    auto const op = i % 4 < 2 ? dp::reduce_op::sum : dp::reduce_op::avg;
    f32.emplace_back(k, n, m, i % n, op, static_cast<unsigned>(2 * i));
    f64.emplace_back(kinds[(i + 3) % 6], n, m / 2, (i + 1) % n, op, static_cast<unsigned>(2 * i + 1));
  }
  std::vector<std::uint64_t> issued_before_wait(n), completed_after_wait(n);
  std::vector<int> all_ready(n);
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    std::vector<dp::work> works;
    for (int i = 0; i < count / 2; ++i) {  // interleaved dtypes and kinds, nothing waited yet
      works.push_back(f32[static_cast<std::size_t>(i)].issue(g, r));
      works.push_back(f64[static_cast<std::size_t>(i)].issue(g, r));
    }
    issued_before_wait[static_cast<std::size_t>(r)] = works.size();
    for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();  // newest first
    bool ready = true;
    for (auto const& w : works) ready = ready && w.ready();
    all_ready[static_cast<std::size_t>(r)] = ready ? 1 : 0;
    completed_after_wait[static_cast<std::size_t>(r)] = g.completed_ops();
  }));
  for (int r = 0; r < n; ++r) {
    REQUIRE(issued_before_wait[static_cast<std::size_t>(r)] == static_cast<std::uint64_t>(count));
    REQUIRE(completed_after_wait[static_cast<std::size_t>(r)] == static_cast<std::uint64_t>(count));
    REQUIRE(all_ready[static_cast<std::size_t>(r)] == 1);
  }
  for (std::size_t i = 0; i < f32.size(); ++i) {
    INFO("collective pair " << i);
    REQUIRE(f32[i].first_wrong_rank() == -1);
    REQUIRE(f64[i].first_wrong_rank() == -1);
  }
}

// -----------------------------------------------------------------------------------------------
// Failures

TEST_CASE("host: a rank that never calls makes the others time out, naming it", "[host][comm]") {
  auto groups = dp::host::make_group(3, 200ms);
  std::vector<std::vector<float>> x(3, std::vector<float>(8, 1.0f));
  std::vector<caught> seen(3);
  // All three meet at a barrier; then ranks 0 and 1 call all_reduce (issued together with the
  // barrier, so their threads post it right after) and rank 2 never does.
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    dp::work const first = g.barrier();
    if (r == 2) return first.wait();
    dp::work const second = g.all_reduce(dp::view(x[static_cast<std::size_t>(r)]));
    first.wait();
    seen[static_cast<std::size_t>(r)] = inspect_wait(second);
  }));
  for (int r : {0, 1}) {
    auto const& c = seen[static_cast<std::size_t>(r)];
    INFO(c.what);
    REQUIRE(c.timeout);
    REQUIRE(c.rank == 2);
    REQUIRE(contains(c.what, "rank 2 did not call collective #2 within 200 ms"));
    REQUIRE(contains(c.what, "all_reduce(8 x F32, sum)"));
  }
  // The group stays failed: rank 2's late call fails too, with the same diagnosis.
  auto const late = inspect_wait(groups[2].all_reduce(dp::view(x[2])));
  REQUIRE(late.timeout);
  REQUIRE(late.rank == 2);
  // The data was not touched.
  for (auto const& v : x) REQUIRE(v == std::vector<float>(8, 1.0f));
}

TEST_CASE("host: a timeout names every missing rank, the first as rank()", "[host][comm]") {
  auto groups = dp::host::make_group(4, 200ms);
  std::vector<caught> seen(4);
  // All four meet at a barrier, then ranks 1 and 3 stop calling.
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    dp::work const first = g.barrier();
    if (r == 1 || r == 3) return first.wait();
    dp::work const second = g.barrier();
    first.wait();
    seen[static_cast<std::size_t>(r)] = inspect_wait(second);
  }));
  for (int r : {0, 2}) {
    auto const& c = seen[static_cast<std::size_t>(r)];
    INFO(c.what);
    REQUIRE(c.timeout);
    REQUIRE(c.rank == 1);
    REQUIRE(contains(c.what, "ranks 1 and 3 did not call collective #2"));
    REQUIRE(contains(c.what, "barrier()"));
  }
}

TEST_CASE("host: abort fails every pending and future collective on every rank", "[host][comm]") {
  auto groups = dp::host::make_group(3, 120s);  // long: the abort, not the timeout, ends the waits
  std::vector<std::vector<double>> x(3, std::vector<double>(100, 2.0));
  std::vector<std::vector<caught>> seen(3);
  rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
    auto& mine = seen[static_cast<std::size_t>(r)];
    if (r == 2) {
      g.abort("stop now");
      mine.push_back(inspect_wait(g.all_reduce(dp::view(x[2]))));  // a future one, on the aborting rank
      return;
    }
    // Several pending collectives each, whatever the order relative to the abort.
    std::vector<dp::work> works{g.all_reduce(dp::view(x[static_cast<std::size_t>(r)])), g.barrier(),
                                g.broadcast(dp::view(x[static_cast<std::size_t>(r)]), 0)};
    for (auto const& w : works) mine.push_back(inspect_wait(w));
    mine.push_back(inspect_wait(g.barrier()));  // a future one
  }));
  for (int r = 0; r < 3; ++r) {
    for (auto const& c : seen[static_cast<std::size_t>(r)]) {
      INFO("rank " << r << ": " << c.what);
      REQUIRE(c.comm);
      REQUIRE_FALSE(c.timeout);
      REQUIRE(c.rank == 2);
      REQUIRE(contains(c.what, "rank 2 aborted the process group: stop now"));
    }
  }
  REQUIRE(seen[0].size() == 4);
  REQUIRE(groups[0].completed_ops() == 4);  // failed collectives are finished too
}

TEST_CASE("host: mismatched collectives fail on every rank, showing both calls", "[host][comm]") {
  struct mismatch {
    char const* name;
    int odd_rank;
    char const* expected_call;
    char const* odd_call;
  };
  for (auto const& mm : {mismatch{"op", 2, "all_reduce(100 x F32, sum)", "broadcast(100 x F32, root 0)"},
                         mismatch{"count", 1, "all_reduce(100 x F32, sum)", "all_reduce(99 x F32, sum)"},
                         mismatch{"dtype", 2, "all_reduce(100 x F32, sum)", "all_reduce(100 x F64, sum)"},
                         mismatch{"reduce op", 1, "all_reduce(100 x F32, sum)", "all_reduce(100 x F32, avg)"},
                         mismatch{"root", 2, "broadcast(100 x F32, root 0)", "broadcast(100 x F32, root 1)"}}) {
    INFO("mismatched " << mm.name);
    std::string const name = mm.name;
    auto groups = dp::host::make_group(3, 120s);
    std::vector<std::vector<float>> xf(3, std::vector<float>(100, 3.0f));
    std::vector<double> xd(100, 3.0);
    std::vector<caught> seen(3);
    rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
      auto const ur = static_cast<std::size_t>(r);
      bool const odd = r == mm.odd_rank;
      dp::work w;
      if (name == "op") {
        w = odd ? g.broadcast(dp::view(xf[ur]), 0) : g.all_reduce(dp::view(xf[ur]));
      } else if (name == "count") {
        w = g.all_reduce(dp::tensor_ref(dp::view(xf[ur])).subview(0, odd ? 99 : 100));
      } else if (name == "dtype") {
        w = odd ? g.all_reduce(dp::view(xd)) : g.all_reduce(dp::view(xf[ur]));
      } else if (name == "reduce op") {
        w = g.all_reduce(dp::view(xf[ur]), odd ? dp::reduce_op::avg : dp::reduce_op::sum);
      } else {
        w = g.broadcast(dp::view(xf[ur]), odd ? 1 : 0);
      }
      seen[ur] = inspect_wait(w);
    }));
    for (int r = 0; r < 3; ++r) {
      auto const& c = seen[static_cast<std::size_t>(r)];
      INFO("rank " << r << ": " << c.what);
      REQUIRE(c.comm);
      REQUIRE_FALSE(c.timeout);
      REQUIRE(c.rank == mm.odd_rank);
      REQUIRE(contains(c.what, std::string("rank 0 called ") + mm.expected_call));
      REQUIRE(contains(c.what, "rank " + std::to_string(mm.odd_rank) + " called " + mm.odd_call));
    }
    // Nothing was read or written.
    for (auto const& v : xf) REQUIRE(v == std::vector<float>(100, 3.0f));
    REQUIRE(xd == std::vector<double>(100, 3.0));
  }
}

TEST_CASE("host: invalid arguments throw on the caller and fail its peers at once", "[host][comm]") {
  SECTION("a dtype the host communicator cannot reduce") {
    auto groups = dp::host::make_group(2, 120s);
    std::vector<std::int32_t> xi(10, 1);
    std::vector<float> xf(10, 1.0f);
    std::vector<caught> seen(2);
    rethrow_first(on_ranks(groups, [&](int r, dp::process_group& g) {
      if (r == 1) {
        try {
          (void)g.all_reduce(dp::view(xi));
        } catch (...) {
          seen[1] = inspect(std::current_exception());
        }
      } else {
        seen[0] = inspect_wait(g.all_reduce(dp::view(xf)));
      }
    }));
    INFO(seen[1].what);
    REQUIRE(seen[1].invalid);
    REQUIRE(contains(seen[1].what, "reduces F32, F64, F16 and BF16, found I32"));
    INFO(seen[0].what);
    REQUIRE(seen[0].comm);
    REQUIRE(seen[0].rank == 1);
    REQUIRE(contains(seen[0].what, "found I32"));
  }
  SECTION("inconsistent sizes, a bad root, overlapping buffers") {
    auto groups = dp::host::make_group(2, 120s);
    std::vector<float> big(10), small(4);
    REQUIRE_THROWS_AS(groups[0].reduce_scatter(dp::view(small), dp::view(big)), dp::invalid_argument);
    REQUIRE_THROWS_AS(groups[0].all_gather(dp::view(big), dp::view(small)), dp::invalid_argument);
    REQUIRE_THROWS_AS(groups[0].broadcast(dp::view(small), 2), dp::invalid_argument);
    REQUIRE_THROWS_AS(groups[0].reduce(dp::view(small), -1), dp::invalid_argument);
    dp::tensor_ref const whole = dp::view(big);  // 10 = 2 * 5; block 0 is [0, 5)
    REQUIRE_THROWS_AS(groups[0].all_gather(whole, whole.subview(1, 5)), dp::invalid_argument);
    REQUIRE_THROWS_AS(groups[0].reduce_scatter(whole.subview(3, 5), whole), dp::invalid_argument);
    // The group was aborted by the first of them: the other rank fails at once.
    auto const c = inspect_wait(groups[1].barrier());
    REQUIRE(c.comm);
    REQUIRE(c.rank == 0);
    REQUIRE(contains(c.what, "reduce_scatter on rank 0: expected `in` to hold size() * out.size() = 2 * 4 = 8"));
  }
}

TEST_CASE("host: destroying a group with collectives pending fails them and joins its threads", "[host][comm]") {
  int const before = thread_count();
  std::vector<float> x(16, 1.0f);
  dp::work pending;
  {
    auto groups = dp::host::make_group(2, 120s);
    pending = groups[0].all_reduce(dp::view(x));  // rank 1 never calls
    groups.clear();                               // must neither hang nor leak
  }
  auto const c = inspect_wait(pending);
  INFO(c.what);
  REQUIRE(c.comm);
  REQUIRE(c.rank == 0);
  REQUIRE(contains(c.what, "destroyed with 1 collective pending"));
  REQUIRE(thread_count_settled(before) == before);
}

// -----------------------------------------------------------------------------------------------
// spawn

TEST_CASE("spawn: ranks run the function and see their rank and world size", "[host][comm]") {
  int const n = 4;
  std::vector<std::vector<double>> data(n);
  std::vector<int> ranks(n, -1), sizes_seen(n, -1);
  for (int r = 0; r < n; ++r) data[static_cast<std::size_t>(r)] = inputs<double>(99, r, 5000);
  std::vector<std::vector<double> const*> srcs;
  auto const copies = data;
  for (auto const& v : copies) srcs.push_back(&v);

  dp::spawn(n, [&](dp::rank_context& ctx) {
    auto const r = static_cast<std::size_t>(ctx.rank());
    ranks[r] = ctx.rank();
    sizes_seen[r] = ctx.world_size();
    ctx.group().all_reduce(dp::view(data[r]), dp::reduce_op::avg).wait();
  });
  auto const expected = serial_reduce<double>(srcs, 0, 5000, dp::reduce_op::avg);
  for (int r = 0; r < n; ++r) {
    REQUIRE(ranks[static_cast<std::size_t>(r)] == r);
    REQUIRE(sizes_seen[static_cast<std::size_t>(r)] == n);
    REQUIRE(same_bits(data[static_cast<std::size_t>(r)], expected));
  }
}

TEST_CASE("spawn: a rank that throws fails the others' collectives and is rethrown, naming it", "[host][comm]") {
  int const before = thread_count();
  int const n = 4;
  std::vector<caught> seen(n);
  std::vector<std::vector<float>> x(n, std::vector<float>(1000, 1.0f));
  bool const others_rethrow = GENERATE(false, true);
  INFO("the other ranks " << (others_rethrow ? "rethrow" : "swallow") << " their comm_errors");

  caught thrown;
  std::string nested;
  try {
    dp::spawn(
        n,
        [&](dp::rank_context& ctx) {
          auto const r = static_cast<std::size_t>(ctx.rank());
          if (ctx.rank() == 2) throw std::runtime_error("boom");
          dp::work const w = ctx.group().all_reduce(dp::view(x[r]));  // blocked: rank 2 never calls
          seen[r] = inspect(w.wait_nothrow());
          if (others_rethrow) w.wait();
        },
        {.timeout = 120s});  // long: the abort, not the timeout, ends the waits
  } catch (...) {
    thrown = inspect(std::current_exception());
    // The original exception is nested inside the comm_error.
    try {
      std::rethrow_exception(std::current_exception());
    } catch (std::exception const& e) {
      try {
        std::rethrow_if_nested(e);
      } catch (std::runtime_error const& inner) {
        nested = inner.what();
      }
    }
  }
  INFO(thrown.what);
  REQUIRE(nested == "boom");
  REQUIRE(thrown.comm);
  REQUIRE(thrown.rank == 2);
  REQUIRE(contains(thrown.what, "rank 2 of 4 threw: boom"));
  for (int r : {0, 1, 3}) {
    auto const& c = seen[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << c.what);
    REQUIRE(c.comm);
    REQUIRE_FALSE(c.timeout);
    REQUIRE(c.rank == 2);
    REQUIRE(contains(c.what, "rank 2 aborted the process group: its function threw: boom"));
  }
  // spawn joined the rank threads and the communication threads.
  REQUIRE(thread_count_settled(before) == before);
}

TEST_CASE("spawn: a rank that returns without calling makes the others fail, naming it", "[host][comm]") {
  int const n = 3;
  std::vector<caught> seen(n);
  caught thrown;
  try {
    dp::spawn(
        n,
        [&](dp::rank_context& ctx) {
          if (ctx.rank() == 1) return;  // issues no collective at all
          seen[static_cast<std::size_t>(ctx.rank())] = inspect_wait(ctx.group().barrier());
          ctx.group().barrier().wait();
        },
        {.timeout = 120s});
  } catch (...) {
    thrown = inspect(std::current_exception());
  }
  INFO(thrown.what);
  REQUIRE(thrown.timeout);
  REQUIRE(thrown.rank == 1);
  for (int r : {0, 2}) {
    auto const& c = seen[static_cast<std::size_t>(r)];
    INFO(c.what);
    REQUIRE(c.timeout);
    REQUIRE(c.rank == 1);
    REQUIRE(contains(c.what, "rank 1 finished"));
    REQUIRE(contains(c.what, "will never call collective #1"));
  }
}

TEST_CASE("spawn: a short timeout with a rank that stays away is rethrown, naming it", "[host][comm]") {
  // Rank 1 stays alive without calling until rank 0 has its verdict, so rank 0's barrier fails by
  // the timeout (not because rank 1 finished); spawn rethrows that timeout_error as it is.
  std::promise<void> verdict;
  auto const verdict_seen = verdict.get_future().share();
  caught seen;
  caught thrown;
  try {
    dp::spawn(
        2,
        [&](dp::rank_context& ctx) {
          if (ctx.rank() == 1) {
            verdict_seen.wait();
            return;
          }
          dp::work const w = ctx.group().barrier();
          seen = inspect(w.wait_nothrow());
          verdict.set_value();
          w.wait();
        },
        {.timeout = 200ms});
  } catch (...) {
    thrown = inspect(std::current_exception());
  }
  INFO(seen.what);
  REQUIRE(seen.timeout);
  REQUIRE(seen.rank == 1);
  REQUIRE(contains(seen.what, "rank 1 did not call collective #1 within 200 ms"));
  REQUIRE(thrown.timeout);
  REQUIRE(thrown.rank == 1);
  REQUIRE(thrown.what == seen.what);
}

// -----------------------------------------------------------------------------------------------
// process_group and work

namespace {
/// A one-rank communicator with none of the optional members: process_group must adapt it.
struct solo_communicator {
  int calls = 0;
  std::string aborted;
  int rank() { return 0; }
  int size() { return 1; }
  dp::work all_reduce(dp::tensor_ref, dp::reduce_op) { return ++calls, dp::work{}; }
  dp::work reduce(dp::tensor_ref, int, dp::reduce_op) { return ++calls, dp::work{}; }
  dp::work broadcast(dp::tensor_ref, int) { return ++calls, dp::work{}; }
  dp::work reduce_scatter(dp::tensor_ref, dp::tensor_ref, dp::reduce_op) { return ++calls, dp::work{}; }
  dp::work all_gather(dp::tensor_ref, dp::tensor_ref) { return ++calls, dp::work{}; }
  dp::work barrier() { return ++calls, dp::work{}; }
  void abort(std::string why) { aborted = std::move(why); }
};
}  // namespace

static_assert(dp::communicator<dp::host::communicator>);
static_assert(dp::communicator<dp::process_group>);
static_assert(dp::communicator<solo_communicator>);
static_assert(!dp::communicator<int>);

TEST_CASE("process_group: a type-erased handle to any communicator", "[host][comm]") {
  auto solo = std::make_shared<solo_communicator>();
  dp::process_group g(solo);
  dp::process_group copy = g;  // copies share the communicator
  std::vector<float> x(3);
  copy.all_reduce(dp::view(x)).wait();
  copy.barrier().wait();
  g.abort("why");
  REQUIRE(solo->calls == 2);
  REQUIRE(solo->aborted == "why");
  REQUIRE(g.rank() == 0);
  REQUIRE(g.size() == 1);
  REQUIRE(g.timeout() == 300s);  // stand-ins for the members solo_communicator lacks
  g.set_timeout(5s);
  REQUIRE(g.timeout() == 5s);
  REQUIRE(g.completed_ops() == 0);

  dp::process_group empty;
  REQUIRE_FALSE(empty.valid());
  REQUIRE_THROWS_AS(empty.rank(), dp::invalid_argument);
  REQUIRE(dp::work{}.ready());
  REQUIRE_NOTHROW(dp::work{}.wait());
}

TEST_CASE("process_group: timeout of the host communicator", "[host][comm]") {
  auto groups = dp::host::make_group(2, 1234ms);
  REQUIRE(groups[0].timeout() == 1234ms);
  groups[1].set_timeout(5s);
  REQUIRE(groups[1].timeout() == 5s);
  REQUIRE(groups[0].timeout() == 1234ms);
  REQUIRE_THROWS_AS(groups[0].set_timeout(0ms), dp::invalid_argument);
  // A timeout too large for the clock means "wait as long as it takes", not "already expired".
  for (auto& g : groups) g.set_timeout(std::chrono::milliseconds::max());
  rethrow_first(on_ranks(groups, [](int, dp::process_group& g) { g.barrier().wait(); }));
  REQUIRE_THROWS_AS(dp::host::make_group(0), dp::invalid_argument);
  REQUIRE(groups[0].rank() == 0);
  REQUIRE(groups[1].rank() == 1);
  REQUIRE(groups[1].size() == 2);
}

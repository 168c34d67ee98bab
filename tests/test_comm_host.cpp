// The host communicator (thread ranks over shared memory): every collective equals a reference
// computed serially in rank order, bit for bit, at every rank count, size, dtype and alignment.
// Its failures, spawn and process_group: test_comm_host_failures.cpp.
//
// Catch2 assertions are not thread-safe, so rank threads only record what they saw; every
// REQUIRE runs on the test's own thread after the rank threads have been joined.

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/comm/work.hpp>

#include <catch2/catch.hpp>

#include "host_comm_checks.hpp"
#include "rank_threads.hpp"

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

namespace {

using test::inputs;
using test::on_ranks;
using test::rethrow_first;
using test::same_bits;
using test::serial_reduce;

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

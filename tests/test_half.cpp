// dparallel::f16 and dparallel::bf16 conversions against independent references: every one of the
// 65536 bit patterns of each widens to the value its fields define (computed here in double) and
// narrows back to itself; float -> 16-bit rounds to nearest with ties to even, checked against a
// brute-force search of the 16-bit grid at every midpoint, beside every midpoint, at every 16-bit
// value and at random floats; NaN becomes 0x7FFF; overflow rounds to infinity.
#include <dparallel/core/half.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace dpl = dparallel;

namespace {

/// The value of 16-bit pattern `h` with `mant_bits` mantissa bits and `exp_bits` exponent bits,
/// from its fields, in double (NaN for NaN patterns).
double field_value(std::uint16_t h, int exp_bits, int mant_bits) {
  int const bias = (1 << (exp_bits - 1)) - 1;
  unsigned const mant = h & ((1u << mant_bits) - 1u);
  unsigned const exp = (h >> mant_bits) & ((1u << exp_bits) - 1u);
  double const sign = (h & 0x8000u) != 0 ? -1.0 : 1.0;
  if (exp == (1u << exp_bits) - 1u)
    return mant == 0 ? sign * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), 1 - bias - mant_bits);
  return sign * std::ldexp(static_cast<double>(mant + (1u << mant_bits)), static_cast<int>(exp) - bias - mant_bits);
}

/// The brute-force rounding of float x to a 16-bit format: the nearest of the non-negative grid
/// `grid` (every finite value in increasing order, then the first power of two beyond the largest,
/// standing for infinity, as IEEE's roundTiesToEven treats overflow), ties to the even pattern.
std::uint16_t brute_round(float x, std::vector<std::pair<double, std::uint16_t>> const& grid) {
  if (std::isnan(x)) return 0x7fff;
  std::uint16_t const sign = std::signbit(x) ? 0x8000 : 0;
  double const a = std::fabs(static_cast<double>(x));
  if (std::isinf(x)) return static_cast<std::uint16_t>(sign | grid.back().second);
  auto const hi = std::lower_bound(grid.begin(), grid.end(), a,
                                   [](auto const& g, double v) { return g.first < v; });
  if (hi == grid.end()) return static_cast<std::uint16_t>(sign | grid.back().second);
  if (hi->first == a || hi == grid.begin()) return static_cast<std::uint16_t>(sign | hi->second);
  auto const lo = hi - 1;
  double const dl = a - lo->first, dh = hi->first - a;
  std::uint16_t pick = dl < dh ? lo->second : dh < dl ? hi->second : ((lo->second & 1u) == 0 ? lo->second : hi->second);
  return static_cast<std::uint16_t>(sign | pick);
}

template <class H>
struct format;
template <>
struct format<dpl::f16> {
  static constexpr int exp_bits = 5, mant_bits = 10;
  static constexpr std::uint16_t inf = 0x7c00;
};
template <>
struct format<dpl::bf16> {
  static constexpr int exp_bits = 8, mant_bits = 7;
  static constexpr std::uint16_t inf = 0x7f80;
};

/// The non-negative grid of H for brute_round: every finite non-negative value, then infinity
/// placed where the next binade would start.
template <class H>
std::vector<std::pair<double, std::uint16_t>> grid_of() {
  using F = format<H>;
  std::vector<std::pair<double, std::uint16_t>> g;
  for (unsigned b = 0; b < F::inf; ++b)
    g.emplace_back(field_value(static_cast<std::uint16_t>(b), F::exp_bits, F::mant_bits), static_cast<std::uint16_t>(b));
  int const bias = (1 << (F::exp_bits - 1)) - 1;
  g.emplace_back(std::ldexp(1.0, bias + 1), F::inf);
  return g;
}

/// Every test float for the rounding: each grid value, each midpoint between neighbours and the
/// floats just beside it (both signs), float's own extremes, and random floats of every magnitude.
template <class H>
std::vector<float> rounding_inputs(std::vector<std::pair<double, std::uint16_t>> const& grid) {
  std::vector<float> xs;
  for (std::size_t i = 0; i + 1 < grid.size(); ++i) {
    auto const v = static_cast<float>(grid[i].first);
    auto const mid = static_cast<float>((grid[i].first + grid[i + 1].first) / 2);  // exact in float
    for (float x : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, std::numeric_limits<float>::infinity())}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  for (float x : {std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::infinity(), 0.0f}) {
    xs.push_back(x);
    xs.push_back(-x);
  }
  std::mt19937 gen(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    auto const f = std::bit_cast<float>(bits(gen));
    if (!std::isnan(f)) xs.push_back(f);
  }
  return xs;
}

template <class H>
void check_all_patterns() {
  using F = format<H>;
  std::size_t wrong_value = 0, wrong_round_trip = 0, nan_seen = 0;
  for (unsigned b = 0; b < 65536; ++b) {
    auto const h = H::from_bits(static_cast<std::uint16_t>(b));
    float const f = static_cast<float>(h);
    double const want = field_value(h.bits, F::exp_bits, F::mant_bits);
    if (std::isnan(want)) {
      ++nan_seen;
      wrong_value += !std::isnan(f) || std::signbit(f) != ((b & 0x8000u) != 0);
      wrong_round_trip += H(f).bits != 0x7fff;
      continue;
    }
    wrong_value += static_cast<double>(f) != want || std::signbit(f) != ((b & 0x8000u) != 0);
    wrong_round_trip += H(f).bits != h.bits;
  }
  CHECK(wrong_value == 0);
  CHECK(wrong_round_trip == 0);
  CHECK(nan_seen == 2 * ((1u << F::mant_bits) - 1u));
}

template <class H>
void check_rounding() {
  auto const grid = grid_of<H>();
  auto const xs = rounding_inputs<H>(grid);
  std::size_t wrong = 0;
  float first_wrong = 0;
  for (float x : xs) {
    if (H(x).bits != brute_round(x, grid)) {
      if (wrong++ == 0) first_wrong = x;
    }
  }
  INFO("inputs " << xs.size() << ", first wrong " << first_wrong);
  CHECK(wrong == 0);
}

}  // namespace

TEST_CASE("f16: every bit pattern widens to its IEEE value and narrows back to itself", "[half]") {
  check_all_patterns<dpl::f16>();
}

TEST_CASE("bf16: every bit pattern widens to its value and narrows back to itself", "[half]") {
  check_all_patterns<dpl::bf16>();
}

TEST_CASE("f16: float rounds to nearest, ties to even, overflow to infinity, NaN to 0x7FFF", "[half]") {
  check_rounding<dpl::f16>();
  // Edge cases by hand: the largest finite value, the overflow threshold (65520 = 65504 + half an
  // ulp: a tie, to even, which is infinity), the smallest subnormal and the tie below it.
  CHECK(dpl::f16(65504.0f).bits == 0x7bff);
  CHECK(dpl::f16(65519.996f).bits == 0x7bff);
  CHECK(dpl::f16(65520.0f).bits == 0x7c00);
  CHECK(dpl::f16(-65520.0f).bits == 0xfc00);
  CHECK(dpl::f16(0x1p-24f).bits == 0x0001);
  CHECK(dpl::f16(0x1p-25f).bits == 0x0000);           // tie between 0 and 2^-24: even is 0
  CHECK(dpl::f16(0x1.8p-24f).bits == 0x0002);         // tie between 1 and 2 units: even is 2
  CHECK(dpl::f16(-0.0f).bits == 0x8000);
  CHECK(dpl::f16(1.0f + 0x1p-11f).bits == 0x3c00);    // tie: to even (1.0)
  CHECK(dpl::f16(1.0f + 0x1.8p-10f).bits == 0x3c02);  // tie between 0x3c01 and 0x3c02: even
  CHECK(dpl::f16(std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  CHECK(dpl::f16(-std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
}

TEST_CASE("bf16: float rounds to nearest, ties to even, overflow to infinity, NaN to 0x7FFF", "[half]") {
  check_rounding<dpl::bf16>();
  CHECK(dpl::bf16(1.0f + 0x1p-8f).bits == 0x3f80);    // tie: to even
  CHECK(dpl::bf16(1.0f + 0x1.8p-7f).bits == 0x3f82);  // tie between 0x3f81 and 0x3f82: even
  CHECK(dpl::bf16(std::numeric_limits<float>::max()).bits == 0x7f80);
  CHECK(dpl::bf16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);  // below half of bf16's smallest
  CHECK(dpl::bf16(-std::numeric_limits<float>::infinity()).bits == 0xff80);
  CHECK(dpl::bf16(std::numeric_limits<float>::signaling_NaN()).bits == 0x7fff);
}

TEST_CASE("f16 and bf16 are 2-byte dtypes f16 and bf16, usable at compile time", "[half]") {
  STATIC_REQUIRE(dpl::dtype_v<dpl::f16> == dpl::dtype::f16);
  STATIC_REQUIRE(dpl::dtype_v<dpl::bf16> == dpl::dtype::bf16);
  STATIC_REQUIRE(dpl::size_of(dpl::dtype::f16) == sizeof(dpl::f16));
  STATIC_REQUIRE(static_cast<float>(dpl::bf16(3.0f)) == 3.0f);
  STATIC_REQUIRE(dpl::f16(1.0f).bits == 0x3c00);
}

// The table of the CUDA backend's batched weighted-sum launch (backend/detail/sum_batch.hpp), on
// the host: the kernel's walk over the table's units (locate_unit, packs then single elements)
// is emulated here with the same indexing, and must write every element of every sum exactly
// once, with the same value as an unbatched sum of that entry.

#include <dparallel/backend/detail/sum_batch.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstring>
#include <vector>

namespace {

using dparallel::detail::locate_unit;
using batch2 = dparallel::detail::sum_batch<float, float, 2>;

// The kernel's body for one unit, on the host: the same entry lookup and pack/element split.
// Returns how many elements it wrote into `writes` (indexed like the destination buffer).
void run_unit(batch2 const& b, std::size_t u, float const* base, std::vector<int>& writes) {
  unsigned const e = locate_unit(b.start, b.count, u);
  std::size_t const local = u - b.start[e];
  auto const one = [&](std::size_t i) {
    b.dst[e][i] = b.w[0] * b.src[e][0][i] + b.w[1] * b.src[e][1][i];
    ++writes[static_cast<std::size_t>(&b.dst[e][i] - base)];
  };
  if (local < b.packs[e]) {
    for (std::size_t v = 0; v < batch2::pack; ++v) one(local * batch2::pack + v);
  } else {
    one(b.packs[e] * batch2::pack + (local - b.packs[e]));
  }
}

}  // namespace

TEST_CASE("sum_batch: locate_unit finds the entry owning each unit, skipping empty entries", "[sum_batch]") {
  std::size_t const start[] = {0, 3, 3, 4, 10, 10, 11};  // entries 1 and 4 own no unit
  unsigned const count = 6;
  for (std::size_t u = 0; u < start[count]; ++u) {
    unsigned const e = locate_unit(start, count, u);
    CHECK(start[e] <= u);
    CHECK(u < start[e + 1]);
  }
  CHECK(locate_unit(start, count, 3) == 2);
  CHECK(locate_unit(start, count, 10) == 5);
}

TEST_CASE("sum_batch: aligned entries are packs then a tail, misaligned ones single elements", "[sum_batch]") {
  alignas(16) static float buf[64] = {};
  float const w[2] = {0.25f, 0.75f};
  batch2 b{};
  b.reset(w);
  float const* aligned[2] = {buf + 16, buf + 32};
  float const* misaligned[2] = {buf + 17, buf + 32};
  REQUIRE(b.add(buf, aligned, 10));       // 2 packs of 4, then 2 elements
  REQUIRE(b.add(buf + 48, misaligned, 5));  // one source misaligned: 5 elements
  CHECK(b.packs[0] == 2);
  CHECK(b.packs[1] == 0);
  CHECK(b.start[1] == 4);
  CHECK(b.units() == 9);
  CHECK(b.w[0] == 0.25f);
  CHECK(b.w[1] == 0.75f);
}

TEST_CASE("sum_batch: the kernel's walk writes every element once, as the unbatched sum", "[sum_batch]") {
  // Destinations and sources of various lengths and alignments in one buffer (no overlaps).
  std::vector<std::size_t> const lengths = {1, 4, 7, 16, 0, 33, 3, 64, 5};
  std::vector<std::size_t> const skew = {0, 1, 0, 2, 0, 3, 0, 0, 1};  // floats off 16-byte alignment
  std::size_t const slot = 80;  // floats per region, 16-byte aligned
  alignas(16) static float buf[9 * 3 * 80];
  for (std::size_t i = 0; i < sizeof buf / sizeof buf[0]; ++i) buf[i] = 0.1f * static_cast<float>(i % 97) - 3.f;
  float const w[2] = {0.3f, 1.7f};
  batch2 b{};
  b.reset(w);
  std::vector<float> expect(sizeof buf / sizeof buf[0]);
  std::memcpy(expect.data(), buf, sizeof buf);
  for (std::size_t j = 0; j < lengths.size(); ++j) {
    float* d = buf + (3 * j) * slot + skew[j];
    float const* s[2] = {buf + (3 * j + 1) * slot, buf + (3 * j + 2) * slot + (j % 2)};
    for (std::size_t i = 0; i < lengths[j]; ++i)
      expect[static_cast<std::size_t>(d - buf) + i] = w[0] * s[0][i] + w[1] * s[1][i];
    REQUIRE(b.add(d, s, lengths[j]));
  }
  std::vector<int> writes(expect.size(), 0);
  for (std::size_t u = 0; u < b.units(); ++u) run_unit(b, u, buf, writes);
  std::size_t written = 0;
  for (std::size_t i = 0; i < expect.size(); ++i) {
    CHECK(writes[i] <= 1);
    written += static_cast<std::size_t>(writes[i]);
    if (buf[i] != expect[i]) FAIL_CHECK("element " << i << ": " << buf[i] << " != " << expect[i]);
  }
  std::size_t total = 0;
  for (auto n : lengths) total += n;
  CHECK(written == total);
}

TEST_CASE("sum_batch: a full table refuses an entry and is unchanged", "[sum_batch]") {
  alignas(16) static float buf[8] = {};
  float const w[2] = {1.f, 1.f};
  float const* s[2] = {buf, buf + 4};
  batch2 b{};
  b.reset(w);
  for (unsigned e = 0; e < batch2::capacity; ++e) REQUIRE(b.add(buf, s, 4));
  std::size_t const units = b.units();
  CHECK_FALSE(b.add(buf, s, 4));
  CHECK(b.count == batch2::capacity);
  CHECK(b.units() == units);
  b.reset(w);
  CHECK(b.units() == 0);
  CHECK(b.add(buf, s, 4));
  CHECK(sizeof(batch2) <= 4096);  // within the parameter block every architecture accepts
  CHECK(sizeof(dparallel::detail::sum_batch<double, double, 8>) <= 4096);
}

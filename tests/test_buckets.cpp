// The bucket planner's caps: the first bucket of a dtype closes at first_cap_bytes, later ones at
// cap_bytes (sizes chosen so that the two caps give different buckets, and so that either cap
// used for both gives another answer).
#include <dparallel/core/buckets.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <vector>

namespace dpl = dparallel;

TEST_CASE("buckets: the first bucket closes at the first cap, later ones at the cap", "[core][buckets]") {
  using dpl::dtype;
  // Four parameters of 100 f32 (400 bytes each) in reverse order; first cap 400 bytes, cap 1000.
  auto const b = dpl::plan_buckets({100, 100, 100, 100}, {dtype::f32, dtype::f32, dtype::f32, dtype::f32},
                                   dpl::reverse_order(4), 400, 1000);
  // With the first cap the first bucket is {3}; with 1000 for both it would be {3, 2, 1} (then
  // {0}); with 400 for both every parameter would get its own bucket.
  std::vector<dpl::bucket_spec> const want = {{dtype::f32, {3}, {0}, 100}, {dtype::f32, {2, 1, 0}, {0, 100, 200}, 300}};
  CHECK(b == want);
  // Swapping the caps gives the other plan: the first bucket takes three parameters.
  auto const swapped = dpl::plan_buckets({100, 100, 100, 100}, {dtype::f32, dtype::f32, dtype::f32, dtype::f32},
                                         dpl::reverse_order(4), 1000, 400);
  std::vector<dpl::bucket_spec> const want_swapped = {{dtype::f32, {3, 2, 1}, {0, 100, 200}, 300},
                                                      {dtype::f32, {0}, {0}, 100}};
  CHECK(swapped == want_swapped);
}

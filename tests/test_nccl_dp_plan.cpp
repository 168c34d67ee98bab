// nccl::dp's reduce plan on the host (comm/nccl/detail/dp_plan.hpp): which weights NCCL's
// pre-multiplying sum gets and in which dtype it reduces; the per-dtype buckets the gradients are
// flattened into, and when a bucket is the gradients' own memory.
#include <dparallel/comm/nccl/detail/dp_plan.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <vector>

namespace dpl = dparallel;

namespace {
double sum_of(std::vector<double> const& w) {
  double s = 0;
  for (double x : w) s += x;
  return s;
}
// Within F32 rounding of 1: each of the m weights rounded once to F32 (half an ulp of a value
// below 1, 2^-25, each).
bool sums_to_one(std::vector<double> const& w) { return std::abs(sum_of(w) - 1.0) <= static_cast<double>(w.size()) * 0x1p-25; }
}  // namespace

TEST_CASE("nccl::dp weights: 16-bit gradients whose weights 16 bits cannot hold reduce in F32", "[nccl][dp][plan]") {
  using dpl::dtype;
  std::vector<std::size_t> const thirds{1, 1, 1};
  for (dtype t : {dtype::bf16, dtype::f16}) {
    CAPTURE(dpl::name_of(t));
    auto const p = dpl::detail::choose_premul(t, thirds);
    CHECK(p.reduce_in == dtype::f32);
    CHECK(sums_to_one(p.weights));
    for (double w : p.weights) CHECK(w == static_cast<double>(static_cast<float>(1.0 / 3.0)));
    // What giving them to NCCL in 16 bits would do: bf16(1/3) three times is 1.00195.
    double const rounded = dpl::detail::round_to(1.0 / 3.0, t);
    CHECK_FALSE(sums_to_one({rounded, rounded, rounded}));
  }
  CHECK(3 * dpl::detail::round_to(1.0 / 3.0, dtype::bf16) == Approx(1.00195).epsilon(1e-5));
}

TEST_CASE("nccl::dp weights: exact 16-bit weights and F32/F64 gradients reduce in their own dtype",
          "[nccl][dp][plan]") {
  using dpl::dtype;
  struct layout {
    std::vector<std::size_t> sizes;
  };
  // Halves, quarters and eighths are exact in 16 bits; 0 is a device without a shard.
  for (auto const& l : {layout{{1, 1}}, layout{{3, 3, 2}}, layout{{4, 0, 4, 0}}, layout{{16, 16, 16, 16}}}) {
    for (dtype t : {dtype::bf16, dtype::f16, dtype::f32, dtype::f64}) {
      auto const p = dpl::detail::choose_premul(t, l.sizes);
      CHECK(p.reduce_in == t);
      CHECK(sum_of(p.weights) == 1.0);  // every weight exact, and so is their sum
      for (std::size_t i = 0; i < l.sizes.size(); ++i)
        if (l.sizes[i] == 0) CHECK(p.weights[i] == 0.0);
    }
  }
  for (auto const& l : {layout{{1, 1, 1}}, layout{{5, 3, 2}}, layout{{7, 0, 11, 13}}}) {
    auto const f32 = dpl::detail::choose_premul(dtype::f32, l.sizes);
    CHECK(f32.reduce_in == dtype::f32);
    CHECK(sums_to_one(f32.weights));
    auto const f64 = dpl::detail::choose_premul(dtype::f64, l.sizes);
    CHECK(f64.reduce_in == dtype::f64);
    CHECK(std::abs(sum_of(f64.weights) - 1.0) <= 4 * 0x1p-53);
    for (dtype t : {dtype::bf16, dtype::f16}) {
      auto const p = dpl::detail::choose_premul(t, l.sizes);
      CHECK(p.reduce_in == dtype::f32);
      CHECK(sums_to_one(p.weights));
    }
  }
}

TEST_CASE("nccl::dp buckets: one per dtype, members in order, in place only when contiguous and unconverted",
          "[nccl][dp][plan]") {
  using dpl::dtype;
  // One flat f32 array holding three gradients back to back, a separate f32 gradient, an empty one
  // and two bf16 gradients back to back.
  std::vector<float> flat(10), apart(4), none;
  std::vector<dpl::bf16> halves(6);
  std::vector<dpl::tensor_ref> grads{
      dpl::tensor_ref(flat.data(), 3, dtype::f32, dpl::host_memory),
      dpl::tensor_ref(halves.data(), 2, dtype::bf16, dpl::host_memory),
      dpl::tensor_ref(flat.data() + 3, 5, dtype::f32, dpl::host_memory),
      dpl::tensor_ref(none.data(), 0, dtype::f32, dpl::host_memory),
      dpl::tensor_ref(flat.data() + 8, 2, dtype::f32, dpl::host_memory),
      dpl::tensor_ref(halves.data() + 2, 4, dtype::bf16, dpl::host_memory),
  };
  std::vector<std::size_t> const exact{2, 2}, thirds{1, 1, 1};
  auto const b = dpl::detail::plan_flat_buckets(grads, exact);
  REQUIRE(b.size() == 2);
  CHECK(b[0].grads == dtype::f32);
  CHECK(b[0].members == std::vector<std::size_t>{0, 2, 4});
  CHECK(b[0].offsets == std::vector<std::size_t>{0, 3, 8});
  CHECK(b[0].elements == 10);
  CHECK(b[1].grads == dtype::bf16);
  CHECK(b[1].reduce_in == dtype::bf16);
  CHECK(b[1].members == std::vector<std::size_t>{1, 5});
  CHECK(b[1].elements == 6);
  CHECK(dpl::detail::bucket_in_place(b[0], grads));
  CHECK(dpl::detail::bucket_in_place(b[1], grads));
  // The bf16 bucket reduces in F32 when the weights need it: never in place.
  auto const t = dpl::detail::plan_flat_buckets(grads, thirds);
  CHECK(t[1].reduce_in == dtype::f32);
  CHECK_FALSE(dpl::detail::bucket_in_place(t[1], grads));
  // Gradients apart in memory (or out of order) are packed.
  grads[2] = dpl::tensor_ref(apart.data(), 4, dtype::f32, dpl::host_memory);
  grads[4] = dpl::tensor_ref(flat.data() + 3, 2, dtype::f32, dpl::host_memory);
  auto const apart_plan = dpl::detail::plan_flat_buckets(grads, exact);
  CHECK(apart_plan[0].offsets == std::vector<std::size_t>{0, 3, 7});
  CHECK_FALSE(dpl::detail::bucket_in_place(apart_plan[0], grads));
}

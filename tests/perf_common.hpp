#pragma once
// What the performance-contract tests (test_perf_contracts, test_perf_allocations) share: one
// rank's slice of a dataset, and bucket caps small enough to give the flat test model several
// buckets.

#include "models.hpp"

#include <dparallel/core/options.hpp>
#include <dparallel/core/batch.hpp>

#include <cstddef>

namespace test {

/// Rank `rank`'s `b` samples of `d`, in rank order.
inline samples<float> rank_slice(dataset<float> const& d, int rank, std::size_t b) {
  return dparallel::slice_batch(d.all(), static_cast<std::size_t>(rank) * b, static_cast<std::size_t>(rank + 1) * b);
}

/// Buckets of 24 bytes, the first of 8: flat_model's gradients fill several.
inline dparallel::options tiny_buckets() {
  return {.bucket_cap_mb = 24.0 / (1024 * 1024), .first_bucket_cap_mb = 8.0 / (1024 * 1024)};
}

}  // namespace test

#pragma once
// What the MPI suites (test_mpi, test_mpi_ddp) share to check that every rank holds the same
// thing: a hash of bytes and every rank's value of one number.
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace test {

/// FNV-1a of bytes.
inline std::uint64_t hash_bytes(std::span<std::byte const> b, std::uint64_t h = 1469598103934665603ull) {
  for (std::byte x : b) h = (h ^ static_cast<std::uint64_t>(x)) * 1099511628211ull;
  return h;
}

/// Every rank's value of `mine`, through the group.
inline std::vector<std::int64_t> gather_all(dparallel::process_group const& g, std::int64_t mine) {
  std::vector<std::int64_t> one{mine};
  std::vector<std::int64_t> all(static_cast<std::size_t>(g.size()));
  g.all_gather(dparallel::view(all), dparallel::view(one)).wait();
  return all;
}

}  // namespace test

#pragma once
// What the host communicator's tests (test_comm_host, test_comm_host_failures) share: an
// exception in a form REQUIRE can look at, deterministic inputs whose sums depend on the order
// they are added in, and the serial rank-order reference they are summed against.

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

namespace test {

/// What an exception_ptr holds, in a form REQUIRE can look at.
struct caught {
  bool thrown = false;
  bool comm = false;     // a dparallel::comm_error
  bool timeout = false;  // a dparallel::timeout_error
  bool invalid = false;  // a dparallel::invalid_argument
  int rank = -1;         // comm_error::rank()
  std::string what;
};

inline caught inspect(std::exception_ptr const& e) {
  caught c;
  if (!e) return c;
  c.thrown = true;
  try {
    std::rethrow_exception(e);
  } catch (dparallel::timeout_error const& ex) {
    c.comm = c.timeout = true;
    c.rank = ex.rank();
    c.what = ex.what();
  } catch (dparallel::comm_error const& ex) {
    c.comm = true;
    c.rank = ex.rank();
    c.what = ex.what();
  } catch (dparallel::invalid_argument const& ex) {
    c.invalid = true;
    c.what = ex.what();
  } catch (std::exception const& ex) {
    c.what = ex.what();
  }
  return c;
}

inline caught inspect_wait(dparallel::work const& w) { return inspect(w.wait_nothrow()); }

inline bool contains(std::string const& s, std::string const& part) { return s.find(part) != std::string::npos; }

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
                             dparallel::reduce_op op) {
  std::vector<T> out(srcs[0]->begin() + static_cast<std::ptrdiff_t>(first),
                     srcs[0]->begin() + static_cast<std::ptrdiff_t>(first + count));
  for (std::size_t k = 1; k < srcs.size(); ++k) {
    for (std::size_t i = 0; i < count; ++i) out[i] += (*srcs[k])[first + i];
  }
  if (op == dparallel::reduce_op::avg) {
    T const scale = T(1) / static_cast<T>(srcs.size());
    for (auto& x : out) x *= scale;
  }
  return out;
}

}  // namespace test

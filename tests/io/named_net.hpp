#pragma once
// What the state-dict tests (test_io) and the file tests (test_io_files) share: a model with
// named, shaped tensors of every host dtype, and the bytes of files and of state dicts.
#include "models.hpp"

#include <dparallel/core/tensor_view.hpp>
#include <dparallel/io/state_dict.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <string>
#include <vector>

namespace test {

/// A model with named, shaped tensors of every host dtype: f32 and f64 parameters; i64, u8,
/// f16 (raw bits) and i32 buffers.
struct named_net {
  std::vector<float> w = std::vector<float>(12), b = std::vector<float>(3);
  std::vector<double> scale = std::vector<double>(2);
  std::vector<float> gw = std::vector<float>(12), gb = std::vector<float>(3);
  std::vector<double> gscale = std::vector<double>(2);
  std::vector<std::int64_t> steps = std::vector<std::int64_t>(1);
  std::vector<std::uint8_t> mask = std::vector<std::uint8_t>(5);
  std::vector<std::uint16_t> half = std::vector<std::uint16_t>(4);
  std::vector<std::int32_t> ids = std::vector<std::int32_t>(3);

  std::vector<dparallel::tensor_ref> parameters() {
    return {dparallel::view(w), dparallel::view(b), dparallel::view(scale)};
  }
  std::vector<dparallel::tensor_ref> gradients() {
    return {dparallel::view(gw), dparallel::view(gb), dparallel::view(gscale)};
  }
  std::vector<dparallel::tensor_ref> buffers() {
    return {dparallel::view(steps), dparallel::view(mask),
            dparallel::tensor_ref(half.data(), half.size(), dparallel::dtype::f16), dparallel::view(ids)};
  }
  static auto parameter_names() { return std::array{"encoder.fc.weight", "encoder.fc.bias", "scale"}; }
  static auto buffer_names() { return std::array{"steps", "mask", "half", "ids"}; }
  static auto parameter_shapes() { return std::vector<std::vector<int>>{{3, 4}, {3}, {2}}; }

  /// Distinct contents per seed, with bit patterns a value copy could lose (-0, NaN payloads, inf).
  void fill(std::uint64_t seed) {
    rng g{seed};
    for (auto& v : w) v = static_cast<float>(g.uniform() * 4 - 2);
    for (auto& v : b) v = static_cast<float>(g.uniform());
    scale = {g.uniform(), -0.0};
    std::uint32_t nan_bits = 0x7FC01234u + static_cast<std::uint32_t>(seed);
    std::memcpy(&w[5], &nan_bits, 4);
    w[6] = -std::numeric_limits<float>::infinity();
    b[1] = -0.0f;
    steps[0] = static_cast<std::int64_t>(g.next() >> 1);
    for (auto& v : mask) v = static_cast<std::uint8_t>(g.next());
    for (auto& v : half) v = static_cast<std::uint16_t>(g.next());
    for (auto& v : ids) v = static_cast<std::int32_t>(g.next());
  }
};

/// The whole file at `p`.
inline std::vector<char> bytes_of(std::filesystem::path const& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Replaces the file at `p` with `bytes`.
inline void write_bytes(std::filesystem::path const& p, std::vector<char> const& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The names in `dir`.
inline std::set<std::string> listing(std::filesystem::path const& dir) {
  std::set<std::string> out;
  for (auto const& e : std::filesystem::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

/// The bytes of every tensor of a model's state dict, in order.
template <class M>
std::vector<std::vector<char>> tensor_bytes(M& m) {
  std::vector<std::vector<char>> out;
  for (auto const& t : dparallel::state_dict(m)) {
    auto const* p = static_cast<char const*>(t.data.data());
    out.emplace_back(p, p + t.data.size_bytes());
  }
  return out;
}

}  // namespace test

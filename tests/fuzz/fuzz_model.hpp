#pragma once
// The model the fuzz target loads into, and that the seed corpus was saved from
// (tests/fuzz/make_corpus.cpp): f32 and f64 parameters, i64 and u8 buffers, shaped.
#include <dparallel/core/tensor_view.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fuzz {

struct model {
  static constexpr std::size_t size = 6;
  std::vector<float> w = std::vector<float>(size), gw = std::vector<float>(size);
  std::vector<double> s = std::vector<double>(2), gs = std::vector<double>(2);
  std::vector<std::int64_t> steps = std::vector<std::int64_t>(1);
  std::vector<std::uint8_t> mask = std::vector<std::uint8_t>(3);

  auto parameters() { return std::array{dparallel::tensor_ref(dparallel::view(w)), dparallel::tensor_ref(dparallel::view(s))}; }
  auto gradients() { return std::array{dparallel::tensor_ref(dparallel::view(gw)), dparallel::tensor_ref(dparallel::view(gs))}; }
  auto buffers() { return std::array{dparallel::tensor_ref(dparallel::view(steps)), dparallel::tensor_ref(dparallel::view(mask))}; }
  static auto parameter_names() { return std::array{"fc.weight", "scale"}; }
  static auto buffer_names() { return std::array{"steps", "mask"}; }
  static auto parameter_shapes() { return std::vector<std::vector<int>>{{2, 3}, {2}}; }

  void fill(int seed) {
    for (std::size_t i = 0; i < size; ++i) w[i] = static_cast<float>(seed) * 0.5f + static_cast<float>(i);
    s = {static_cast<double>(seed), -1.0};
    steps[0] = seed * 100;
    for (std::size_t i = 0; i < mask.size(); ++i) mask[i] = static_cast<std::uint8_t>(seed + static_cast<int>(i));
  }
  friend bool operator==(model const& a, model const& b) {
    return a.w == b.w && a.s == b.s && a.steps == b.steps && a.mask == b.mask;
  }
};

}  // namespace fuzz

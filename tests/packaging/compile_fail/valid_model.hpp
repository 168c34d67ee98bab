#pragma once
// A model dparallel accepts, shared by the compile-failure TUs so that the only thing wrong in
// each of them is the one thing it is about.
#include <dparallel/dparallel.hpp>

#include <array>
#include <vector>

namespace compile_fail {

struct scalar_model {
  std::vector<float> w{1.0F}, gw{0.0F};
  auto parameters() { return std::array{dparallel::view(w)}; }
  auto gradients() { return std::array{dparallel::view(gw)}; }
};

}  // namespace compile_fail

// Must NOT compile: the shard parameter is a non-const lvalue reference, which cannot bind the
// rvalue slice the wrapper passes. Expected: the message saying the shard arrives as an rvalue.
#include "valid_model.hpp"

#include <span>
#include <vector>

int main() {
  compile_fail::scalar_model model;
  dparallel::data_parallel<compile_fail::scalar_model> dp(model, dparallel::host::devices(2));
  std::vector<float> batch{1.0F, 2.0F};
  dp.step(batch, [](compile_fail::scalar_model& m, std::span<float const>& shard) { m.gw[0] = shard[0]; });
  return 0;
}

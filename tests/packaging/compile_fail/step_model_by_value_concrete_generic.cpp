// Must NOT compile: a step function that names the model type but takes it by value,
// with a generic shard: it trains a copy.
// Expected: dparallel::detail::check_step_function()'s message saying to take Model&.
#include "valid_model.hpp"

#include <vector>

int main() {
  compile_fail::scalar_model model;
  dparallel::data_parallel<compile_fail::scalar_model> dp(model, dparallel::host::devices(2));
  std::vector<float> batch{1.0F, 2.0F};
  dp.step(batch, [](compile_fail::scalar_model m, auto shard) { m.gw[0] = shard[0]; });
  return 0;
}

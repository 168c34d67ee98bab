// Must NOT compile: a generic step function that takes the model by const&: it cannot write
// the gradients that the wrapper reduces.
// Expected: dparallel::detail::check_step_function()'s message saying to take Model&.
#include "valid_model.hpp"

#include <vector>

int main() {
  compile_fail::scalar_model model;
  dparallel::data_parallel<compile_fail::scalar_model> dp(model, dparallel::host::devices(2));
  std::vector<float> batch{1.0F, 2.0F};
  dp.step(batch, [](auto const& m, auto shard) { (void)m; (void)shard; });
  return 0;
}

// Must NOT compile: a fully generic step function with a context whose model parameter is
// `auto` (by value).
// Expected: dparallel::detail::check_step_function()'s message saying to take Model&.
#include "valid_model.hpp"

#include <vector>

int main() {
  compile_fail::scalar_model model;
  dparallel::data_parallel<compile_fail::scalar_model> dp(model, dparallel::host::devices(2));
  std::vector<float> batch{1.0F, 2.0F};
  dp.step(batch, [](auto m, auto shard, auto& ctx) { m.gw[0] = shard[0] + static_cast<float>(ctx.shard_offset()); });
  return 0;
}

// Must NOT compile: std::map has no batch_traits (it cannot be sliced on a first dimension).
// Expected: the static_assert of dparallel::check_batch() naming batch_traits.
#include "valid_model.hpp"

#include <map>

int main() {
  compile_fail::scalar_model model;
  dparallel::data_parallel<compile_fail::scalar_model> dp(model, dparallel::host::devices(2));
  std::map<int, float> batch{{0, 1.0F}, {1, 2.0F}};
  dp.step(batch, [](compile_fail::scalar_model&, auto, dparallel::step_context&) {});
  return 0;
}

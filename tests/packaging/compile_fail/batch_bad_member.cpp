// Must NOT compile: a batch struct whose second member (a std::map) is not a batch. Expected: one
// message naming the member (batch_member_is_not_a_batch<..., 1, std::map<...>>), and no cascade.
#include "valid_model.hpp"

#include <map>

struct bad_batch {
  dparallel::tensor_view<float const> x;
  std::map<int, float> extra;
};

int main() {
  compile_fail::scalar_model model;
  dparallel::data_parallel<compile_fail::scalar_model> dp(model, dparallel::host::devices(2));
  float xs[2] = {1.0F, 2.0F};
  bad_batch batch{dparallel::tensor_view<float const>(xs, 2), {}};
  dp.step(batch, [](compile_fail::scalar_model&, auto) {});
  return 0;
}

// Must NOT compile: a struct with a private member is not an aggregate, so it is not one of the
// batch shapes dparallel knows, and it has no batch_traits specialisation.
// Expected: the static_assert of dparallel::check_batch() naming batch_traits.
#include "valid_model.hpp"

#include <utility>
#include <vector>

class opaque_batch {
 public:
  explicit opaque_batch(std::vector<float> x) : x_(std::move(x)) {}

 private:
  std::vector<float> x_;
};

int main() {
  compile_fail::scalar_model model;
  dparallel::data_parallel<compile_fail::scalar_model> dp(model, dparallel::host::devices(2));
  opaque_batch batch(std::vector<float>{1.0F, 2.0F});
  dp.step(batch, [](compile_fail::scalar_model&, auto, dparallel::step_context&) {});
  return 0;
}

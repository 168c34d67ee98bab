// Must NOT compile: a model type with parameters() but no gradients().
// Expected: the static_assert of dparallel::check_model() naming the missing gradients.
#include <dparallel/dparallel.hpp>

#include <array>
#include <vector>

struct half_model {
  std::vector<float> w{1.0F};
  auto parameters() { return std::array{dparallel::view(w)}; }
};

int main() {
  half_model model;
  dparallel::data_parallel<half_model> dp(model, dparallel::host::devices(2));
  return 0;
}

// Must NOT compile: parameters() returns two views and gradients() one, both std::arrays, so the
// mismatch is known at compile time. Expected: check_model()'s message on the lengths.
#include <dparallel/dparallel.hpp>

#include <array>
#include <vector>

struct short_gradients_model {
  std::vector<float> w{1.0F}, b{0.0F}, gw{0.0F};
  auto parameters() { return std::array{dparallel::view(w), dparallel::view(b)}; }
  auto gradients() { return std::array{dparallel::view(gw)}; }
};

int main() {
  short_gradients_model model;
  dparallel::data_parallel<short_gradients_model> dp(model, dparallel::host::devices(2));
  return 0;
}

// Must NOT compile: parameters() exists but returns std::array<std::vector<float>, 1> (the members
// themselves, not views of them). Expected: the message naming parameters() and dparallel::view.
#include <dparallel/dparallel.hpp>

#include <array>
#include <vector>

struct unwrapped_model {
  std::vector<float> w{1.0F}, gw{0.0F};
  auto parameters() { return std::array{w}; }
  auto gradients() { return std::array{dparallel::view(gw)}; }
};

int main() {
  unwrapped_model model;
  dparallel::data_parallel<unwrapped_model> dp(model, dparallel::host::devices(2));
  return 0;
}

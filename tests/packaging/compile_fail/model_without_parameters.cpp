// Must NOT compile: a model type with neither parameters() nor gradients(), and no
// dparallel::model_traits specialisation.
// Expected: the static_assert of dparallel::check_model() naming the missing parameters.
#include <dparallel/dparallel.hpp>

#include <vector>

struct bare_model {
  std::vector<float> w{1.0F}, gw{0.0F};
  float forward(float x) const { return w[0] * x; }
};

int main() {
  bare_model model;
  dparallel::data_parallel<bare_model> dp(model, dparallel::host::devices(2));
  return static_cast<int>(model.forward(0.0F));
}

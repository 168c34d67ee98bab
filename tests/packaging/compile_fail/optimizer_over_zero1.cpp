// Must NOT compile: optim::optimizer over a ddp_zero1 wrapper. Each rank keeps only its shard of
// the averaged gradients, so a whole-model optimizer would step with the rank's own, unaveraged
// ones. Expected: optim::optimizer's static_assert naming zero_redundancy_optimizer.
#include "valid_model.hpp"

#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/sgd.hpp>

int main() {
  compile_fail::scalar_model model;
  dparallel::process_group group;
  dparallel::parallel<compile_fail::scalar_model, dparallel::ddp_zero1> zero(model, group);
  dparallel::optim::optimizer<dparallel::optim::sgd> opt(zero);
  return 0;
}

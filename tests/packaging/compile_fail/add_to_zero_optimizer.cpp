// Must NOT compile: optim::add_to(ckpt, zero_opt, wrapper). A ZeRO-1 optimizer keeps only its
// rank's shard of the state, which a checkpoint of whole tensors cannot hold. Expected: add_to's
// static_assert naming optim::save_zero_state.
#include "valid_model.hpp"

#include <dparallel/io/checkpoint.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/optim/state.hpp>
#include <dparallel/optim/zero_checkpoint.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>

int main() {
  compile_fail::scalar_model model;
  dparallel::process_group group;
  using wrapper = dparallel::parallel<compile_fail::scalar_model, dparallel::ddp_zero1>;
  wrapper zero(model, group);
  dparallel::optim::zero_redundancy_optimizer<dparallel::optim::sgd, wrapper> opt(zero);
  dparallel::checkpoint ckpt(zero);
  dparallel::optim::add_to(ckpt, opt, zero);
  return 0;
}

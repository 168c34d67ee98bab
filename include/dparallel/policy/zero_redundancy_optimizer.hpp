#pragma once
// Moved: optim::zero_redundancy_optimizer is in <dparallel/optim/zero_redundancy_optimizer.hpp>.
#include <dparallel/optim/zero_redundancy_optimizer.hpp>

#pragma once
// Moved: the CUDA optimizer kernels are in <dparallel/optim/cuda/kernels.hpp>.
#include <dparallel/optim/cuda/kernels.hpp>

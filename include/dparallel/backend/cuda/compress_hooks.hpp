#pragma once
// Moved: the CUDA communication hooks are in <dparallel/policy/cuda/compress_hooks.hpp>.
#include <dparallel/policy/cuda/compress_hooks.hpp>

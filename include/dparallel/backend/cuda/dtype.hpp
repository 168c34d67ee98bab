#pragma once
// The CUDA half types as dparallel dtypes: __half is dtype::f16, __nv_bfloat16 is dtype::bf16.
// Reductions over them accumulate in float (backend/cuda/kernels.hpp).

#include <dparallel/config.hpp>
#include <dparallel/core/dtype.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

DPARALLEL_NAMESPACE_BEGIN

/// `__half` is dtype::f16.
template <>
struct dtype_of<__half> {
  /// The dtype tag of `__half`.
  static constexpr dtype value = dtype::f16;
};
/// `__nv_bfloat16` is dtype::bf16.
template <>
struct dtype_of<__nv_bfloat16> {
  /// The dtype tag of `__nv_bfloat16`.
  static constexpr dtype value = dtype::bf16;
};

DPARALLEL_NAMESPACE_END

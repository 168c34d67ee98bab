// The umbrella header must stay light: <dparallel/dparallel.hpp> is for everyone, so it may not
// pull in a CUDA, NCCL or MPI header (those come only with backend/cuda, comm/nccl, comm/mpi).
// Each check below looks for a guard or macro that the corresponding header always defines; the
// TU is compiled by the default build, so a violation breaks the build with the message below.
#include <dparallel/dparallel.hpp>

#include <vector>

// CUDA runtime / driver API, the fp16/bf16 types, and CCCL (Thrust, CUB, libcu++).
#if defined(__CUDA_RUNTIME_H__) || defined(__CUDA_RUNTIME_API_H__) || defined(CUDART_VERSION) || \
    defined(__cuda_cuda_h__) || defined(CUDA_VERSION) || defined(__DRIVER_TYPES_H__) ||            \
    defined(__CUDA_FP16_H__) || defined(__CUDA_BF16_H__)
#error "dparallel/dparallel.hpp included a CUDA header: keep CUDA code under dparallel/backend/cuda/"
#endif
#if defined(THRUST_VERSION) || defined(CUB_VERSION) || defined(CCCL_VERSION)
#error "dparallel/dparallel.hpp included a CCCL header (Thrust/CUB/libcu++): keep it under dparallel/backend/cuda/"
#endif
// NCCL.
#if defined(NCCL_H_) || defined(NCCL_MAJOR)
#error "dparallel/dparallel.hpp included <nccl.h>: keep NCCL code under dparallel/comm/nccl*"
#endif
// MPI: MPI_VERSION is required of every implementation; the others are Open MPI's and MPICH's
// include guards.
#if defined(MPI_VERSION) || defined(OMPI_MPI_H) || defined(MPI_INCLUDED) || defined(MPICH_VERSION)
#error "dparallel/dparallel.hpp included <mpi.h>: keep MPI code under dparallel/comm/mpi*"
#endif

// Uses something from the umbrella so the TU is not empty (-Wpedantic) and proves it is usable.
static_assert(dparallel::batch<std::vector<float>>);

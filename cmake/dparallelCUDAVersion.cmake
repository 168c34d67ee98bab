# The oldest CUDA toolkit dparallel's CUDA headers compile with, and its configure-time check
# (cmake/dparallelCUDA.cmake calls it; tests/packaging checks its messages with cmake -P).
# CUDA 12.5 brought cudaGetDriverEntryPointByVersion, which backend/cuda/error.hpp calls.
include_guard(GLOBAL)
set(DPARALLEL_CUDA_MINIMUM_VERSION 12.5)

# dparallel_check_cuda_version(<version> <nvcc directory> <DPARALLEL_CUDA> <result variable>):
# sets the result to TRUE when `version` is new enough; otherwise stops with an error when
# DPARALLEL_CUDA is ON, or warns that the add-ons are skipped (AUTO), and sets it to FALSE.
function(dparallel_check_cuda_version version where mode result)
  if(NOT version VERSION_LESS DPARALLEL_CUDA_MINIMUM_VERSION)
    set(${result} TRUE PARENT_SCOPE)
    return()
  endif()
  set(text "dparallel: the CUDA add-ons need CUDA ${DPARALLEL_CUDA_MINIMUM_VERSION} or newer (their headers call "
           "cudaGetDriverEntryPointByVersion), found CUDA ${version} (${where}). Point CMAKE_CUDA_COMPILER "
           "and CUDAToolkit_ROOT at a CUDA ${DPARALLEL_CUDA_MINIMUM_VERSION}+ toolkit")
  if(mode STREQUAL "ON")
    message(FATAL_ERROR ${text} ", or set DPARALLEL_CUDA=OFF.")
  endif()
  message(WARNING ${text} ": dparallel::cuda and dparallel::nccl are not defined.")
  set(${result} FALSE PARENT_SCOPE)
endfunction()

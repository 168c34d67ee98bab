# The libtorch add-on: the target dparallel::libtorch (dparallel + libtorch, for
# <dparallel/adapters/libtorch.hpp>) when find_package(Torch) finds libtorch (Debian: libtorch-dev;
# pip's torch: -DTorch_DIR=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')/Torch).
# Without it a status line says so once and nothing else changes. As a subproject nothing is
# probed (DPARALLEL_TORCH defaults to OFF there) and dparallel::libtorch links the project's own
# libtorch (below). Defines DPARALLEL_HAVE_TORCH
# (TRUE/FALSE) and, when libtorch has CUDA and the CUDA add-on exists, DPARALLEL_HAVE_TORCH_CUDA
# (the target then also links dparallel::cuda and defines DPARALLEL_LIBTORCH_CUDA).
#
# Included by the top-level CMakeLists.txt after the CUDA add-on, so that Torch's imported targets
# are visible to tests, examples and benchmarks.
include_guard(GLOBAL)

option(DPARALLEL_TORCH "Look for libtorch and define dparallel::libtorch (default: ON when top level)"
       ${PROJECT_IS_TOP_LEVEL})
set(DPARALLEL_HAVE_TORCH FALSE)
set(DPARALLEL_HAVE_TORCH_CUDA FALSE)

# Links dparallel_libtorch to libtorch's targets as the calling directory sees them.
function(_dparallel_link_torch)
  if(NOT TARGET torch)
    return()
  endif()
  target_link_libraries(dparallel_libtorch INTERFACE torch)
  if(TARGET dparallel_cuda AND (TARGET torch_cuda OR TARGET torch_cuda_library OR TARGET c10_cuda))
    target_link_libraries(dparallel_libtorch INTERFACE dparallel::cuda)
    target_compile_definitions(dparallel_libtorch INTERFACE DPARALLEL_LIBTORCH_CUDA=1)
  endif()
endfunction()

if(NOT DPARALLEL_TORCH)
  if(NOT PROJECT_IS_TOP_LEVEL)
    # A subproject (add_subdirectory, FetchContent) probes nothing, but the project's own
    # find_package(Torch), before or after this one, is enough for dparallel::libtorch: found
    # before, it is linked now; found after (in the top directory), at the end of the top
    # directory (a deferred call: names linked from there are looked up there). With a CUDA
    # libtorch and the CUDA add-on (DPARALLEL_CUDA=ON) the target also takes dparallel::cuda and
    # DPARALLEL_LIBTORCH_CUDA.
    add_library(dparallel_libtorch INTERFACE)
    add_library(dparallel::libtorch ALIAS dparallel_libtorch)
    target_link_libraries(dparallel_libtorch INTERFACE dparallel::dparallel)
    if(TARGET torch)
      _dparallel_link_torch()
    else()
      cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _dparallel_link_torch)
    endif()
    message(STATUS "dparallel: dparallel::libtorch defined for the project's own find_package(Torch) "
                   "(libtorch not probed: DPARALLEL_TORCH=OFF)")
    return()
  endif()
  message(STATUS "dparallel: libtorch adapter skipped: DPARALLEL_TORCH=OFF")
  return()
endif()

# PyTorch's CUDA configuration (Caffe2's public/cuda.cmake) changes the CUDA settings of the
# directory that finds it: it appends its own -gencode list (TORCH_CUDA_ARCH_LIST, by default
# architectures back to sm_50, which CUDA 13 no longer compiles) and flags to CMAKE_CUDA_FLAGS,
# turns CMAKE_CUDA_ARCHITECTURES off, and sets CMAKE_CUDA_STANDARD_REQUIRED ON, with which CMake
# 3.25 (it knows no nvcc option for C++20) fails to generate every target with cuda_std_20.
# dparallel's CUDA targets keep their own settings (the CUDA add-on passes -std=c++20 itself).
set(_dparallel_cuda_saved CMAKE_CUDA_FLAGS CMAKE_CUDA_ARCHITECTURES CMAKE_CUDA_STANDARD_REQUIRED)
foreach(v IN LISTS _dparallel_cuda_saved)
  set(_dparallel_saved_${v} "${${v}}")
endforeach()
find_package(Torch CONFIG QUIET)
foreach(v IN LISTS _dparallel_cuda_saved)
  set(${v} "${_dparallel_saved_${v}}")
endforeach()
if(NOT Torch_FOUND OR NOT TARGET torch)
  message(STATUS "dparallel: libtorch adapter skipped: find_package(Torch) found no libtorch (Debian: apt-get "
                 "install libtorch-dev; pip's torch: set Torch_DIR); dparallel::libtorch, its tests, "
                 "examples/train_torch and benchmarks/torch_adapter are not built")
  return()
endif()

# libtorch 1.x's headers do not compile as C++20 with clang and libstdc++ (ATen/core/List.h moves a
# std::vector<c10::IValue> while IValue is incomplete; clang 14 rejects it): skip rather than fail.
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang" AND Torch_VERSION VERSION_LESS 2.0)
  message(STATUS "dparallel: libtorch adapter skipped: libtorch ${Torch_VERSION}'s headers do not compile as C++20 "
                 "with clang (use GCC, or libtorch 2.x)")
  return()
endif()

add_library(dparallel_libtorch INTERFACE)
add_library(dparallel::libtorch ALIAS dparallel_libtorch)
set_target_properties(dparallel_libtorch PROPERTIES EXPORT_NAME libtorch)
target_link_libraries(dparallel_libtorch INTERFACE dparallel::dparallel torch)
if(DPARALLEL_HAVE_CUDA AND (TARGET torch_cuda OR TARGET torch_cuda_library OR TARGET c10_cuda))
  target_link_libraries(dparallel_libtorch INTERFACE dparallel::cuda)
  target_compile_definitions(dparallel_libtorch INTERFACE DPARALLEL_LIBTORCH_CUDA=1)
  set(DPARALLEL_HAVE_TORCH_CUDA TRUE)
endif()
set(DPARALLEL_HAVE_TORCH TRUE)
message(STATUS "dparallel: libtorch ${Torch_VERSION} found: dparallel::libtorch defined (CUDA: ${DPARALLEL_HAVE_TORCH_CUDA})")

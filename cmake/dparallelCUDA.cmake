# The CUDA and NCCL add-ons: the targets dparallel::cuda (CUDA backend: <dparallel/backend/cuda/...>,
# its communication hooks and optimizer kernels: <dparallel/policy/cuda/...>, <dparallel/optim/cuda/...>;
# CUDA runtime, CCCL's Thrust/CUB from the toolkit) and dparallel::nccl (<dparallel/comm/nccl.hpp>,
# + NCCL found by cmake/FindNCCL.cmake). Enabled automatically when a CUDA compiler and the toolkit
# are found (DPARALLEL_CUDA=AUTO), required with ON, skipped with OFF; dparallel::dparallel never
# needs them. Defines DPARALLEL_HAVE_CUDA / DPARALLEL_HAVE_NCCL (TRUE/FALSE).
#
# CMAKE_CUDA_ARCHITECTURES defaults to 75;80;86;89;90 (Turing to Hopper) when not set. The headers
# need CUDA 12.5 or newer (cudaGetDriverEntryPointByVersion): an older toolkit is an error with ON
# and a warning (add-ons skipped) with AUTO.
include_guard(GLOBAL)

# As a subproject (add_subdirectory, FetchContent) the default is AUTO when the consumer's project
# has enabled the CUDA language before adding dparallel (project(... LANGUAGES CXX CUDA) or
# enable_language(CUDA)), else OFF: a project without CUDA gets no CUDA language, no NCCL probe and
# no CMAKE_CUDA_ARCHITECTURES unless it sets DPARALLEL_CUDA.
get_property(_dparallel_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
if(PROJECT_IS_TOP_LEVEL OR "CUDA" IN_LIST _dparallel_languages)
  set(_dparallel_cuda_default AUTO)
else()
  set(_dparallel_cuda_default OFF)
endif()
set(DPARALLEL_CUDA ${_dparallel_cuda_default} CACHE STRING
    "Build the CUDA/NCCL add-ons: AUTO (when found), ON (required), OFF (default as a subproject of a project without CUDA)")
set_property(CACHE DPARALLEL_CUDA PROPERTY STRINGS AUTO ON OFF)
set(DPARALLEL_HAVE_CUDA FALSE)
set(DPARALLEL_HAVE_NCCL FALSE)

# Something the add-ons need is missing (`what`, and `hint` for ON): an error with ON, else a
# status line, and the rest of this file is skipped (return() in a macro leaves the caller's scope).
macro(_dparallel_cuda_missing what hint)
  if(DPARALLEL_CUDA STREQUAL "ON")
    message(FATAL_ERROR "dparallel: DPARALLEL_CUDA=ON but ${what} was not found${hint}")
  endif()
  message(STATUS "dparallel: ${what} was not found: the CUDA and NCCL add-ons are skipped")
  return()
endmacro()

if(DPARALLEL_CUDA STREQUAL "OFF")
  message(STATUS "dparallel: DPARALLEL_CUDA=OFF: the CUDA and NCCL add-ons are skipped")
  return()
endif()

# nvcc is often not on PATH: look where the toolkit installs it.
if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  find_program(_dparallel_nvcc nvcc HINTS ENV CUDA_PATH ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES bin)
  if(_dparallel_nvcc)
    set(CMAKE_CUDA_COMPILER "${_dparallel_nvcc}" CACHE FILEPATH "CUDA compiler")
  endif()
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  _dparallel_cuda_missing("a CUDA compiler" " (set CMAKE_CUDA_COMPILER)")
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 75 80 86 89 90)
endif()
enable_language(CUDA)
find_package(CUDAToolkit)
if(NOT CUDAToolkit_FOUND)
  _dparallel_cuda_missing("the CUDA toolkit" "")
endif()
include("${CMAKE_CURRENT_LIST_DIR}/dparallelCUDAVersion.cmake")
dparallel_check_cuda_version("${CUDAToolkit_VERSION}" "${CUDAToolkit_BIN_DIR}" "${DPARALLEL_CUDA}" _dparallel_cuda_ok)
if(NOT _dparallel_cuda_ok)
  return()
endif()

add_library(dparallel_cuda INTERFACE)
add_library(dparallel::cuda ALIAS dparallel_cuda)
set_target_properties(dparallel_cuda PROPERTIES EXPORT_NAME cuda)
target_link_libraries(dparallel_cuda INTERFACE dparallel::dparallel CUDA::cudart)
# C++20 for nvcc by flag: CMake 3.25's feature tables do not know CUDA 13's nvcc.
target_compile_options(dparallel_cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
# CCCL 3 (Thrust, CUB, libcu++) ships with the toolkit under include/cccl; nvcc finds it on its own,
# the host compiler needs the path for translation units that include the backend's host parts.
if(EXISTS "${CUDAToolkit_INCLUDE_DIRS}/cccl")
  target_include_directories(dparallel_cuda SYSTEM INTERFACE "${CUDAToolkit_INCLUDE_DIRS}/cccl")
endif()
set(DPARALLEL_HAVE_CUDA TRUE)
message(STATUS "dparallel: CUDA ${CUDAToolkit_VERSION} found (architectures ${CMAKE_CUDA_ARCHITECTURES}): "
               "target dparallel::cuda")

list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
find_package(NCCL QUIET)
if(NCCL_FOUND)
  add_library(dparallel_nccl INTERFACE)
  add_library(dparallel::nccl ALIAS dparallel_nccl)
  set_target_properties(dparallel_nccl PROPERTIES EXPORT_NAME nccl)
  target_link_libraries(dparallel_nccl INTERFACE dparallel::cuda NCCL::NCCL)
  set(DPARALLEL_HAVE_NCCL TRUE)
  message(STATUS "dparallel: NCCL ${NCCL_VERSION} found: target dparallel::nccl")
else()
  message(STATUS "dparallel: NCCL not found: dparallel::nccl is skipped (set NCCL_ROOT)")
endif()

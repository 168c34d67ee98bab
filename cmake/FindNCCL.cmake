# FindNCCL: the NCCL library and header.
#
# Looks, in this order, in:
#   NCCL_ROOT (CMake or environment variable), $ENV{NCCL_HOME}, NCCL_LIBRARY_HINT / NCCL_INCLUDE_HINT
#   (folders, CMake or environment variables);
#   the Python wheel nvidia-nccl-cu12/cu13 when `python3 -c "import nvidia.nccl"` finds it (its
#   lib/libnccl.so.2 and include/nccl.h; set NCCL_NO_PYTHON=ON to skip this probe);
#   next to the CUDA toolkit (found by find_package(CUDAToolkit) first); the system paths.
# Accepts the unversioned libnccl.so or, as the wheel ships it, libnccl.so.2 alone. Defines:
#   NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION (from nccl.h's NCCL_MAJOR/MINOR/PATCH)
#   the imported target NCCL::NCCL
include(FindPackageHandleStandardArgs)

set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
set(_nccl_lib_hints ${NCCL_LIBRARY_HINT} $ENV{NCCL_LIBRARY_HINT})
set(_nccl_include_hints ${NCCL_INCLUDE_HINT} $ENV{NCCL_INCLUDE_HINT})

# The wheel: site-packages/nvidia/nccl/{lib,include}. nvidia is a namespace package, so the folder
# comes from __path__, not __file__.
if(NOT NCCL_NO_PYTHON AND NOT NCCL_LIBRARY)
  find_program(_nccl_python NAMES python3 python)
  if(_nccl_python)
    execute_process(COMMAND "${_nccl_python}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
                    OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
                    RESULT_VARIABLE _nccl_python_rc TIMEOUT 30)
    if(_nccl_python_rc EQUAL 0 AND IS_DIRECTORY "${_nccl_wheel}")
      list(APPEND _nccl_hints "${_nccl_wheel}")
    endif()
  endif()
endif()

if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints "${CUDAToolkit_LIBRARY_ROOT}")
endif()
if(CUDAToolkit_BIN_DIR)
  get_filename_component(_nccl_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  list(APPEND _nccl_hints "${_nccl_cuda_root}")
endif()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_include_hints} ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
          PATH_SUFFIXES include)
# libnccl.so.2 by its full name: find_library only adds the platform's prefix and suffix, and the
# wheel has no unversioned link.
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_lib_hints} ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
             PATH_SUFFIXES lib lib64)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${part} +([0-9]+)" _m "${_nccl_version_lines}")
    set(_nccl_${part} "${CMAKE_MATCH_1}")
  endforeach()
  set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
endif()

find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                              INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

# Warnings for the project's own tests, examples and benchmarks (never imposed on consumers).
add_library(dparallel_warnings INTERFACE)
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_options(dparallel_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Werror>)
endif()
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  # GCC 12's -Wextra flags every designated initialiser that leaves a defaulted member out
  # (`dparallel::options{.chunking = ...}`), which is the documented way to pass options.
  target_compile_options(dparallel_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-Wno-missing-field-initializers>)
endif()
# nvcc: the host compiler's warnings for our CUDA translation units (device code is checked by
# nvcc itself); -Werror is left off there because the toolkit's own headers are not warning-free
# under every host compiler.
target_compile_options(dparallel_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  target_compile_options(dparallel_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wno-missing-field-initializers>)
endif()

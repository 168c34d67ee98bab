# The configure-time CUDA version check (cmake/dparallelCUDAVersion.cmake), run with cmake -P:
#   cmake -DSOURCE_DIR=<dparallel source tree> -P cuda_version.cmake
# CUDA 12.4 with DPARALLEL_CUDA=ON stops the configuration with a message naming the minimum, the
# version found and the fix; with AUTO it warns and leaves the add-ons out; 12.5 and 13.0 pass.
include("${SOURCE_DIR}/cmake/dparallelCUDAVersion.cmake")

if(DEFINED CHECK_VERSION)  # the inner run: one call, as cmake/dparallelCUDA.cmake makes it
  dparallel_check_cuda_version("${CHECK_VERSION}" "/opt/cuda-${CHECK_VERSION}/bin" "${CHECK_MODE}" ok)
  message(STATUS "result: ${ok}")
  return()
endif()

# expect(<version> <mode> <0 (passes) or 1 (fails)> <regex the output matches>)
function(expect version mode rc_expected pattern)
  execute_process(COMMAND "${CMAKE_COMMAND}" "-DSOURCE_DIR=${SOURCE_DIR}" -DCHECK_VERSION=${version} -DCHECK_MODE=${mode}
                          -P "${CMAKE_CURRENT_LIST_FILE}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX REPLACE "[ \n]+" " " flat "${out}")  # CMake wraps messages
  set(failed_as_expected FALSE)
  if((rc EQUAL 0 AND rc_expected EQUAL 0) OR (NOT rc EQUAL 0 AND NOT rc_expected EQUAL 0))
    set(failed_as_expected TRUE)
  endif()
  if(failed_as_expected AND flat MATCHES "${pattern}")
    message(STATUS "CUDA ${version}, DPARALLEL_CUDA=${mode}: as expected")
  else()
    message(FATAL_ERROR "CUDA ${version}, DPARALLEL_CUDA=${mode}: expected exit ${rc_expected} and output matching "
                        "'${pattern}', found exit ${rc}:\n${out}")
  endif()
endfunction()

set(needs "need CUDA 12.5 or newer .*cudaGetDriverEntryPointByVersion.*found CUDA 12.4 \\(/opt/cuda-12.4/bin\\)")
expect(12.4 ON 1 "CMake Error.*${needs}.*or set DPARALLEL_CUDA=OFF")
expect(12.4 AUTO 0 "CMake Warning.*${needs}.*dparallel::cuda and dparallel::nccl are not defined.*result: FALSE")
expect(12.5 ON 0 "result: TRUE")
expect(13.0.88 AUTO 0 "result: TRUE")

# Driver of a compile-failure test (cmake -P). Builds TARGET in the build tree BUILD_DIR and
# succeeds only when that build FAILS and its output contains EXPECT (a regular expression: a
# distinctive part of dparallel's static_assert message). A build that succeeds, or that fails
# for another reason (a typo, a missing include), fails the test and prints the output.
#   -DBUILD_DIR=<dir> -DTARGET=<target> -DEXPECT=<regex> [-DCONFIG=<config>]
foreach(var BUILD_DIR TARGET EXPECT)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "compile_fail.cmake: -D${var}=... is required")
  endif()
endforeach()

set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" ${config_args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)

if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must not: dparallel accepted code that it has to reject "
                      "with a readable message matching '${EXPECT}'. Build output:\n${out}")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "${TARGET} failed to compile as it should, but its output lacks dparallel's message "
                      "matching '${EXPECT}' (it failed for another reason, or the message changed). "
                      "Build output:\n${out}")
endif()
message(STATUS "${TARGET} failed to compile, as it must, with dparallel's message matching '${EXPECT}'")

# Runs a program that must fail, for CTest:
#   cmake -DEXE=<program> "-DARGS=<arguments, shell-quoted>" -DRC=<exit status> "-DEXPECT=<regex>"
#         -P expect_failure.cmake
#         [-DREJECT=<regex>] -P expect_failure.cmake
# Passes when the program exits with RC (not 0, not a crash), its output or errors match EXPECT,
# and (with REJECT) they do not match REJECT.

foreach(var EXE ARGS RC EXPECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "expect_failure.cmake: expected -D${var}=..., found none")
  endif()
endforeach()

separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND "${EXE}" ${args}
                OUTPUT_VARIABLE output ERROR_VARIABLE errors
                RESULT_VARIABLE rc)
message("${output}${errors}")
if(NOT rc STREQUAL "${RC}")
  message(FATAL_ERROR "expect_failure.cmake: expected ${EXE} ${ARGS} to exit with ${RC}, found ${rc}")
endif()
if(NOT "${output}${errors}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "expect_failure.cmake: expected the output of ${EXE} ${ARGS} to match \"${EXPECT}\", "
                      "found the output above")
endif()
if(DEFINED REJECT AND "${output}${errors}" MATCHES "${REJECT}")
  message(FATAL_ERROR "expect_failure.cmake: expected the output of ${EXE} ${ARGS} not to match \"${REJECT}\", "
                      "found the output above")
endif()
message(STATUS "expect_failure.cmake: failed as expected, with ${rc} and a message matching \"${EXPECT}\"")

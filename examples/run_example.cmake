# Runs one example program for CTest and keeps its JSON summary:
#   cmake -DEXE=<program> "-DARGS=<arguments, shell-quoted>" -DOUT=<file.json> -P run_example.cmake
# Echoes the program's output as it runs, fails when the program fails, and writes the last line
# it printed (the JSON object --json ends with) to OUT for example_check.
# Optional -DWRITES=<file;file...>: files the program is to write (--save, --save-checkpoint):
# removed before it runs, so that a run that does not write them fails instead of leaving an
# earlier run's files to the checks.
# Optional -DEXPECT=<regex>: the output must match it (e.g. the --profile table's phase names).

foreach(var EXE ARGS OUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_example.cmake: expected -D${var}=..., found none")
  endif()
endforeach()

file(REMOVE "${OUT}")  # a failed run must not leave an earlier run's summary behind
if(DEFINED WRITES)
  file(REMOVE ${WRITES})
endif()
separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND "${EXE}" ${args}
                OUTPUT_VARIABLE output ECHO_OUTPUT_VARIABLE
                RESULT_VARIABLE rc)
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "run_example.cmake: expected ${EXE} ${ARGS} to exit with 0, found ${rc}; "
                      "its output and errors are above")
endif()

if(DEFINED EXPECT AND NOT output MATCHES "${EXPECT}")
  message(FATAL_ERROR "run_example.cmake: expected the output of ${EXE} ${ARGS} to match '${EXPECT}', found no "
                      "match; its output is above")
endif()

string(STRIP "${output}" output)
string(FIND "${output}" "\n" last_newline REVERSE)
math(EXPR first "${last_newline} + 1")
string(SUBSTRING "${output}" ${first} -1 summary)
string(JSON type ERROR_VARIABLE json_error TYPE "${summary}")
if(json_error OR NOT type STREQUAL "OBJECT")
  message(FATAL_ERROR "run_example.cmake: expected the last line of the output to be a JSON object "
                      "(run with --json), found: ${summary}")
endif()
foreach(file IN LISTS WRITES)
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "run_example.cmake: expected ${EXE} ${ARGS} to write ${file}, found no such file")
  endif()
endforeach()
file(WRITE "${OUT}" "${summary}\n")
message(STATUS "run_example.cmake: summary written to ${OUT}")

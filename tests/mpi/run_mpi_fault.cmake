# Runs one failure scenario of mpi_fault as an MPI job and checks how it ended:
#   cmake -DMPIEXEC=<mpirun> "-DFLAGS=<launcher flags>" [-DNPFLAG=-np] -DNP=3 -DEXE=<mpi_fault> -DSCENARIO=throw
#         -DTIMEOUT_MS=<the group's timeout> -DLIMIT_S=<seconds> [-DEXIT_STATUS=nonzero|any]
#         "-DEXPECT=<regex>@@<regex>..."
#         ["-DREJECT=<regex>@@..."] -P run_mpi_fault.cmake
# Regexes are separated by @@ (a CTest command cannot carry ';'); <LINE> in a regex stands for
# "any characters but a newline", so that a regex stays within one line of output.
# Passes when the job exits non-zero (a failure must not look like success; EXIT_STATUS=any waives
# this for launchers that hide it), its output (stdout
# and stderr) matches every EXPECT regex and no REJECT regex, and it ended within LIMIT_S seconds:
# for a throwing or killed rank LIMIT_S is below the group's timeout, which proves the survivors
# learned of the failure from the failed rank (or the launcher), not by waiting out the timeout.
foreach(var MPIEXEC NP EXE SCENARIO TIMEOUT_MS LIMIT_S EXPECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_mpi_fault.cmake: expected -D${var}=..., found none")
  endif()
endforeach()
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
foreach(var EXPECT REJECT)
  string(REPLACE "<LINE>" "[^\n]*" ${var} "${${var}}")
  string(REPLACE "@@" ";" ${var} "${${var}}")
endforeach()

string(TIMESTAMP t0 "%s" UTC)
math(EXPR kill_after "${LIMIT_S} + 60")
if(NOT NPFLAG)
  set(NPFLAG -np)
endif()
execute_process(COMMAND "${MPIEXEC}" ${flags} ${NPFLAG} ${NP} "${EXE}" ${SCENARIO} ${TIMEOUT_MS}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT ${kill_after})
string(TIMESTAMP t1 "%s" UTC)
math(EXPR elapsed "${t1} - ${t0}")
message("---- output of: ${MPIEXEC} ${FLAGS} ${NPFLAG} ${NP} ${EXE} ${SCENARIO} ${TIMEOUT_MS}\n${out}----")

set(failures "")
if(rc STREQUAL "0" AND NOT EXIT_STATUS STREQUAL "any")
  string(APPEND failures "  - expected the job to exit non-zero, found exit status 0\n")
elseif(NOT rc MATCHES "^[0-9]+$")
  string(APPEND failures "  - expected the job to end by itself, found: ${rc}\n")
endif()
foreach(re IN LISTS EXPECT)
  if(NOT out MATCHES "${re}")
    string(APPEND failures "  - expected the output to match '${re}', found no match\n")
  endif()
endforeach()
foreach(re IN LISTS REJECT)
  if(out MATCHES "${re}")
    string(APPEND failures "  - expected the output not to match '${re}', found '${CMAKE_MATCH_0}'\n")
  endif()
endforeach()
if(elapsed GREATER_EQUAL LIMIT_S)
  string(APPEND failures "  - expected the job to end within ${LIMIT_S} s, found ${elapsed} s\n")
endif()
if(failures)
  message(FATAL_ERROR "run_mpi_fault.cmake: scenario '${SCENARIO}' (np ${NP}, exit status ${rc}, ${elapsed} s):\n${failures}")
endif()
message("run_mpi_fault.cmake: scenario '${SCENARIO}' passed: exit status ${rc}, ${elapsed} s (limit ${LIMIT_S} s)")

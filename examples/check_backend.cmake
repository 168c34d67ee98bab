# Checks train_mlp's --backend dispatch, for CTest (in builds with CUDA):
#   cmake -DEXE=<train_mlp> "-DARGS=<arguments, shell-quoted, with --json>" -P check_backend.cmake
# Runs train_mlp with ARGS and --backend auto, then with --backend cuda, and requires them to agree:
#  - no GPU: auto says it chose the host and why ("backend auto chose host (no CUDA device: ...)"),
#    its JSON summary says "backend":"host", and --backend cuda fails with exit status 1 and a
#    message naming the missing device;
#  - a GPU: auto says it chose cuda, and both runs succeed with "backend":"cuda" in their summaries.

foreach(var EXE ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_backend.cmake: expected -D${var}=..., found none")
  endif()
endforeach()

separate_arguments(args UNIX_COMMAND "${ARGS}")

# Runs train_mlp with `args` and --backend <backend>; sets <prefix>_rc, <prefix>_out (stdout and
# stderr) and <prefix>_json (the "backend" of the JSON summary on the last line, or "").
function(run_backend backend prefix)
  execute_process(COMMAND "${EXE}" ${args} --backend ${backend}
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  message("--- ${EXE} ${ARGS} --backend ${backend}: exit status ${rc}\n${out}${err}")
  set(chosen "")
  string(STRIP "${out}" stripped)
  string(FIND "${stripped}" "\n" last_newline REVERSE)
  math(EXPR first "${last_newline} + 1")
  string(SUBSTRING "${stripped}" ${first} -1 last)
  string(JSON value ERROR_VARIABLE json_error GET "${last}" backend)
  if(NOT json_error)
    set(chosen "${value}")
  endif()
  set(${prefix}_rc "${rc}" PARENT_SCOPE)
  set(${prefix}_out "${out}${err}" PARENT_SCOPE)
  set(${prefix}_json "${chosen}" PARENT_SCOPE)
endfunction()

run_backend(auto auto)
run_backend(cuda cuda)

set(failures "")
if(NOT auto_rc STREQUAL "0")
  string(APPEND failures "  - --backend auto: expected exit status 0, found ${auto_rc}\n")
endif()
if(NOT auto_out MATCHES "train_mlp: backend auto chose (host|cuda) \\(([^\n]*)\\)")
  string(APPEND failures "  - --backend auto: expected the line 'train_mlp: backend auto chose <backend> (<why>)', found none\n")
else()
  set(said "${CMAKE_MATCH_1}")
  set(why "${CMAKE_MATCH_2}")
  if(NOT said STREQUAL auto_json)
    string(APPEND failures "  - --backend auto: it said it chose ${said}, its JSON summary says \"backend\":\"${auto_json}\"\n")
  endif()
  if(said STREQUAL "host")
    # No GPU: --backend cuda is a right command on the wrong machine: exit status 1, a clear message.
    if(NOT why MATCHES "^no CUDA device: .+")
      string(APPEND failures "  - --backend auto chose host, expected the reason 'no CUDA device: <the runtime's reason>', found '${why}'\n")
    endif()
    if(NOT cuda_rc STREQUAL "1")
      string(APPEND failures "  - --backend cuda without a GPU: expected exit status 1, found ${cuda_rc}\n")
    endif()
    if(NOT cuda_out MATCHES "train_mlp: error: --backend cuda: no CUDA device to run on \\([^)]+\\); use --backend host")
      string(APPEND failures "  - --backend cuda without a GPU: expected 'train_mlp: error: --backend cuda: no CUDA device to run on (<why>); use --backend host ...', found the output above\n")
    endif()
  else()
    if(NOT cuda_rc STREQUAL "0" OR NOT cuda_json STREQUAL "cuda")
      string(APPEND failures "  - --backend cuda with a GPU (auto chose cuda): expected exit status 0 and \"backend\":\"cuda\", found ${cuda_rc} and \"${cuda_json}\"\n")
    endif()
  endif()
endif()

if(failures)
  message(FATAL_ERROR "check_backend.cmake failed:\n${failures}")
endif()
message("check_backend.cmake: passed: --backend auto chose ${said} (${why}); --backend cuda exited with ${cuda_rc}")

# The documentation's tests (label `docs`):
# - docs:api_reference: Doxygen builds the API reference from the headers' `///` comments
#   (docs/Doxyfile) with warnings as errors, so it fails on an undocumented public name, a broken
#   reference or a malformed doc command; without Doxygen (Debian package `doxygen`) it reports
#   *skipped*. The target `api_reference` builds the HTML into <build>/docs/api/html.
# - docs:readme_front_door: the README stays a front door: at most 150 lines, opening with the
#   quick start's two commands (`./scripts/example`, `./scripts/test`) before any other section.
# - docs:no_issue_numbers: no issue numbers in include/, docs/, benchmarks/, examples/, README.md
#   (dparallelNoIssueNumbers.cmake).
# - docs:links: every relative link of the README and docs/ names a file and heading that exist
#   (tests/docs/check_links.py; needs Python 3).
# Run as a script (cmake -DREADME=<file> -P dparallelDocs.cmake) this file is that README check.

if(CMAKE_SCRIPT_MODE_FILE)
  file(READ "${README}" text)
  string(REGEX MATCHALL "\n" newlines "${text}")
  list(LENGTH newlines n)
  if(n GREATER 150)
    message(FATAL_ERROR "${README}: expected at most 150 lines (details belong in docs/), found ${n}")
  endif()
  string(FIND "${text}" "\n### " first_subsection)
  foreach(command IN ITEMS "./scripts/example" "./scripts/test")
    string(FIND "${text}" "${command}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "${README}: expected the quick start command `${command}`, found none")
    endif()
    if(NOT first_subsection EQUAL -1 AND at GREATER first_subsection)
      message(FATAL_ERROR "${README}: expected `${command}` in the opening quick start, found it further down")
    endif()
  endforeach()
  return()
endif()

add_test(NAME docs:readme_front_door
         COMMAND "${CMAKE_COMMAND}" "-DREADME=${PROJECT_SOURCE_DIR}/README.md" -P "${CMAKE_CURRENT_LIST_FILE}")
set_tests_properties(docs:readme_front_door PROPERTIES LABELS docs)

add_test(NAME docs:no_issue_numbers
         COMMAND "${CMAKE_COMMAND}" "-DROOT=${PROJECT_SOURCE_DIR}" -P "${CMAKE_CURRENT_LIST_DIR}/dparallelNoIssueNumbers.cmake")
set_tests_properties(docs:no_issue_numbers PROPERTIES LABELS docs)

find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME docs:links
           COMMAND "${Python3_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/tests/docs/check_links.py" "${PROJECT_SOURCE_DIR}")
  set_tests_properties(docs:links PROPERTIES LABELS docs)
endif()

find_program(DPARALLEL_DOXYGEN doxygen DOC "Doxygen, for the API reference and its test")
set(dparallel_docs_out "${PROJECT_BINARY_DIR}/docs/api")
if(DPARALLEL_DOXYGEN)
  set(dparallel_doxygen_command
      "${CMAKE_COMMAND}" -E env "DPARALLEL_SOURCE_DIR=${PROJECT_SOURCE_DIR}" "DPARALLEL_DOCS_OUT=${dparallel_docs_out}"
      "${DPARALLEL_DOXYGEN}" "${PROJECT_SOURCE_DIR}/docs/Doxyfile")
  file(MAKE_DIRECTORY "${dparallel_docs_out}")
  add_test(NAME docs:api_reference COMMAND ${dparallel_doxygen_command})
  add_custom_target(api_reference COMMAND ${dparallel_doxygen_command} VERBATIM
                    COMMENT "Doxygen: the API reference in ${dparallel_docs_out}/html")
else()
  add_test(NAME docs:api_reference COMMAND "${CMAKE_COMMAND}" -E echo "doxygen not found: API reference not checked")
  set_tests_properties(docs:api_reference PROPERTIES SKIP_REGULAR_EXPRESSION "doxygen not found")
endif()
set_tests_properties(docs:api_reference PROPERTIES LABELS docs TIMEOUT 300)

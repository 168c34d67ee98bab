# docs:no_issue_numbers: the files users read speak about the library, not about the project's
# tracker. Fails when a file under include/, docs/, benchmarks/ or examples/, or README.md, names
# an issue by number ("issue 12", "Issue #12", "issues 17"); identifiers such as `issue_order` and
# words such as "issued" do not match.
# Run as a script: cmake -DROOT=<source dir> -P dparallelNoIssueNumbers.cmake

set(pattern "(^|[^A-Za-z0-9_])[Ii]ssues? #?[0-9]+")
set(files "${ROOT}/README.md")
foreach(dir IN ITEMS include docs benchmarks examples)
  file(GLOB_RECURSE found LIST_DIRECTORIES false "${ROOT}/${dir}/*")
  list(APPEND files ${found})
endforeach()
list(SORT files)

set(bad "")
foreach(f IN LISTS files)
  file(STRINGS "${f}" hits REGEX "${pattern}")
  foreach(line IN LISTS hits)
    file(RELATIVE_PATH rel "${ROOT}" "${f}")
    string(STRIP "${line}" line)
    string(APPEND bad "\n  ${rel}: ${line}")
  endforeach()
endforeach()

list(LENGTH files n)
if(bad)
  message(FATAL_ERROR "expected no issue numbers in the files users read (say what the code does, "
                      "not which issue asked for it), found:${bad}")
endif()
message(STATUS "no issue numbers in ${n} files")

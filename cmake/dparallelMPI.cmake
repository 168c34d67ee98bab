# The MPI add-on: the target dparallel::mpi (dparallel + MPI's C library, for
# <dparallel/comm/mpi.hpp>) and the launcher settings the MPI tests and examples use. At the top
# level MPI is looked for at once: without it nothing is defined and a status message says so (the
# rest of dparallel does not need MPI). As a subproject MPI is looked for when a target links
# dparallel::mpi, and a configure error says so when it is not found.
#
# Included by the top-level CMakeLists.txt, tests/mpi and examples, whichever comes first (the
# guard makes the others no-ops). Defines, when MPI is found:
#   dparallel::mpi (target dparallel_mpi, exported as dparallel::mpi)
#   MPIEXEC_EXECUTABLE, MPIEXEC_NUMPROC_FLAG   (FindMPI's cache variables)
#   DPARALLEL_MPIEXEC_FLAGS                     (cache: flags for every test launch; Open MPI gets
#                                                --allow-run-as-root --oversubscribe, since CI runs
#                                                as root on machines with fewer cores than ranks)
include_guard(GLOBAL)

# As a subproject (add_subdirectory, FetchContent) MPI is probed only when a target of the project
# links dparallel::mpi (below); DPARALLEL_MPI=ON probes it at once, as the top level does.
option(DPARALLEL_MPI "Look for MPI and define dparallel::mpi (default: ON when top level)" ${PROJECT_IS_TOP_LEVEL})

# _dparallel_links_mpi(<out> <dir>): TRUE when a target of <dir> or of a directory below it links
# dparallel::mpi (directly, as target_link_libraries writes it).
function(_dparallel_links_mpi out dir)
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(t IN LISTS targets)
    foreach(property LINK_LIBRARIES INTERFACE_LINK_LIBRARIES)
      get_target_property(libs ${t} ${property})
      if(libs AND NOT t STREQUAL "dparallel_mpi" AND libs MATCHES "dparallel(::|_)mpi")
        set(${out} TRUE PARENT_SCOPE)
        return()
      endif()
    endforeach()
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    _dparallel_links_mpi(found "${sub}")
    if(found)
      set(${out} TRUE PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} FALSE PARENT_SCOPE)
endfunction()

# Called at the end of the top directory: links the project's own MPI (found before or after
# dparallel) into dparallel::mpi, or finds MPI when the project links dparallel::mpi without having
# looked for it. A project that links it where no MPI is found stops here with the fix.
function(_dparallel_link_mpi)
  if(NOT TARGET MPI::MPI_CXX)
    _dparallel_links_mpi(wanted "${CMAKE_SOURCE_DIR}")
    if(NOT wanted)
      return()
    endif()
    find_package(MPI COMPONENTS CXX QUIET)
    if(NOT MPI_CXX_FOUND OR NOT TARGET MPI::MPI_CXX)
      message(FATAL_ERROR "dparallel: a target links dparallel::mpi, but find_package(MPI) found no MPI with C++ "
                          "support (Debian: apt-get install libopenmpi-dev openmpi-bin; elsewhere set MPI_HOME "
                          "or MPI_CXX_COMPILER)")
    endif()
    message(STATUS "dparallel: MPI ${MPI_CXX_VERSION} found for dparallel::mpi")
  endif()
  target_link_libraries(dparallel_mpi INTERFACE MPI::MPI_CXX)
endfunction()

if(NOT DPARALLEL_MPI)
  if(NOT PROJECT_IS_TOP_LEVEL)
    # A subproject defines dparallel::mpi without probing anything. MPI::MPI_CXX found by the
    # project before this point is linked now; otherwise at the end of the top directory, where
    # the project's own find_package(MPI) (if any) has run, and names linked from there are looked
    # up there.
    add_library(dparallel_mpi INTERFACE)
    add_library(dparallel::mpi ALIAS dparallel_mpi)
    set_target_properties(dparallel_mpi PROPERTIES EXPORT_NAME mpi)
    target_link_libraries(dparallel_mpi INTERFACE dparallel::dparallel)
    target_compile_definitions(dparallel_mpi INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
    if(TARGET MPI::MPI_CXX)
      target_link_libraries(dparallel_mpi INTERFACE MPI::MPI_CXX)
    else()
      cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _dparallel_link_mpi)
    endif()
    message(STATUS "dparallel: dparallel::mpi defined; MPI is looked for only if the project links it")
    return()
  endif()
  message(STATUS "dparallel: DPARALLEL_MPI=OFF: MPI is not probed (dparallel::mpi is not defined)")
  return()
endif()

set(_dparallel_mpi_preexisting FALSE)
if(TARGET MPI::MPI_CXX)
  set(_dparallel_mpi_preexisting TRUE)
endif()
find_package(MPI COMPONENTS CXX QUIET)

if(NOT MPI_CXX_FOUND OR NOT TARGET MPI::MPI_CXX)
  message(STATUS "dparallel: MPI not found: the dparallel::mpi target, the MPI tests and train_mlp --comm mpi "
                 "are skipped (Debian: apt-get install libopenmpi-dev openmpi-bin)")
  return()
endif()

# FindMPI's imported target is local to the directory that found it: make it visible everywhere
# (only possible, and only needed, when it was created here).
if(NOT _dparallel_mpi_preexisting)
  get_target_property(_dparallel_mpi_global MPI::MPI_CXX IMPORTED_GLOBAL)
  if(NOT _dparallel_mpi_global)
    set_target_properties(MPI::MPI_CXX PROPERTIES IMPORTED_GLOBAL TRUE)
  endif()
endif()

add_library(dparallel_mpi INTERFACE)
add_library(dparallel::mpi ALIAS dparallel_mpi)
set_target_properties(dparallel_mpi PROPERTIES EXPORT_NAME mpi)
target_link_libraries(dparallel_mpi INTERFACE dparallel::dparallel MPI::MPI_CXX)
# <dparallel/comm/mpi.hpp> uses MPI's C API only: skip the deprecated C++ bindings' headers.
target_compile_definitions(dparallel_mpi INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)

set(_dparallel_mpi_flags "")
if(MPI_CXX_LIBRARY_VERSION_STRING MATCHES "Open MPI" OR MPIEXEC_EXECUTABLE MATCHES "openmpi")
  set(_dparallel_mpi_flags "--allow-run-as-root --oversubscribe")
elseif(MPIEXEC_EXECUTABLE)
  execute_process(COMMAND "${MPIEXEC_EXECUTABLE}" --version OUTPUT_VARIABLE _dparallel_mpi_version
                  ERROR_VARIABLE _dparallel_mpi_version TIMEOUT 20)
  if(_dparallel_mpi_version MATCHES "Open MPI|OpenRTE")
    set(_dparallel_mpi_flags "--allow-run-as-root --oversubscribe")
  endif()
endif()
set(DPARALLEL_MPIEXEC_FLAGS "${_dparallel_mpi_flags}" CACHE STRING
    "Flags for every mpiexec launch of dparallel's MPI tests and example (space-separated)")
message(STATUS "dparallel: MPI ${MPI_CXX_VERSION} found; its tests launch with "
               "${MPIEXEC_EXECUTABLE} ${DPARALLEL_MPIEXEC_FLAGS}")

# The MPI add-on: the target dparallel::mpi (dparallel + MPI's C library, for
# <dparallel/comm/mpi.hpp>) when find_package(MPI) finds MPI's C++ compiler support, and the
# launcher settings the MPI tests and examples use. Without MPI nothing is defined and a status
# message says so; the rest of dparallel does not need MPI.
#
# Included by the top-level CMakeLists.txt, tests/mpi and examples, whichever comes first (the
# guard makes the others no-ops). Defines, when MPI is found:
#   dparallel::mpi (target dparallel_mpi, exported as dparallel::mpi)
#   MPIEXEC_EXECUTABLE, MPIEXEC_NUMPROC_FLAG   (FindMPI's cache variables)
#   DPARALLEL_MPIEXEC_FLAGS                     (cache: flags for every test launch; Open MPI gets
#                                                --allow-run-as-root --oversubscribe, since CI runs
#                                                as root on machines with fewer cores than ranks)
include_guard(GLOBAL)

# As a subproject (add_subdirectory, FetchContent) MPI is not probed unless the consumer asks.
option(DPARALLEL_MPI "Look for MPI and define dparallel::mpi (default: ON when top level)" ${PROJECT_IS_TOP_LEVEL})
if(NOT DPARALLEL_MPI)
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

# Finds OpenBLAS for the example and the benchmarks (the reference workload's GEMMs) and defines
# the INTERFACE target dparallel_openblas when it is found (once, whoever includes this first).
# OpenBLAS's pkg-config file names the library and the cblas.h that belong together (Debian
# installs several BLAS flavours side by side); else FindBLAS plus a search for cblas.h.
include_guard(GLOBAL)
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(DPARALLEL_OPENBLAS QUIET IMPORTED_TARGET GLOBAL openblas)
endif()
if(TARGET PkgConfig::DPARALLEL_OPENBLAS)
  add_library(dparallel_openblas INTERFACE)
  target_link_libraries(dparallel_openblas INTERFACE PkgConfig::DPARALLEL_OPENBLAS)
else()
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS)
  find_path(DPARALLEL_CBLAS_INCLUDE_DIR cblas.h
            PATH_SUFFIXES openblas openblas-pthread x86_64-linux-gnu/openblas-pthread aarch64-linux-gnu/openblas-pthread)
  if(BLAS_FOUND AND DPARALLEL_CBLAS_INCLUDE_DIR)
    set_target_properties(BLAS::BLAS PROPERTIES IMPORTED_GLOBAL TRUE)
    add_library(dparallel_openblas INTERFACE)
    target_link_libraries(dparallel_openblas INTERFACE BLAS::BLAS)
    target_include_directories(dparallel_openblas INTERFACE "${DPARALLEL_CBLAS_INCLUDE_DIR}")
  endif()
endif()

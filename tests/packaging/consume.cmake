# Driver of a consumption test (cmake -P): gets dparallel one way, builds the consumer project
# (tests/packaging/consumer) with it and runs it. Any failing step stops the test with a
# FATAL_ERROR that shows the step's command and output.
#   -DMODE=add_subdirectory|fetch_content|find_package|include_path
#   -DSOURCE_DIR=<dparallel source tree>  -DCONSUMER_DIR=<tests/packaging/consumer>
#   -DWORK_DIR=<scratch directory, wiped first>  -DCXX_COMPILER=<path>  [-DGENERATOR=<name>]
#   [-DCONFIG=<build type>]  [-DEXPECTED_VERSION=<x.y.z>]
#   [-DCXX_FLAGS=<space-separated compiler flags>] (include_path only)
#   [-DTORCH_DIR=<libtorch's Torch_DIR>]: also build and run the consumer's libtorch program
#   (tests/packaging/consumer/torch_main.cpp, add_subdirectory and find_package)
#   [-DMPI=ON]: also build the consumer's MPI program (tests/packaging/consumer/mpi_main.cpp),
#   linking dparallel::mpi from a project that never looks for MPI itself, and run it as one
#   process (add_subdirectory and fetch_content)
#   [-DCUDA_COMPILER=<nvcc> -DCUDA_ARCHITECTURES=<list> -DNCCL_INCLUDE_DIR=<dir> -DNCCL_LIBRARY=<file>]:
#   the consumer is a CUDA project (DPARALLEL_CONSUME_CUDA=ON: cuda_main.cu; add_subdirectory and
#   fetch_content). Its program exits 77 without a GPU: the test then passes on the build alone,
#   unless the environment variable DPARALLEL_REQUIRE_GPU is set (scripts/gpu-check sets it).
foreach(var MODE SOURCE_DIR CONSUMER_DIR WORK_DIR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "consume.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT IS_ABSOLUTE "${WORK_DIR}")
  message(FATAL_ERROR "consume.cmake: WORK_DIR must be an absolute path, found '${WORK_DIR}'")
endif()

# run(<what> <command>...): runs the command; on failure, stops with its output.
function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "[${MODE}] ${what} failed (${rc}).\nCommand: ${cmd}\nOutput:\n${out}")
  endif()
  message(STATUS "[${MODE}] ${what}: OK")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

set(generator_args)
if(GENERATOR)
  set(generator_args -G "${GENERATOR}")
endif()
set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
# Configure arguments every CMake project in this test gets.
set(common_args ${generator_args} "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${CONFIG}"
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
if(CUDA_COMPILER)
  list(APPEND common_args -DDPARALLEL_CONSUME_CUDA=ON "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}" "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}"
       "-DNCCL_INCLUDE_DIR=${NCCL_INCLUDE_DIR}" "-DNCCL_LIBRARY=${NCCL_LIBRARY}")
endif()
set(torch_args)
if(TORCH_DIR)
  set(torch_args -DDPARALLEL_CONSUME_TORCH=ON "-DTorch_DIR=${TORCH_DIR}")
endif()
if(MPI)
  list(APPEND torch_args -DDPARALLEL_CONSUME_MPI=ON)
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# The consumer's executable (single- or multi-config generator).
function(run_consumer build_dir)
  foreach(candidate "${build_dir}/consumer" "${build_dir}/${CONFIG}/consumer" "${build_dir}/consumer.exe"
                    "${build_dir}/${CONFIG}/consumer.exe")
    if(EXISTS "${candidate}" AND NOT IS_DIRECTORY "${candidate}")
      if(CUDA_COMPILER)
        execute_process(COMMAND "${candidate}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
        if(rc EQUAL 77 AND NOT DEFINED ENV{DPARALLEL_REQUIRE_GPU})
          message(STATUS "[${MODE}] the CUDA consumer built; not run: ${out}")
          return()
        elseif(NOT rc EQUAL 0)
          message(FATAL_ERROR "[${MODE}] running the CUDA consumer failed (${rc}).\nOutput:\n${out}")
        endif()
        message(STATUS "[${MODE}] running the CUDA consumer: OK\n${out}")
        return()
      endif()
      run("running the consumer" "${candidate}")
      message(STATUS "[${MODE}] ${last_output}")
      # The optional programs sit beside it: consumer_torch, consumer_mpi.
      get_filename_component(exe_dir "${candidate}" DIRECTORY)
      get_filename_component(exe_name "${candidate}" NAME)
      foreach(extra IN ITEMS "TORCH_DIR|torch|libtorch" "MPI|mpi|MPI")
        string(REPLACE "|" ";" extra "${extra}")
        list(GET extra 0 wanted)
        list(GET extra 1 suffix)
        list(GET extra 2 title)
        if(${wanted})
          string(REPLACE "consumer" "consumer_${suffix}" extra_name "${exe_name}")
          run("running the ${title} consumer" "${exe_dir}/${extra_name}")
          message(STATUS "[${MODE}] ${last_output}")
        endif()
      endforeach()
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "[${MODE}] the consumer executable was not found under ${build_dir}")
endfunction()

# Builds and runs the consumer project with extra configure arguments.
function(build_consumer)
  set(build "${WORK_DIR}/consumer-build")
  run("configuring the consumer" "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${build}" ${common_args}
      "-DDPARALLEL_CONSUME_MODE=${MODE}" ${torch_args} ${ARGN})
  run("building the consumer" "${CMAKE_COMMAND}" --build "${build}" ${config_args})
  run_consumer("${build}")
endfunction()

if(MODE STREQUAL "add_subdirectory" OR MODE STREQUAL "fetch_content")
  build_consumer("-DDPARALLEL_SOURCE_DIR=${SOURCE_DIR}" -DFETCHCONTENT_TRY_FIND_PACKAGE_MODE=NEVER)

elseif(MODE STREQUAL "find_package")
  # A fresh configuration of the project as a packager makes it: nothing but the library and its
  # install rules.
  set(prefix "${WORK_DIR}/prefix")
  set(build "${WORK_DIR}/dparallel-build")
  run("configuring dparallel" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${build}" ${common_args}
      -DDPARALLEL_BUILD_TESTS=OFF -DDPARALLEL_BUILD_EXAMPLES=OFF -DDPARALLEL_BUILD_BENCHMARKS=OFF
      -DDPARALLEL_INSTALL=ON "-DCMAKE_INSTALL_PREFIX=${prefix}")
  run("building dparallel" "${CMAKE_COMMAND}" --build "${build}" ${config_args})
  run("installing dparallel" "${CMAKE_COMMAND}" --install "${build}" --prefix "${prefix}" ${config_args})

  # Every file under include/ is installed, and nothing else lands there.
  file(GLOB_RECURSE source_headers LIST_DIRECTORIES false RELATIVE "${SOURCE_DIR}/include" "${SOURCE_DIR}/include/*")
  file(GLOB_RECURSE installed_headers LIST_DIRECTORIES false RELATIVE "${prefix}/include" "${prefix}/include/*")
  list(SORT source_headers)
  list(SORT installed_headers)
  if(NOT source_headers STREQUAL installed_headers)
    set(missing ${source_headers})
    list(REMOVE_ITEM missing ${installed_headers})
    set(extra ${installed_headers})
    list(REMOVE_ITEM extra ${source_headers})
    message(FATAL_ERROR "[${MODE}] the installed headers differ from include/: not installed: [${missing}]; "
                        "installed but not in include/: [${extra}]")
  endif()
  list(LENGTH installed_headers n)
  message(STATUS "[${MODE}] all ${n} files under include/ are installed")

  build_consumer("-DCMAKE_PREFIX_PATH=${prefix}" "-DDPARALLEL_EXPECTED_VERSION=${EXPECTED_VERSION}")
  # The consumer must have found this install, not another dparallel on the machine.
  file(STRINGS "${WORK_DIR}/consumer-build/CMakeCache.txt" found_dir REGEX "^dparallel_DIR:")
  string(REGEX REPLACE "^dparallel_DIR:[A-Z]+=" "" found_dir "${found_dir}")
  cmake_path(IS_PREFIX prefix "${found_dir}" NORMALIZE under_prefix)
  if(NOT under_prefix)
    message(FATAL_ERROR "[${MODE}] the consumer found dparallel in '${found_dir}', expected under ${prefix}")
  endif()

elseif(MODE STREQUAL "include_path")
  # No build system at all: copy include/ and compile main.cpp with -I.
  file(COPY "${SOURCE_DIR}/include" DESTINATION "${WORK_DIR}/copy")
  set(exe "${WORK_DIR}/consumer")
  separate_arguments(flags UNIX_COMMAND "${CXX_FLAGS}")
  run("compiling the consumer with -I" "${CXX_COMPILER}" -std=c++20 ${flags} "-I${WORK_DIR}/copy/include"
      "${CONSUMER_DIR}/main.cpp" "${CONSUMER_DIR}/files.cpp" -pthread -o "${exe}")
  run("running the consumer" "${exe}")
  message(STATUS "[${MODE}] ${last_output}")

else()
  message(FATAL_ERROR "consume.cmake: MODE must be add_subdirectory, fetch_content, find_package or "
                      "include_path, found '${MODE}'")
endif()

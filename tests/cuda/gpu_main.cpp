// Catch2's runner for the tests that need a GPU: without one (no device, or no usable driver) it
// prints why and returns 77, which CTest reports as *skipped* (SKIP_RETURN_CODE), never passed.
// Listing the tests (CTest's discovery at build time) works without a GPU.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>

int main(int argc, char* argv[]) {
  bool listing = false;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--list", 6) == 0) listing = true;
  if (!listing) {
    int n = 0;
    cudaError_t const e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      std::printf("skipped: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
      return 77;
    }
  }
  return Catch::Session().run(argc, argv);
}

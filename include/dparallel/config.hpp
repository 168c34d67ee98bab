#pragma once
// Library-wide configuration: version, the versioned inline namespace and small macros.

#define DPARALLEL_VERSION_MAJOR 0
#define DPARALLEL_VERSION_MINOR 1
#define DPARALLEL_VERSION_PATCH 0

// Every entity lives in dparallel::v0 (an inline namespace), so translation units built against
// different, ABI-incompatible versions of the library do not silently mix symbols. Users spell
// names as dparallel::xyz and may specialise dparallel::model_traits<> as if v0 were not there.
#define DPARALLEL_NAMESPACE_BEGIN \
  namespace dparallel {           \
  inline namespace v0 {
#define DPARALLEL_NAMESPACE_END \
  }                             \
  }

#if defined(__CUDACC__)
#define DPARALLEL_HOST_DEVICE __host__ __device__ inline
#else
#define DPARALLEL_HOST_DEVICE inline
#endif

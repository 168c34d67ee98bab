// CUDA and NCCL argument checks that need no GPU: they run everywhere (also on CI machines with
// the toolkit but no device), compiled by the host compiler against the add-ons' host headers.
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#ifdef DPARALLEL_TEST_NCCL
#include <dparallel/comm/nccl.hpp>
#endif

#include <catch2/catch.hpp>

#include <string>
#include <vector>

namespace dpl = dparallel;

TEST_CASE("logical devices on one GPU are told apart by their lane", "[cuda][checks]") {
  CHECK(dpl::to_string(dpl::device{dpl::device_kind::cuda, 0, 0}) == "cuda:0");
  CHECK(dpl::to_string(dpl::device{dpl::device_kind::cuda, 0, 2}) == "cuda:0.2");
  CHECK(dpl::device{dpl::device_kind::cuda, 0, 1} != dpl::device{dpl::device_kind::cuda, 0, 2});
}

TEST_CASE("a device ordinal beyond the device count is a clear error", "[cuda][checks]") {
  int const n = dpl::cuda::device_count();
  CHECK(n >= 0);
  if (n == 0) CHECK_FALSE(dpl::cuda::no_device_reason().empty());
  auto const beyond = dpl::device{dpl::device_kind::cuda, n, 0};
  CHECK_THROWS_AS(dpl::cuda::check_device(beyond), dpl::invalid_argument);
  CHECK_THROWS_WITH(dpl::cuda::check_device(beyond),
                    Catch::Contains("cuda:" + std::to_string(n)) && Catch::Contains(std::to_string(n) + " GPU(s) are visible"));
  CHECK_THROWS_WITH(dpl::cuda::devices(n + 1), Catch::Contains("GPU(s) are visible"));
  CHECK_THROWS_WITH(dpl::cuda::check_device(dpl::device{dpl::device_kind::host, 0, 0}),
                    Catch::Contains("expected a CUDA device") && Catch::Contains("host:0"));
  CHECK_THROWS_WITH(dpl::cuda::logical_devices(0), Catch::Contains("at least one device"));
}

TEST_CASE("a host view that claims a GPU is rejected by the pointer check", "[cuda][checks]") {
  std::vector<float> host(4);
  dpl::tensor_ref const on_host(host.data(), host.size(), dpl::dtype::f32);
  CHECK_THROWS_WITH(dpl::cuda::check_pointer(on_host, "the view"), Catch::Contains("expected CUDA device memory"));
  dpl::tensor_ref const liar(host.data(), host.size(), dpl::dtype::f32, dpl::device{dpl::device_kind::cuda, 0, 0});
  CHECK_THROWS_WITH(dpl::cuda::check_pointer(liar, "the view"),
                    Catch::Contains("claims cuda:0") && Catch::Contains("is host memory"));
}

TEST_CASE("CUDA runtime failures become device errors naming the device and the call", "[cuda][checks]") {
  CHECK_NOTHROW(dpl::cuda::check(cudaSuccess, "nothing"));
  CHECK_THROWS_AS(dpl::cuda::check(cudaErrorInvalidValue, "cudaMemcpyAsync", dpl::device{dpl::device_kind::cuda, 1, 2}),
                  dpl::device_error);
  CHECK_THROWS_WITH(dpl::cuda::check(cudaErrorInvalidValue, "cudaMemcpyAsync", dpl::device{dpl::device_kind::cuda, 1, 2}),
                    Catch::Contains("cuda:1.2") && Catch::Contains("cudaMemcpyAsync") &&
                        Catch::Contains("cudaErrorInvalidValue"));
}

#ifdef DPARALLEL_TEST_NCCL
TEST_CASE("NCCL: dtypes it cannot reduce and mixed-dtype buckets are clear errors", "[cuda][nccl][checks]") {
  std::vector<std::int64_t> ints(4);
  std::vector<float> floats(4);
  dpl::tensor_ref const i64(ints.data(), ints.size(), dpl::dtype::i64);
  dpl::tensor_ref const f32(floats.data(), floats.size(), dpl::dtype::f32);
  CHECK_NOTHROW(dpl::nccl::check_reduction(f32, dpl::reduce_op::avg, "all_reduce"));
  CHECK_NOTHROW(dpl::nccl::check_reduction(i64, dpl::reduce_op::sum, "all_reduce"));
  CHECK_THROWS_WITH(dpl::nccl::check_reduction(i64, dpl::reduce_op::avg, "all_reduce"),
                    Catch::Contains("avg needs a floating dtype") && Catch::Contains("I64"));
  CHECK_THROWS_WITH(dpl::nccl::to_nccl(static_cast<dpl::dtype>(42)), Catch::Contains("unsupported dtype"));
  CHECK(dpl::nccl::to_nccl(dpl::dtype::bf16) == ncclBfloat16);
  CHECK(dpl::nccl::to_nccl(dpl::dtype::f16) == ncclFloat16);
  std::vector<dpl::tensor_ref> bucket{f32, f32, i64};
  CHECK_THROWS_WITH(dpl::nccl::check_bucket(bucket, "DDP bucket 0"),
                    Catch::Contains("one dtype per bucket") && Catch::Contains("tensor 2"));
  CHECK_THROWS_WITH(dpl::nccl::make_groups({}), Catch::Contains("at least one GPU"));
  int const n = dpl::cuda::device_count();
  CHECK_THROWS_AS(dpl::nccl::make_groups({dpl::device{dpl::device_kind::cuda, n, 0}}), dpl::invalid_argument);
  if (n >= 1) {
    CHECK_THROWS_WITH(dpl::nccl::make_groups(dpl::cuda::logical_devices(2)), Catch::Contains("one rank per GPU"));
  }
}
#endif

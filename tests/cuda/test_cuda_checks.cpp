// CUDA and NCCL argument checks that need no GPU: they run everywhere (also on CI machines with
// the toolkit but no device), compiled by the host compiler against the add-ons' host headers.
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#include <dparallel/backend/cuda/topology.hpp>
#ifdef DPARALLEL_TEST_NCCL
#include <dparallel/comm/nccl.hpp>
#endif

#include <dparallel/dparallel.hpp>

#include "../models.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <cstring>
#include <span>
#include <tuple>

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

TEST_CASE("transport between logical devices: lanes of one GPU in place, distinct GPUs by peer copies",
          "[cuda][checks][topology]") {
  using dpl::cuda::transport;
  CHECK(dpl::cuda::choose_transport(0, 0, false) == transport::same_gpu);
  CHECK(dpl::cuda::choose_transport(3, 3, true) == transport::same_gpu);
  CHECK(dpl::cuda::choose_transport(0, 1, true) == transport::peer);
  CHECK(dpl::cuda::choose_transport(1, 0, false) == transport::copy);
  CHECK_FALSE(dpl::cuda::needs_staging(2, 2));
  CHECK(dpl::cuda::needs_staging(0, 1));
  CHECK(dpl::cuda::needs_staging(1, 0));
}

TEST_CASE("staging plan: other GPUs' and host views get aligned disjoint slots, local views none",
          "[cuda][checks][topology]") {
  using plan = dpl::cuda::staging_plan;
  constexpr std::size_t a = dpl::cuda::staging_alignment;
  std::vector<int> const where{0, 1, -1, 0, 2, 1};
  std::vector<std::size_t> const bytes{100, 4, 300, 8, 0, a};
  plan p;
  dpl::cuda::plan_staging(0, where, bytes, p);
  REQUIRE(p.offset.size() == where.size());
  CHECK(p.offset[0] == plan::npos);  // local
  CHECK(p.offset[1] == 0);           // GPU 1
  CHECK(p.offset[2] == a);           // host: after GPU 1's 4 bytes, rounded up
  CHECK(p.offset[3] == plan::npos);  // local
  CHECK(p.offset[4] == plan::npos);  // empty: nothing to copy
  CHECK(p.offset[5] == 3 * a);       // 300 bytes took two slots
  CHECK(p.bytes == 4 * a);
  for (std::size_t i = 0; i < where.size(); ++i)
    if (p.offset[i] != plan::npos) CHECK(p.offset[i] % a == 0);
  // Seen from GPU 1: its own views are read in place, GPU 0's are staged.
  dpl::cuda::plan_staging(1, where, bytes, p);
  CHECK(p.offset[0] == 0);
  CHECK(p.offset[1] == plan::npos);
  CHECK(p.offset[5] == plan::npos);
  CHECK(p.bytes == a + 2 * a + a);
  // A plan is refilled in place.
  dpl::cuda::plan_staging(0, std::vector<int>{0}, std::vector<std::size_t>{64}, p);
  CHECK(p.offset == std::vector<std::size_t>{plan::npos});
  CHECK(p.bytes == 0);
}

namespace {
/// host::backend plus a scatter hook like cuda::backend's: every view of a shard is copied into
/// memory of the shard's device (one store per device, reused step after step).
struct moving_backend : dpl::host::backend {
  static inline std::array<std::vector<std::byte>, 8> store;
  static void place_shard(stream_type& s, std::span<dpl::tensor_ref> views) {
    auto& mine = store.at(static_cast<std::size_t>(s.device_index()));
    std::size_t bytes = 0;
    for (auto const& v : views) bytes += v.size_bytes();
    mine.resize(bytes);
    std::size_t at = 0;
    for (auto& v : views) {
      std::memcpy(mine.data() + at, v.data(), v.size_bytes());
      v = dpl::tensor_ref(mine.data() + at, v.size(), v.dtype(), dpl::device{dpl::device_kind::host, s.device_index()});
      at += v.size_bytes();
    }
  }
  static bool owns(void const* p, int dev) {
    auto const& mine = store.at(static_cast<std::size_t>(dev));
    auto const* b = static_cast<std::byte const*>(p);
    return b >= mine.data() && b < mine.data() + mine.size();
  }
};
static_assert(dpl::detail::places_shards<moving_backend>);
static_assert(!dpl::detail::places_shards<dpl::host::backend>);
}  // namespace

TEST_CASE("DataParallel's scatter hook hands each step function its shard in its device's memory",
          "[cuda][checks][scatter]") {
  using model = test::linreg<double>;
  for (int n : {1, 2, 3}) {
    auto const data = test::dataset<double>::make(13, 4, 5, false);
    model master(4, 7), alone(4, 7);
    alone.forward_backward(data.all());
    dpl::parallel<model, dpl::dp, moving_backend> dp(master, dpl::host::devices(n));
    std::vector<int> moved(static_cast<std::size_t>(n), -1);
    dp.step(data.all(), [&](model& m, test::samples<double> shard, dpl::step_context& ctx) {
      int const d = ctx.device().index;
      moved[static_cast<std::size_t>(ctx.replica())] =
          moving_backend::owns(shard.x.data(), d) && moving_backend::owns(shard.y.data(), d) &&
          shard.x.device() == ctx.device() && shard.x.rows() == ctx.shard_size();
      return m.forward_backward(shard);
    });
    INFO("devices = " << n);
    CHECK(moved == std::vector<int>(static_cast<std::size_t>(n), 1));
    CHECK(dpl::gradient_refs(master).size() == dpl::gradient_refs(alone).size());
    CHECK(test::rel_error(master.gw, alone.gw) <= 1e-12);
    CHECK(test::rel_error(master.gb, alone.gb) <= 1e-12);
  }
  // Tuples and pairs of views are moved member by member; other members are left as they are.
  auto const data = test::dataset<double>::make(6, 2, 9, false);
  std::vector<int> tags(6, 1);
  std::tuple<dpl::tensor_view<double const>, std::span<int const>> batch{data.all().x, std::span<int const>(tags)};
  auto shard = dpl::detail::place_shard<moving_backend>(*std::make_unique<dpl::host::stream>(2),
                                                        dpl::slice_batch(batch, 1, 4));
  CHECK(moving_backend::owns(std::get<0>(shard).data(), 2));
  CHECK(std::get<0>(shard).rows() == 3);
  CHECK(std::get<0>(shard)[0] == data.x[2]);  // row 1 of a 2-wide batch
  CHECK(std::get<1>(shard).data() == tags.data() + 1);
}

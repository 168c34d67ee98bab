// The CUDA backend on a GPU: the DataParallel contracts of tests/dp_contracts.hpp instantiated for
// cuda::backend (2-4 logical devices on one GPU, or distinct GPUs), the kernels against the host
// kernels, the stream/event semantics, the pointer checks, and DDP over NCCL thread ranks when
// there are two GPUs or more. Without a GPU every test reports skipped (gpu_main.cpp).
#include "../dp_contracts.hpp"
#include "../threads.hpp"
#include "cuda_linreg.cuh"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/backend/cuda/loader_stage.hpp>
#include <dparallel/dparallel.hpp>
#ifdef DPARALLEL_TEST_NCCL
#include <dparallel/comm/nccl.hpp>
#include <dparallel/policy/nccl.hpp>
#endif

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace dpl = dparallel;
using gpu = dpl::cuda::backend;
// DataParallel on GPUs: whole tensors per replica on its own stream, one slice per device
// (core/dp_plan.hpp; the plans and the policies' use of them are tested on the host).
static_assert(dpl::detail::dp_sharing_of<gpu>() == dpl::dp_sharing::per_device);

namespace test {
template <class T>
struct model_of<gpu, T> {
  using type = cuda_linreg<T>;
};
template <>
std::vector<std::byte> read_back<gpu>(dpl::tensor_ref t) {
  std::vector<std::byte> out(t.size_bytes());
  // The view's own GPU current: cudaDeviceSynchronize waits for the current device only, and its
  // pool memory need not be accessible from any other.
  dpl::cuda::device_guard on(t.device().index);
  dpl::cuda::check(cudaDeviceSynchronize(), "read_back");
  if (!out.empty()) dpl::cuda::check(cudaMemcpy(out.data(), t.data(), out.size(), cudaMemcpyDefault), "read_back");
  return out;
}
/// n logical devices: one per GPU when there are enough GPUs, else lanes of GPU 0.
template <>
std::vector<dpl::device> devices<gpu>(int n) {
  return dpl::cuda::device_count() >= n ? dpl::cuda::devices(n) : dpl::cuda::logical_devices(n, 0);
}
}  // namespace test

TEST_CASE("CUDA DP gives the one-device gradient on random data", "[cuda][dp][contract]") {
  for (int n = 1; n <= 4; ++n)
    for (std::size_t b : {std::size_t{1}, std::size_t{7}, std::size_t{64}, std::size_t{65}}) {
      test::check_same_gradients<gpu, float>(n, b, false);
      test::check_same_gradients<gpu, double>(n, b, false);
    }
}

TEST_CASE("CUDA DP gives exactly the one-device gradient when the sums are exact", "[cuda][dp][contract]") {
  for (int n : {1, 2, 4})
    for (std::size_t b : {std::size_t(n), std::size_t{64}}) test::check_same_gradients<gpu, float>(n, b, true);
}

TEST_CASE("CUDA DP chunking options keep the gradient", "[cuda][dp][contract]") {
  test::check_same_gradients<gpu, double>(3, 10, false, {.chunking = dpl::chunking::even});
  test::check_same_gradients<gpu, double>(3, 10, false, {.chunking = dpl::chunking::sizes, .chunk_sizes = {0, 4, 6}});
}

TEST_CASE("CUDA DP training is bitwise reproducible", "[cuda][dp][contract]") {
  for (int n : {2, 3}) CHECK(test::train_steps<gpu, float>(n, 6) == test::train_steps<gpu, float>(n, 6));
}

namespace {
template <class T>
std::vector<T> download(dpl::cuda::device_buffer<T> const& b) {
  std::vector<T> out(b.size());
  dpl::cuda::check(cudaDeviceSynchronize(), "download");
  dpl::cuda::check(cudaMemcpy(out.data(), b.data(), b.size() * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return out;
}
template <class T>
dpl::cuda::device_buffer<T> upload(std::vector<T> const& v) {
  dpl::cuda::device_buffer<T> b(v.size(), dpl::device{dpl::device_kind::cuda, 0, 0});
  dpl::cuda::check(cudaMemcpy(b.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return b;
}
}  // namespace

namespace {
/// Keeps GPU `ordinal` busy for about `ms` milliseconds (at 1-2 GHz) on `s`.
__global__ void spin(long long cycles) {
  long long const t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
void busy(cudaStream_t s, int ms) {
  spin<<<1, 1, 0, s>>>(static_cast<long long>(ms) * 1'500'000);
  dpl::cuda::check(cudaGetLastError(), "spin");
}

/// DataParallel over `devs` on a batch that lives in GPU memory (`on_gpu`) or in host memory: the
/// gradient equals one device's on the whole batch, and every step function received its shard in
/// the memory of its own GPU.
template <class T>
void check_dp_moves_shards(std::vector<dpl::device> const& devs, std::size_t b, bool on_gpu) {
  using model = test::cuda_linreg<T>;
  INFO("devices = " << devs.size() << ", batch = " << b << ", batch on the GPU = " << on_gpu);
  auto const data = test::dataset<T>::make(b, 4, 77 + b, true);
  model ref(4, 7);
  ref.forward_backward(data.all());
  auto const want = test::flat_on<gpu>(ref, true);
  dpl::device const home{dpl::device_kind::cuda, 0, 0};
  dpl::cuda::device_buffer<T> x, y;
  test::samples<T> batch = data.all();
  if (on_gpu) {
    x = upload(data.x);
    y = upload(data.y);
    batch = test::samples<T>{dpl::tensor_view<T const>(x.data(), x.size(), b, home),
                             dpl::tensor_view<T const>(y.data(), y.size(), b, home)};
  }
  model master(4, 7);
  dpl::parallel<model, dpl::dp, gpu> dp(master, devs);
  std::vector<int> placed(devs.size(), -1);
  std::vector<double> first;
  for (int round = 0; round < 2; ++round) {  // the second step reuses the shard buffers
    dp.step(batch, [&](model& m, test::samples<T> shard, dpl::step_context& ctx) {
      bool const own = shard.x.device().kind == dpl::device_kind::cuda &&
                       dpl::cuda::pointer_ordinal(shard.x.data()) == ctx.device().index &&
                       dpl::cuda::pointer_ordinal(shard.y.data()) == ctx.device().index;
      placed[static_cast<std::size_t>(ctx.replica())] = own ? 1 : 0;
      return m.forward_backward(shard);
    });
    for (std::size_t i = 0; i < devs.size(); ++i)
      if (dp.last_shard_sizes()[i] != 0) CHECK(placed[i] == 1);
    auto const got = test::flat_on<gpu>(master, true);
    CHECK(test::rel_error(got, want) <= 1e-6);
    if (round == 0) first = got;
    else CHECK(got == first);  // the same step again, through the reused buffers: the same bits
  }
}
}  // namespace

TEST_CASE("CUDA DP over lanes of one GPU moves host and device batches to each lane", "[cuda][dp][scatter]") {
  for (int n : {2, 3, 4})
    for (std::size_t b : {std::size_t{5}, std::size_t{64}})
      for (bool on_gpu : {false, true}) {
        check_dp_moves_shards<float>(dpl::cuda::logical_devices(n, 0), b, on_gpu);
        check_dp_moves_shards<double>(dpl::cuda::logical_devices(n, 0), b, on_gpu);
      }
}

TEST_CASE("CUDA DP over distinct GPUs copies shards and gradient slices between them", "[cuda][dp][scatter][multi]") {
  int const gpus = dpl::cuda::device_count();
  if (gpus < 2) {
    WARN("one GPU: DataParallel over distinct GPUs is not exercised (lanes of one GPU are)");
    return;
  }
  for (int n = 2; n <= std::min(gpus, 4); ++n)
    for (bool on_gpu : {false, true}) check_dp_moves_shards<float>(dpl::cuda::devices(n), 64, on_gpu);
  // Two lanes on each of two GPUs: in place within a GPU, copies across.
  std::vector<dpl::device> const mixed{{dpl::device_kind::cuda, 0, 0}, {dpl::device_kind::cuda, 1, 0},
                                       {dpl::device_kind::cuda, 0, 1}, {dpl::device_kind::cuda, 1, 1}};
  check_dp_moves_shards<double>(mixed, 65, true);
}

TEST_CASE("CUDA weighted_sum specialised on 1-8 sources and the generic loop agree with the host", "[cuda][kernels]") {
  dpl::device const d{dpl::device_kind::cuda, 0, 0};
  std::size_t const n = 4099;  // a tail after the 16-byte packs
  for (std::size_t sources : {std::size_t{4}, std::size_t{6}, std::size_t{7}, std::size_t{9}, std::size_t{32}}) {
    for (std::size_t shift : {std::size_t{0}, std::size_t{4}}) {  // 16-byte aligned, then not
      test::rng g{sources * 7 + shift};
      std::vector<std::vector<double>> hs;
      std::vector<double> w;
      std::vector<dpl::cuda::device_buffer<double>> ds;
      std::vector<dpl::tensor_ref> dsrc, hsrc;
      for (std::size_t k = 0; k < sources; ++k) {
        std::vector<double> v(n + shift);
        for (auto& x : v) x = g.uniform() * 2 - 1;
        hs.push_back(v);
        w.push_back(g.uniform());
      }
      for (auto& v : hs) {
        ds.push_back(upload(v));
        dsrc.push_back(dpl::tensor_ref(ds.back().data() + shift, n, dpl::dtype::f64, d));
        hsrc.push_back(dpl::tensor_ref(v.data() + shift, n, dpl::dtype::f64));
      }
      std::vector<double> hout(n);
      dpl::host::weighted_sum(dpl::view(hout), hsrc, w);
      dpl::cuda::device_buffer<double> dout(n + shift, d);
      dpl::cuda::weighted_sum(nullptr, d, dpl::tensor_ref(dout.data() + shift, n, dpl::dtype::f64, d), dsrc, w);
      auto got = download(dout);
      got.erase(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(shift));
      INFO("sources = " << sources << ", shift = " << shift);
      CHECK(got == hout);
    }
  }
}

TEST_CASE("CUDA weighted_sums batches many sums into few launches, each equal to the host's", "[cuda][kernels]") {
  // More sums than one launch's table holds (so it is refilled), of lengths and alignments that
  // mix 16-byte packs, tails and misaligned entries, as the slices of a DP reduce do.
  dpl::device const d{dpl::device_kind::cuda, 0, 0};
  constexpr std::size_t m = 3, sums = 300;
  test::rng g{42};
  std::vector<std::size_t> off{0}, len;
  for (std::size_t j = 0; j < sums; ++j) {
    len.push_back(j % 7 == 0 ? 0 : 1 + (j * 13) % 29);
    off.push_back(off.back() + len.back() + j % 3);  // gaps: some slices start off 16-byte alignment
  }
  std::vector<std::vector<double>> hs(m, std::vector<double>(off.back()));
  std::vector<double> w;
  for (auto& v : hs)
    for (auto& x : v) x = g.uniform() * 2 - 1;
  for (std::size_t k = 0; k < m; ++k) w.push_back(g.uniform());
  std::vector<dpl::cuda::device_buffer<double>> ds;
  for (auto& v : hs) ds.push_back(upload(v));
  dpl::cuda::device_buffer<double> dout(off.back(), d);
  std::vector<double> expect(off.back(), 0.0);
  std::vector<dpl::tensor_ref> dst, src;
  for (std::size_t j = 0; j < sums; ++j) {
    dst.push_back(dpl::tensor_ref(dout.data() + off[j], len[j], dpl::dtype::f64, d));
    std::vector<dpl::tensor_ref> hsrc;
    for (std::size_t k = 0; k < m; ++k) {
      src.push_back(dpl::tensor_ref(ds[k].data() + off[j], len[j], dpl::dtype::f64, d));
      hsrc.push_back(dpl::tensor_ref(hs[k].data() + off[j], len[j], dpl::dtype::f64));
    }
    dpl::host::weighted_sum(dpl::tensor_ref(expect.data() + off[j], len[j], dpl::dtype::f64), hsrc, w);
  }
  dpl::cuda::zero(nullptr, d, dout.view());
  dpl::cuda::weighted_sums(nullptr, d, dst, src, w);
  CHECK(download(dout) == expect);  // bitwise, gaps untouched (zero)
}

TEST_CASE("CUDA kernels equal the host kernels bit for bit (float and double) at any length and alignment",
          "[cuda][kernels]") {
  dpl::device const d{dpl::device_kind::cuda, 0, 0};
  for (std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{1000}, std::size_t{100003}}) {
    for (std::size_t sources : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{5}, std::size_t{8}}) {
      test::rng g{n * 31 + sources};
      std::vector<std::vector<float>> hs;
      std::vector<double> w;
      for (std::size_t k = 0; k < sources; ++k) {
        std::vector<float> v(n + 1);  // +1: offset views below are misaligned for vector loads
        for (auto& x : v) x = static_cast<float>(g.uniform() * 2 - 1);
        hs.push_back(v);
        w.push_back(g.uniform());
      }
      std::vector<dpl::cuda::device_buffer<float>> ds;
      std::vector<dpl::tensor_ref> dsrc, hsrc;
      for (auto& v : hs) {
        ds.push_back(upload(v));
        dsrc.push_back(dpl::tensor_ref(ds.back().data() + 1, n, dpl::dtype::f32, d));
        hsrc.push_back(dpl::tensor_ref(v.data() + 1, n, dpl::dtype::f32));
      }
      std::vector<float> hout(n);
      dpl::host::weighted_sum(dpl::view(hout), hsrc, w);
      dpl::cuda::device_buffer<float> dout(n, d);
      dpl::cuda::weighted_sum(nullptr, d, dout.view(), dsrc, w);
      INFO("n = " << n << ", sources = " << sources);
      CHECK(download(dout) == hout);
    }
    std::vector<double> a(n), b(n);
    test::rng g{n};
    for (auto& x : a) x = g.uniform();
    for (auto& x : b) x = g.uniform();
    auto da = upload(a);
    auto db = upload(b);
    dpl::host::add_scaled(dpl::view(a), dpl::view(b), 0.3);
    dpl::cuda::add_scaled(nullptr, d, da.view(), db.view(), 0.3);
    CHECK(download(da) == a);
    dpl::host::scale(dpl::view(a), 1.0 / 3.0);
    dpl::cuda::scale(nullptr, d, da.view(), 1.0 / 3.0);
    CHECK(download(da) == a);
  }
}

TEST_CASE("CUDA half types accumulate in float", "[cuda][kernels]") {
  dpl::device const d{dpl::device_kind::cuda, 0, 0};
  std::size_t const n = 4097;
  std::vector<__half> x(n), y(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = __float2half(static_cast<float>(i % 17) * 0.25f);
    y[i] = __float2half(static_cast<float>(i % 5) * 0.5f);
  }
  auto dx = upload(x);
  auto dy = upload(y);
  std::vector<dpl::tensor_ref> src{dx.view(), dy.view()};
  std::vector<double> w{0.5, 0.5};
  dpl::cuda::device_buffer<__half> out(n, d);
  dpl::cuda::weighted_sum(nullptr, d, out.view(), src, w);
  auto const got = download(out);
  for (std::size_t i = 0; i < n; ++i) {
    float const want = 0.5f * __half2float(x[i]) + 0.5f * __half2float(y[i]);
    REQUIRE(__half2float(got[i]) == __half2float(__float2half(want)));
  }
}

TEST_CASE("CUDA streams order work across logical devices and report errors at synchronize", "[cuda][stream]") {
  auto const devs = dpl::cuda::logical_devices(2, 0);
  dpl::cuda::stream a(devs[0]), b(devs[1]);
  dpl::cuda::device_buffer<float> buf(1 << 20, devs[0]);
  a.wait_for_legacy_stream();  // buf was allocated and zeroed on the legacy stream
  std::vector<float> ones(1 << 20, 1.0f);
  auto const filled = a.enqueue([&] {
    dpl::cuda::copy(dpl::cuda::current_stream(), devs[0], buf.view(), dpl::tensor_ref(ones.data(), ones.size(), dpl::dtype::f32));
  });
  b.wait(filled);
  b.enqueue([&] { dpl::cuda::scale(dpl::cuda::current_stream(), devs[1], buf.view(), 2.0); });
  b.synchronize();
  auto const got = download(buf);
  CHECK(got.front() == 2.0f);
  CHECK(got.back() == 2.0f);
  a.enqueue([] { throw std::runtime_error("boom"); });
  CHECK_THROWS_WITH(a.synchronize(), Catch::Contains("boom") && Catch::Contains("device 0"));
  a.synchronize();  // cleared
}

TEST_CASE("CUDA held stream: synchronize_here launches on the caller, in order, and leaves its current GPU",
          "[cuda][stream]") {
  int const gpus = dpl::cuda::device_count();
  int const mine = gpus - 1;  // the caller's own GPU; the stream's is GPU 0
  dpl::cuda::check(cudaSetDevice(mine), "cudaSetDevice");
  auto const devs = dpl::cuda::logical_devices(2, 0);
  dpl::cuda::stream a(devs[0]), b(devs[1]);
  dpl::cuda::device_buffer<float> buf(1 << 16, devs[0]);
  a.wait_for_legacy_stream();  // buf was allocated and zeroed on the legacy stream
  std::vector<float> ones(1 << 16, 1.0f);
  std::thread::id ran_on;
  int current_inside = -1;
  a.hold();
  a.enqueue([&] {
    ran_on = std::this_thread::get_id();
    (void)cudaGetDevice(&current_inside);
    dpl::cuda::copy(dpl::cuda::current_stream(), devs[0], buf.view(), dpl::tensor_ref(ones.data(), ones.size(), dpl::dtype::f32));
  });
  auto const tripled = a.enqueue([&] { dpl::cuda::scale(dpl::cuda::current_stream(), devs[0], buf.view(), 3.0); });
  b.wait(tripled);  // another stream may wait for held work: it runs once the caller launches it
  b.enqueue([&] { dpl::cuda::scale(dpl::cuda::current_stream(), devs[1], buf.view(), 2.0); });
  a.synchronize_here();
  CHECK(ran_on == std::this_thread::get_id());
  CHECK(current_inside == 0);
  int after = -1;
  (void)cudaGetDevice(&after);
  CHECK(after == mine);
  b.synchronize();
  auto const got = download(buf);
  // In order: the copy and the scale on a, then b's scale after them.
  CHECK(got.front() == 6.0f);
  CHECK(got.back() == 6.0f);
  // A held stream's error is reported by synchronize_here and cleared.
  a.hold();
  a.enqueue([] { throw std::runtime_error("boom"); });
  CHECK_THROWS_WITH(a.synchronize_here(), Catch::Contains("boom") && Catch::Contains("device 0"));
  a.synchronize_here();
  dpl::cuda::check(cudaSetDevice(0), "cudaSetDevice");
}

TEST_CASE("CUDA bad input: views on the wrong device and ordinals beyond the count", "[cuda][errors]") {
  int const n = dpl::cuda::device_count();
  CHECK_THROWS_WITH(dpl::cuda::check_device(dpl::device{dpl::device_kind::cuda, n, 0}),
                    Catch::Contains("GPU(s) are visible"));
  std::vector<float> host(8);
  // Host memory that claims to be on GPU 0.
  dpl::tensor_ref const liar(host.data(), host.size(), dpl::dtype::f32, dpl::device{dpl::device_kind::cuda, 0, 0});
  CHECK_THROWS_WITH(dpl::cuda::check_pointer(liar, "the parameter"), Catch::Contains("is host memory"));
  dpl::cuda::device_buffer<float> on0(8, dpl::device{dpl::device_kind::cuda, 0, 0});
  if (n >= 2) {
    dpl::tensor_ref const wrong(on0.data(), 8, dpl::dtype::f32, dpl::device{dpl::device_kind::cuda, 1, 0});
    CHECK_THROWS_WITH(dpl::cuda::check_pointer(wrong, "the parameter"), Catch::Contains("lives on GPU 0"));
  }
  // A model whose parameters are host memory cannot be wrapped for the CUDA backend.
  test::linreg<float> host_model;
  CHECK_THROWS_AS((dpl::parallel<test::linreg<float>, dpl::dp, gpu>(host_model, dpl::cuda::logical_devices(2))),
                  dpl::invalid_argument);
}

#ifdef DPARALLEL_TEST_NCCL
TEST_CASE("CUDA DP with NCCL broadcast and reduce gives the one-device gradient (lanes of one GPU fall back)",
          "[cuda][nccl][dp][contract]") {
  for (int n = 1; n <= 4; ++n)
    for (std::size_t b : {std::size_t{1}, std::size_t{7}, std::size_t{64}}) {
      test::check_same_gradients<gpu, double, dpl::nccl::dp>(n, b, false);
      test::check_same_gradients<gpu, float, dpl::nccl::dp>(n, b, false);
    }
}

TEST_CASE("CUDA DDP over NCCL thread ranks equals one device on the global batch", "[cuda][nccl][ddp]") {
  int const world = dpl::cuda::device_count();
  if (world < 2) {
    WARN("one GPU: NCCL needs a GPU per rank; DDP over NCCL thread ranks is not exercised");
    return;
  }
  // Equal shards of about 64 rows for any GPU count; the reference reads exactly their rows.
  std::size_t const per = std::max<std::size_t>(1, 64 / static_cast<std::size_t>(world));
  std::size_t const rows = per * static_cast<std::size_t>(world);
  auto const data = test::dataset<double>::make(rows, 4, 11, true);
  test::cuda_linreg<double> ref(4, 7);
  ref.forward_backward(data.all());
  auto const want = test::flat_on<gpu>(ref, true);
  // Rank r on GPU world - 1 - r (as make_groups({cuda:1, cuda:0})): DDP's default device must be
  // the communicator's GPU, not GPU r.
  std::vector<dpl::device> gpus = dpl::cuda::devices(world);
  std::reverse(gpus.begin(), gpus.end());
  auto groups = dpl::nccl::make_groups(gpus);
  std::vector<std::vector<double>> got(static_cast<std::size_t>(world));
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<dpl::device> used(static_cast<std::size_t>(world));
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      auto const i = static_cast<std::size_t>(r);
      try {
        dpl::device const d = gpus[i];
        test::cuda_linreg<double> m(4, 7, d);
        dpl::parallel<test::cuda_linreg<double>, dpl::ddp, gpu> ddp(m, groups[i]);  // default device
        used[i] = ddp.devices().at(0);
        auto const lo = i * per;
        test::samples<double> mine{data.all().x.slice_rows(lo, lo + per), data.all().y.slice_rows(lo, lo + per)};
        ddp.step(mine, [](auto& model, test::samples<double> s) { return model.forward_backward(s); });
        got[i] = test::flat_on<gpu>(m, true);
      } catch (std::exception const& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < world; ++r) {
    auto const i = static_cast<std::size_t>(r);
    INFO("rank " << r << ": " << errors[i]);
    CHECK(errors[i].empty());
    CHECK(used[i] == gpus[i]);
    CHECK(test::rel_error(got[i], want) <= 1e-12);
    CHECK(got[i] == got[0]);
  }
}
#endif

TEST_CASE("CUDA loader stage: batches reach the GPU through pinned memory in order for 0 and 2 workers",
          "[cuda][loader]") {
  // The legacy stream is kept busy meanwhile: a batch zeroed there after its copy (the stage once
  // did that) would come out as zeros; the stage allocates and copies on its own stream only.
  for (int i = 0; i < 8; ++i) busy(nullptr, 25);
  std::vector<std::size_t> order(40);
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = (i * 7) % order.size();
  auto const make = [](std::span<std::size_t const> idx) {
    std::vector<float> b;
    for (std::size_t i : idx) b.push_back(static_cast<float>(i) * 0.5f);
    return b;
  };
  auto const want = [&](std::size_t k) {
    return make(std::span<std::size_t const>(order).subspan(k * 6, std::min<std::size_t>(6, order.size() - k * 6)));
  };
  for (std::size_t workers : {std::size_t{0}, std::size_t{2}}) {
    INFO(workers << " workers");
    std::vector<dpl::cuda::device_batch<float>> kept;
    {
      dpl::loader batches(order, 6, make, {.num_workers = workers},
                          dpl::cuda::to_device{dpl::device{dpl::device_kind::cuda, 0, 0}});
      std::size_t k = 0;
      for (auto& b : batches) {
        busy(nullptr, 10);
        CHECK(b.view().device() == dpl::device{dpl::device_kind::cuda, 0, 0});
        CHECK(download(b.data) == want(k));
        kept.push_back(std::move(b));
        ++k;
      }
      CHECK(k == batches.size());
    }
    // The loader and its workers (and their copy streams) are gone: the batches are still whole,
    // and freeing them is safe (it once used a destroyed stream: a crash on the first GPU run).
    for (std::size_t k = 0; k < kept.size(); ++k) CHECK(download(kept[k].data) == want(k));
    kept.clear();
    dpl::cuda::check(cudaDeviceSynchronize(), "loader test");
  }
}

TEST_CASE("CUDA device_guard leaves a thread without a context on the GPU it chose", "[cuda][device]") {
  int const gpus = dpl::cuda::device_count();
  int const target = gpus - 1;  // GPU 1 when there are two or more: then GPU 0 must stay untouched
  int after = -1;
  bool before_context = true, after_context = false;
  std::thread([&] {
    before_context = dpl::cuda::detail::has_current_context();
    { dpl::cuda::device_guard g(target); }
    after_context = dpl::cuda::detail::has_current_context();
    (void)cudaGetDevice(&after);
  }).join();
  CHECK_FALSE(before_context);
  CHECK(after_context);
  CHECK(after == target);  // not "restored" to the device 0 that cudaGetDevice reported before
  // A thread that chose a device gets it back.
  std::thread([&] {
    dpl::cuda::check(cudaSetDevice(target), "cudaSetDevice");
    { dpl::cuda::device_guard g(0); }
    (void)cudaGetDevice(&after);
  }).join();
  CHECK(after == target);
}

TEST_CASE("CUDA stream events are recorded on the stream's GPU whatever the work left current", "[cuda][stream]") {
  int const gpus = dpl::cuda::device_count();
  dpl::cuda::stream s(dpl::device{dpl::device_kind::cuda, 0, 0});
  auto const e = s.enqueue([gpus] { dpl::cuda::check(cudaSetDevice(gpus - 1), "cudaSetDevice"); });
  CHECK_NOTHROW(e.wait());
  auto const timed = s.enqueue_timed([] { busy(dpl::cuda::current_stream(), 5); });
  s.synchronize();
  REQUIRE(timed.gpu_elapsed().has_value());
  CHECK(timed.gpu_elapsed()->count() > 0);
  CHECK_FALSE(e.gpu_elapsed().has_value());  // untimed work has no GPU time
}

TEST_CASE("CUDA buffers come from dparallel's own pool, the GPU's default pool keeps its settings", "[cuda][memory]") {
  auto const attr = [](cudaMemPool_t p, cudaMemPoolAttr a) {
    std::uint64_t v = 0;
    dpl::cuda::check(cudaMemPoolGetAttribute(p, a, &v), "cudaMemPoolGetAttribute");
    return v;
  };
  cudaMemPool_t shared = nullptr;
  dpl::cuda::check(cudaDeviceGetDefaultMemPool(&shared, 0), "cudaDeviceGetDefaultMemPool");
  std::uint64_t const threshold = attr(shared, cudaMemPoolAttrReleaseThreshold);
  std::uint64_t const shared_used = attr(shared, cudaMemPoolAttrUsedMemCurrent);
  dpl::device const gpu0{dpl::device_kind::cuda, 0, 0};
  cudaMemPool_t const own = dpl::cuda::own_pool(0);
  REQUIRE(own != nullptr);
  CHECK(own != shared);
  CHECK(attr(own, cudaMemPoolAttrReleaseThreshold) == UINT64_MAX);
  std::uint64_t const used = attr(own, cudaMemPoolAttrUsedMemCurrent);
  {
    dpl::cuda::stream s(gpu0);
    dpl::cuda::device_buffer<float> b(std::size_t{1} << 20, gpu0);
    dpl::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    CHECK(attr(own, cudaMemPoolAttrUsedMemCurrent) >= used + (std::size_t{4} << 20));
    CHECK(attr(shared, cudaMemPoolAttrUsedMemCurrent) == shared_used);
  }
  dpl::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  CHECK(attr(shared, cudaMemPoolAttrReleaseThreshold) == threshold);  // not raised for every user of the GPU
  std::uint64_t const kept = attr(own, cudaMemPoolAttrReservedMemCurrent);
  CHECK(kept >= (std::size_t{4} << 20));  // freed, still mapped for the next allocation
  dpl::cuda::trim_pool_memory(0);
  CHECK(attr(own, cudaMemPoolAttrReservedMemCurrent) < kept);
}

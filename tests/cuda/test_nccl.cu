// The NCCL communicator on ONE GPU: a world-size-1 NCCL group (ncclCommInitAll over cuda:0)
// exercises everything but the network: barriers, host staging of each side, the ordering after
// the issuing thread's GPU work, a DDP step, abort. Without a GPU every test reports skipped
// (gpu_main.cpp). The host-testable parts (the poll engine, the staging plan) are tested on the
// host in tests/test_comm_progress.cpp. Two thread ranks on the one GPU only where NCCL allows it
// (>= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1), else the refusal naming the version.
//
// Subgroups and the hierarchical all_reduce over NCCL (at the end): over thread ranks, one per
// GPU (one rank on a machine with one GPU), and, in the hidden test "[nccl-ranks]", over this
// process's rank of a launched job, e.g. two processes on ONE GPU (each its own NCCL_HOSTID):
//   for r in 0 1; do
//     RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533
//       NCCL_HOSTID=dparallel-rank-$r NCCL_SOCKET_IFNAME=lo test_nccl "[nccl-ranks]" &   (one command)
//   done; wait
// The plan (who lands in which subgroup, in which order, and the checks of the requests) is the
// engines' shared code, tested on the host (tests/test_subgroups.cpp, test_hierarchical.cpp).
#include "cuda_linreg.cuh"

#include <dparallel/backend/cuda/backend.hpp>
#include <dparallel/policy/cuda/compress_hooks.hpp>
#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/hierarchical.hpp>
#include <dparallel/comm/nccl.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/policy/compress_hooks.hpp>
#include <dparallel/policy/nccl.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace dpl = dparallel;
using gpu = dpl::cuda::backend;

namespace {

dpl::device const gpu0{dpl::device_kind::cuda, 0, 0};

dpl::process_group one_rank_group() { return dpl::nccl::make_groups({gpu0}).at(0); }

std::vector<float> iota_floats(std::size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

// A device copy of `host`, and a read-back of device memory.
dpl::cuda::device_buffer<float> on_gpu(std::vector<float> const& host) {
  dpl::cuda::device_buffer<float> d(host.size(), gpu0);
  dpl::cuda::check(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), "test");
  return d;
}
std::vector<float> from_gpu(float const* p, std::size_t n) {
  std::vector<float> out(n);
  dpl::cuda::check(cudaMemcpy(out.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), "test");
  return out;
}

std::vector<double> to_host(dpl::cuda::device_buffer<double> const& b) {
  std::vector<double> out(b.size());
  dpl::cuda::check(cudaMemcpy(out.data(), b.data(), b.size() * sizeof(double), cudaMemcpyDeviceToHost), "test");
  return out;
}

// Issues a barrier from a stack frame that is gone before the barrier completes (the old barrier
// staged a local int and wrote the result into it later).
dpl::work barrier_from_a_dead_frame(dpl::process_group const& g) {
  volatile int guard[64] = {};
  dpl::work w = g.barrier();
  (void)guard[0];
  return w;
}

}  // namespace

TEST_CASE("NCCL world size 1: 1000 barriers waited one by one and 1000 in flight", "[nccl][one-gpu]") {
  auto g = one_rank_group();
  for (int i = 0; i < 1000; ++i) g.barrier().wait();
  std::vector<dpl::work> ws;
  for (int i = 0; i < 1000; ++i) ws.push_back(barrier_from_a_dead_frame(g));
  for (auto& w : ws) w.wait();
  CHECK(g.completed_ops() == 2000);
}

TEST_CASE("NCCL world size 1: host-staged all_reduce in place", "[nccl][one-gpu][staging]") {
  auto g = one_rank_group();
  auto const want = iota_floats(1000, 0.5f);
  auto t = want;
  g.all_reduce(dpl::view(t), dpl::reduce_op::sum).wait();
  CHECK(t == want);
  g.all_reduce(dpl::view(t), dpl::reduce_op::avg).wait();
  CHECK(t == want);
}

TEST_CASE("NCCL world size 1: host-staged all_gather and reduce_scatter in place and out of place",
          "[nccl][one-gpu][staging]") {
  auto g = one_rank_group();
  auto in = iota_floats(4097, 1.0f);
  SECTION("all_gather out of place") {
    std::vector<float> out(in.size(), -1.0f);
    g.all_gather(dpl::view(out), dpl::view(in)).wait();
    CHECK(out == in);
  }
  SECTION("all_gather in place (in is block 0 of out: the old code overflowed its staging here)") {
    auto out = in;
    g.all_gather(dpl::view(out), dpl::tensor_view<float>(out.data(), out.size())).wait();
    CHECK(out == in);
  }
  SECTION("reduce_scatter out of place") {
    std::vector<float> out(in.size(), -1.0f);
    g.reduce_scatter(dpl::view(out), dpl::view(in), dpl::reduce_op::sum).wait();
    CHECK(out == in);
  }
  SECTION("broadcast") {
    auto t = in;
    g.broadcast(dpl::view(t), 0).wait();
    CHECK(t == in);
  }
}

TEST_CASE("NCCL world size 1: device in with host out and host in with device out", "[nccl][one-gpu][staging]") {
  auto g = one_rank_group();
  auto in = iota_floats(333, 2.0f);
  SECTION("device in, host out: only the output is staged") {
    auto const d = on_gpu(in);
    std::vector<float> out(in.size(), -1.0f);
    g.all_gather(dpl::view(out), d.view()).wait();
    CHECK(out == in);
  }
  SECTION("host in, device out: only the input is staged") {
    dpl::cuda::device_buffer<float> d(in.size(), gpu0);
    g.all_gather(d.view(), dpl::view(in)).wait();
    CHECK(from_gpu(d.data(), d.size()) == in);
  }
}

TEST_CASE("NCCL world size 1: a collective issued outside stream work runs after the caller's GPU work",
          "[nccl][one-gpu][ordering]") {
  // The caller fills a device buffer on the legacy default stream and issues at once (the DDP
  // constructor's broadcast does this): the collective must see the filled values.
  auto g = one_rank_group();
  std::size_t const n = std::size_t{1} << 22;
  dpl::cuda::device_buffer<float> d(n, gpu0);
  std::vector<float> ones(n, 1.0f);
  dpl::cuda::pinned_buffer<float> pinned(n);
  std::copy(ones.begin(), ones.end(), pinned.data());
  dpl::cuda::check(cudaMemcpyAsync(d.data(), pinned.data(), n * sizeof(float), cudaMemcpyHostToDevice, nullptr), "test");
  std::vector<float> out(n, 0.0f);
  g.all_gather(dpl::view(out), d.view()).wait();
  CHECK(out == ones);
}

TEST_CASE("NCCL world size 1: a DDP step equals the one-device gradient (plain and through the desync detector)",
          "[nccl][one-gpu][ddp]") {
  auto const data = test::dataset<double>::make(64, 4, 11, true);
  test::cuda_linreg<double> ref(4, 7);
  ref.forward_backward(data.all());
  dpl::cuda::check(cudaDeviceSynchronize(), "test");
  std::vector<double> const want_w = to_host(ref.gw), want_b = to_host(ref.gb);
  for (bool desync : {false, true}) {
    INFO("desync detection " << desync);
    auto g = one_rank_group();
    if (desync) g = dpl::with_desync_detection(g);
    test::cuda_linreg<double> m(4, 7, gpu0);
    dpl::parallel<test::cuda_linreg<double>, dpl::ddp, gpu> ddp(m, g, {.local_device = gpu0});
    ddp.step(data.all(), [](auto& model, test::samples<double> s) { return model.forward_backward(s); });
    dpl::cuda::check(cudaDeviceSynchronize(), "test");
    CHECK(to_host(m.gw) == want_w);
    CHECK(to_host(m.gb) == want_b);
  }
}

TEST_CASE("NCCL world size 1: abort with and without pending work", "[nccl][one-gpu][abort]") {
  SECTION("with pending work: every work completes, failed naming rank 0 and the reason, or done") {
    auto g = one_rank_group();
    dpl::cuda::device_buffer<float> big(std::size_t{1} << 24, gpu0);
    std::vector<dpl::work> ws;
    for (int i = 0; i < 32; ++i) ws.push_back(g.all_reduce(big.view(), dpl::reduce_op::sum));
    g.abort("test abort");
    int failed = 0;
    for (auto& w : ws) {
      REQUIRE(w.ready());  // abort() returns once every pending work completed
      try {
        w.wait();
      } catch (dpl::comm_error const& e) {
        ++failed;
        CHECK(e.rank() == 0);
        CHECK_THAT(e.what(), Catch::Contains("rank 0 aborted the process group: test abort"));
      }
    }
    INFO(failed << " of 32 collectives were pending at the abort");
    CHECK_THROWS_WITH(g.barrier().wait(), Catch::Contains("test abort"));
    CHECK(cudaDeviceSynchronize() == cudaSuccess);  // the abort left the GPU usable
  }
  SECTION("without pending work") {
    auto g = one_rank_group();
    g.barrier().wait();
    g.abort("nothing pending");
    CHECK_THROWS_AS(g.barrier().wait(), dpl::comm_error);
    std::vector<float> t(8, 1.0f);
    CHECK_THROWS_WITH(g.all_reduce(dpl::view(t)).wait(), Catch::Contains("nothing pending"));
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
  }
}

namespace {

// Three steps of a compression hook over one bucket of two parameters (600 and 401 elements,
// values that 16 bits cannot hold), `run(step, bucket)` giving the hook's result; every result.
template <class Run>
std::vector<std::vector<float>> three_steps(Run run) {
  std::vector<std::size_t> const params{0, 1}, offsets{0, 600}, sizes{600, 401};
  std::vector<std::vector<float>> out;
  for (int step = 0; step < 3; ++step) {
    std::vector<float> x(1001);
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(step)) * (1.0f + 1e-3f * static_cast<float>(i)) / 3.0f;
    out.push_back(run(x, params, offsets, sizes));
  }
  return out;
}

}  // namespace

TEST_CASE("NCCL world size 1: cuda::fp16_compress and bf16_compress give the host hooks' bits, with and without "
          "error feedback",
          "[nccl][one-gpu][hooks]") {
  for (bool feedback : {false, true}) {
    for (bool bf : {false, true}) {
      INFO((bf ? "bf16" : "fp16") << ", error feedback " << feedback);
      std::vector<std::vector<float>> host, dev;
      dpl::spawn(1, [&](dpl::rank_context& rank) {  // the host hook over a host group of one rank
        dpl::compress_state st{.error_feedback = feedback};
        host = three_steps([&](std::vector<float> x, auto const& p, auto const& o, auto const& s) {
          dpl::grad_bucket const b{0, dpl::tensor_ref(x.data(), x.size(), dpl::dtype::f32, dpl::host_memory), p, o, s};
          auto f = bf ? dpl::bf16_compress(st, rank.group(), b) : dpl::fp16_compress(st, rank.group(), b);
          auto const r = f.get();
          return std::vector<float>(static_cast<float const*>(r.data()), static_cast<float const*>(r.data()) + r.size());
        });
      });
      auto const g = one_rank_group();
      dpl::cuda::compress_state st{.error_feedback = feedback};
      dev = three_steps([&](std::vector<float> const& x, auto const& p, auto const& o, auto const& s) {
        auto d = on_gpu(x);
        dpl::grad_bucket const b{0, dpl::tensor_ref(d.data(), x.size(), dpl::dtype::f32, gpu0), p, o, s};
        auto f = bf ? dpl::cuda::bf16_compress(st, g, b) : dpl::cuda::fp16_compress(st, g, b);
        auto const r = f.get();
        dpl::cuda::check(cudaDeviceSynchronize(), "test");
        return from_gpu(static_cast<float const*>(r.data()), r.size());
      });
      REQUIRE(dev.size() == host.size());
      for (std::size_t k = 0; k < host.size(); ++k) {
        INFO("step " << k);
        CHECK(dev[k] == host[k]);  // bitwise: one rank's average is its own 16-bit values
        CHECK(host[k] != three_steps([](std::vector<float> x, auto const&, auto const&, auto const&) { return x; })[k]);
      }
    }
  }
}

TEST_CASE("NCCL thread ranks share one GPU only with the tests' opt-in, on an NCCL that can", "[nccl][one-gpu][shared-gpu]") {
  CHECK(one_rank_group().bound_device() == std::optional<dpl::device>(gpu0));  // DDP's default device
  CHECK_THROWS_WITH(dpl::nccl::make_groups({gpu0, gpu0}), Catch::Contains("one rank per GPU"));
  auto const allow = dpl::nccl::shared_gpu::allow_for_tests;
  int const version = dpl::nccl::runtime_version();
  char const* env = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");  // NOLINT(concurrency-mt-unsafe)
  if (version < dpl::detail::nccl_multi_rank_gpu_version) {
    CHECK_THROWS_WITH(dpl::nccl::make_groups({gpu0, gpu0}, std::chrono::seconds(60), allow),
                      Catch::Contains("cannot put two ranks of one process on one GPU") &&
                          Catch::Contains(dpl::detail::nccl_version_string(version)));
  } else if (env == nullptr || std::string_view(env) != "1") {
    CHECK_THROWS_WITH(dpl::nccl::make_groups({gpu0, gpu0}, std::chrono::seconds(60), allow),
                      Catch::Contains("NCCL_MULTI_RANK_GPU_ENABLE=1"));
  } else {
    auto groups = dpl::nccl::make_groups({gpu0, gpu0}, std::chrono::seconds(60), allow);
    std::vector<std::vector<float>> v{{1, 2}, {10, 20}};
    std::vector<std::thread> ranks;
    for (std::size_t r = 0; r < 2; ++r) ranks.emplace_back([&, r] { groups[r].all_reduce(dpl::view(v[r])).wait(); });
    for (auto& t : ranks) t.join();
    CHECK(v[0] == std::vector<float>{11, 22});
    CHECK(v[1] == v[0]);
  }
}

namespace {
/// A model whose step function sets replica i's gradients to c_i * (j % 7 + 1), c_i = 0.5 + 0.25 i,
/// held in one allocation (`flat`: nccl::dp reduces them in place) or one per gradient (packed
/// into a bucket and copied back).
template <class T>
struct known_grads {
  dpl::device dev = gpu0;
  bool flat = true;
  std::vector<std::size_t> sizes{5, 300, 1};
  dpl::cuda::device_buffer<T> p, all;
  std::vector<dpl::cuda::device_buffer<T>> each;
  known_grads(dpl::device d, bool f) : dev(d), flat(f) {
    std::size_t total = 0;
    for (std::size_t n : sizes) total += n;
    p = dpl::cuda::device_buffer<T>(4, dev);
    if (flat) all = dpl::cuda::device_buffer<T>(total, dev);
    for (std::size_t n : sizes)
      if (!flat) each.emplace_back(n, dev);
    dpl::cuda::device_guard g(dev.index);
    dpl::cuda::check(cudaDeviceSynchronize(), "test");
  }
  known_grads(known_grads const& o) : known_grads(o.dev, o.flat) {}
  known_grads make_replica(dpl::device d) const { return known_grads(d, flat); }
  std::vector<dpl::tensor_ref> parameters() { return {p.view()}; }
  std::vector<dpl::tensor_ref> gradients() {
    std::vector<dpl::tensor_ref> out;
    std::size_t at = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      out.push_back(flat ? dpl::tensor_ref(all.data() + at, sizes[k], dpl::dtype_v<T>, dev) : dpl::tensor_ref(each[k].view()));
      at += sizes[k];
    }
    return out;
  }
  static double value(std::size_t replica, std::size_t j) { return (0.5 + 0.25 * static_cast<double>(replica)) * static_cast<double>(j % 7 + 1); }
  void fill(std::size_t replica) {
    cudaStream_t const st = dpl::cuda::current_stream();
    for (auto const& g : gradients()) {
      std::vector<T> h(g.size());
      for (std::size_t j = 0; j < h.size(); ++j) h[j] = T(static_cast<float>(value(replica, j)));
      dpl::cuda::check(cudaMemcpyAsync(g.data(), h.data(), g.size_bytes(), cudaMemcpyHostToDevice, st), "test");
      dpl::cuda::check(cudaStreamSynchronize(st), "test");
    }
  }
};

template <class T>
void check_flattened_reduce(int n, bool flat, double tolerance) {
  INFO("GPUs " << n << ", flat " << flat << ", " << dpl::name_of(dpl::dtype_v<T>));
  known_grads<T> master(gpu0, flat);
  dpl::parallel<known_grads<T>, dpl::nccl::dp, gpu> dp(master, dpl::cuda::devices(n));
  // Batches of 3 (weights of a third: the F32 path for 16-bit gradients) and 8 (exact weights),
  // then 3 again: the operators are replaced when the weights change.
  for (std::size_t batch : {std::size_t{3}, std::size_t{8}, std::size_t{3}}) {
    INFO("batch " << batch);
    std::vector<float> rows(batch, 1.0f);
    dp.step(dpl::tensor_view<float const>(rows.data(), rows.size()),
            [](known_grads<T>& m, dpl::tensor_view<float const>, dpl::step_context& ctx) {
              m.fill(static_cast<std::size_t>(ctx.replica()));
            });
    auto const& shards = dp.last_shard_sizes();
    dpl::cuda::device_guard g(0);
    dpl::cuda::check(cudaDeviceSynchronize(), "test");
    for (auto const& t : master.gradients()) {
      std::vector<T> got(t.size());
      dpl::cuda::check(cudaMemcpy(got.data(), t.data(), t.size_bytes(), cudaMemcpyDeviceToHost), "test");
      for (std::size_t j = 0; j < got.size(); ++j) {
        double want = 0;  // the one-device gradient of the mean: sum_i (shard_i / batch) * g_i
        for (std::size_t i = 0; i < shards.size(); ++i)
          want += static_cast<double>(shards[i]) / static_cast<double>(batch) * known_grads<T>::value(i, j);
        CHECK(std::abs(static_cast<double>(static_cast<float>(got[j])) - want) <= tolerance * want);
      }
    }
  }
}
}  // namespace

TEST_CASE("nccl::dp reduces flattened buckets to the one-device gradient, in place or packed, F32 and BF16",
          "[cuda][nccl][dp][contract]") {
  int const gpus = std::min(dpl::cuda::device_count(), 4);
  if (gpus < 2) {
    WARN("one GPU: nccl::dp's NCCL path needs distinct GPUs (lanes fall back to the copy/kernel path)");
    return;
  }
  for (int n = 2; n <= gpus; ++n)
    for (bool flat : {true, false}) {
      check_flattened_reduce<float>(n, flat, 1e-6);
      check_flattened_reduce<dpl::bf16>(n, flat, 0x1p-8);  // half a bf16 ulp: rounded once, from F32
    }
}

// --- subgroups and hierarchical all_reduce --------------------------------------------------------

namespace {

// Parent rank p's input: small integers, exact in float, so that every order of the additions
// gives the same bits and a subgroup's sum can be compared with ==.
std::vector<float> rank_input(int p, std::size_t n, int salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>((static_cast<int>(i % 97) + 3 * p + salt) % 41 - 20);
  return v;
}

std::vector<float> sum_over(std::vector<int> const& members, std::size_t n, int salt) {
  std::vector<float> s(n, 0.0f);
  for (int j : members) {
    auto const x = rank_input(j, n, salt);
    for (std::size_t i = 0; i < n; ++i) s[i] += x[i];
  }
  return s;
}

// Rank p's input in device memory on `d`, reduced over `g`, read back.
std::vector<float> reduced_on(dpl::process_group const& g, dpl::device d, int p, std::size_t n, int salt,
                              dpl::reduce_op op = dpl::reduce_op::sum) {
  auto const x = rank_input(p, n, salt);
  dpl::cuda::device_buffer<float> b(n, d);
  dpl::cuda::check(cudaMemcpy(b.data(), x.data(), n * sizeof(float), cudaMemcpyHostToDevice), "test");
  g.all_reduce(b.view(), op).wait();
  return from_gpu(b.data(), n);
}

bool near(std::vector<float> const& a, std::vector<float> const& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::abs(a[i] - b[i]) > 1e-5f * (1.0f + std::abs(b[i]))) return false;
  return true;
}

// The subgroup contracts on parent group g (an NCCL group; this rank's GPU d): who lands where,
// in which order, and what a collective over a subgroup gives. Empty when all hold, else the
// first failure.
std::string check_subgroups(dpl::process_group const& g, dpl::device d) {
  int const world = g.size(), p = g.rank();
  std::size_t const n = 1001;
  auto const expect_group = [&](dpl::process_group const& sub, std::vector<int> const& members,
                                std::string const& what, int salt) -> std::string {
    auto const at = std::find(members.begin(), members.end(), p);
    if (at == members.end()) return sub.valid() ? what + ": expected no subgroup on parent rank " + std::to_string(p) : "";
    if (!sub.valid()) return what + ": expected a subgroup on parent rank " + std::to_string(p);
    if (sub.size() != static_cast<int>(members.size()) || sub.rank() != static_cast<int>(at - members.begin()))
      return what + ": expected group rank " + std::to_string(at - members.begin()) + " of " +
             std::to_string(members.size()) + ", found " + std::to_string(sub.rank()) + " of " + std::to_string(sub.size());
    if (reduced_on(sub, d, p, n, salt) != sum_over(members, n, salt)) return what + ": all_reduce over the subgroup";
    auto x = rank_input(p, n, salt + 1);  // host memory, staged by the engine
    sub.broadcast(dpl::view(x), 0).wait();
    if (x != rank_input(members[0], n, salt + 1)) return what + ": broadcast from group rank 0";
    return "";
  };
  // split by parity, keys reversing the parent order.
  std::vector<int> same_parity;
  for (int j = world - 1; j >= 0; --j)
    if (j % 2 == p % 2) same_parity.push_back(j);
  if (auto e = expect_group(g.split(p % 2, -p), same_parity, "split(rank % 2, -rank)", 1); !e.empty()) return e;
  // new_group in a given order, the others in no group.
  std::vector<int> const ends = world == 1 ? std::vector<int>{0} : std::vector<int>{world - 1, 0};
  if (auto e = expect_group(g.new_group(ends), ends, "new_group(last, first)", 3); !e.empty()) return e;
  // no_group: only parent rank 0 in a subgroup.
  if (auto e = expect_group(g.split(p == 0 ? 7 : dpl::process_group::no_group), {0}, "split(rank 0 only)", 5);
      !e.empty())
    return e;
  // A subgroup of a subgroup.
  auto const all = g.split(0, p);
  std::vector<int> everyone(static_cast<std::size_t>(world));
  std::iota(everyone.begin(), everyone.end(), 0);
  if (auto e = expect_group(all.split(0, -all.rank()), std::vector<int>(everyone.rbegin(), everyone.rend()),
                            "split of a split", 7);
      !e.empty())
    return e;
  // The hierarchical all_reduce equals the flat one: exactly for sums of integers, within float
  // rounding for avg (it rounds twice on device memory); device and host memory.
  std::vector<int> per_nodes{1};  // one rank per node
  if (world > 1) per_nodes.push_back(world);  // one node
  if (world % 2 == 0 && world > 2) per_nodes.push_back(2);
  for (int per_node : per_nodes) {
    auto const h = dpl::make_hierarchical(g, {.ranks_per_node = per_node});
    std::string const at = "hierarchical (" + std::to_string(per_node) + " ranks per node)";
    for (std::size_t len : {std::size_t{1}, std::size_t{7}, std::size_t{1001}, (std::size_t{1} << 20) + 3}) {
      int const salt = 11 + static_cast<int>(len % 13);
      if (reduced_on(h, d, p, len, salt) != reduced_on(g, d, p, len, salt))
        return at + ": sum of " + std::to_string(len) + " floats in device memory differs from the flat group's";
      if (!near(reduced_on(h, d, p, len, salt, dpl::reduce_op::avg), reduced_on(g, d, p, len, salt, dpl::reduce_op::avg)))
        return at + ": avg of " + std::to_string(len) + " floats in device memory differs from the flat group's";
      auto x = rank_input(p, len, salt);
      h.all_reduce(dpl::view(x), dpl::reduce_op::sum).wait();
      if (x != sum_over(everyone, len, salt))
        return at + ": sum of " + std::to_string(len) + " floats in host memory differs from the serial sum";
    }
  }
  // A subgroup's failure names both numberings.
  auto const reversed = g.split(0, -p);
  reversed.abort("subgroup test abort");
  try {
    reversed.barrier().wait();
    return "a barrier of an aborted subgroup succeeded";
  } catch (dpl::comm_error const& e) {
    std::string const want = "is parent rank " + std::to_string(p);
    if (std::string(e.what()).find(want) == std::string::npos || std::string(e.what()).find("subgroup test abort") == std::string::npos)
      return std::string("the aborted subgroup's error names neither the parent rank nor the cause: ") + e.what();
  }
  // The parent is untouched by its subgroups' failure.
  if (reduced_on(g, d, p, n, 13) != sum_over(everyone, n, 13)) return "the parent after its subgroup's abort";
  return "";
}

}  // namespace

TEST_CASE("NCCL subgroups (split, new_group) and the hierarchical all_reduce over thread ranks",
          "[nccl][subgroups]") {
  int const world = std::min(dpl::cuda::device_count(), 4);
  if (world < 2)
    WARN("one GPU: subgroups over one NCCL thread rank; several ranks on this GPU are the processes of "
         "test_nccl \"[nccl-ranks]\" (see the top of tests/cuda/test_nccl.cu)");
  // A rank whose checks fail stops issuing; the others then fail at this timeout.
  auto groups = dpl::nccl::make_groups(dpl::cuda::devices(world), std::chrono::seconds(60));
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      try {
        dpl::device const d{dpl::device_kind::cuda, r, 0};
        dpl::cuda::check(cudaSetDevice(r), "cudaSetDevice");
        errors[static_cast<std::size_t>(r)] = check_subgroups(groups[static_cast<std::size_t>(r)], d);
      } catch (std::exception const& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    CHECK(errors[static_cast<std::size_t>(r)] == "");
  }
}

TEST_CASE("NCCL subgroups and the hierarchical all_reduce over this process's rank of a launched job",
          "[.][nccl-ranks]") {
  // Hidden: run by a launcher, one process per rank (see the top of this file). Every rank runs
  // the same checks; a rank whose checks fail aborts the group so that the others fail too.
  auto const env = dpl::process_environment();
  if (!env("WORLD_SIZE"))
    FAIL("expected a launched job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; see the top of tests/cuda/test_nccl.cu)");
  auto const g = dpl::nccl::init_process_group();
  int ordinal = 0;
  dpl::cuda::check(cudaGetDevice(&ordinal), "cudaGetDevice");  // init_process_group made the rank's GPU current
  std::string e;
  try {
    e = check_subgroups(g, dpl::device{dpl::device_kind::cuda, ordinal, 0});
  } catch (std::exception const& x) {
    e = x.what();
  }
  INFO("rank " << g.rank() << " of " << g.size() << " on GPU " << ordinal);
  CHECK(e == "");
  if (!e.empty()) g.abort("rank " + std::to_string(g.rank()) + " failed its subgroup checks");
  g.barrier().wait();  // the ranks end together (a barrier of a group one rank aborted fails on every rank)
}

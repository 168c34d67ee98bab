// The MPI communicator, run as real processes (mpirun -np 2|3 test_mpi): every collective gives
// the thread-rank host communicator's bits (reduction::rank_order) or the same values within
// rounding (reduction::native); init_process_group reads mpirun's environment; the NCCL unique-id
// bootstrap goes through the MPI group; desync detection reports every rank's call. DDP over MPI
// is test_mpi_ddp's.
//
// The reference runs in each process: the same inputs through dparallel::spawn's thread ranks.
// Failure scenarios that end the job (a killed rank, a throwing rank, a missing collective) are
// in mpi_fault.cpp, driven by run_mpi_fault.cmake.
#include "../models.hpp"
#include "mpi_checks.hpp"

#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/comm/mpi.hpp>
#include <dparallel/comm/nccl_bootstrap.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace dpl = dparallel;
using namespace std::chrono_literals;

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// One output buffer of run_ops: its bytes, dtype, and whether every rank must hold the same.
struct output {
  std::vector<std::byte> bytes;
  dpl::dtype type;
  bool same_on_every_rank;
};

template <class T>
void keep(std::vector<output>& out, std::span<T const> v, bool same) {
  auto const b = std::as_bytes(v);
  out.push_back({std::vector<std::byte>(b.begin(), b.end()), dpl::dtype_v<T>, same});
}
template <class T>
void keep(std::vector<output>& out, std::vector<T> const& v, bool same) {
  keep(out, std::span<T const>(v), same);
}

/// Distinct, deterministic values for rank r.
template <class T>
std::vector<T> values(int rank, std::size_t n, std::uint64_t seed) {
  test::rng g{seed * 7919 + static_cast<std::uint64_t>(rank)};
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(g.uniform() * 2 - 1);
  return v;
}

/// 16-bit values for rank r: mostly ordinary, with infinities, a NaN, subnormals and values whose
/// sum overflows the 16-bit range on some elements (summed in float, rounded once).
template <class H>
std::vector<H> half_values(int rank, std::size_t n, std::uint64_t seed) {
  auto const f = values<float>(rank, n, seed);
  std::vector<H> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    float x = f[i] * 70000.0f;
    if (i % 97 == 3) x = rank == 0 ? std::numeric_limits<float>::infinity() : x;
    if (i % 89 == 5) x = rank == 1 ? -std::numeric_limits<float>::infinity() : x;
    if (i % 101 == 7 && rank == 0) x = std::numeric_limits<float>::quiet_NaN();
    if (i % 13 == 1) x = f[i] * 1e-6f;
    v[i] = H(x);
  }
  return v;
}

/// The 16-bit reductions (F16 or BF16): all_reduce of several lengths, reduce onto the last rank,
/// reduce_scatter.
template <class H>
void run_half_ops(dpl::process_group const& g, std::vector<output>& out, std::uint64_t& seed) {
  int const r = g.rank();
  int const n = g.size();
  for (std::size_t len : {1, 5, 1000}) {
    for (auto op : {dpl::reduce_op::sum, dpl::reduce_op::avg}) {
      auto h = half_values<H>(r, len, seed++);
      g.all_reduce(dpl::view(h), op).wait();
      keep(out, h, true);
    }
  }
  auto h = half_values<H>(r, 300, seed++);
  g.reduce(dpl::view(h), n - 1, dpl::reduce_op::avg).wait();
  keep(out, h, false);
  std::size_t const m = 53;
  auto in = half_values<H>(r, m * static_cast<std::size_t>(n), seed++);
  std::vector<H> o(m);
  g.reduce_scatter(dpl::view(o), dpl::view(in), dpl::reduce_op::avg).wait();
  keep(out, o, false);
}

/// A fixed sequence of collectives of every kind through `g`; returns every output buffer.
std::vector<output> run_ops(dpl::process_group const& g) {
  int const r = g.rank();
  int const n = g.size();
  auto const un = static_cast<std::size_t>(n);
  auto const ur = static_cast<std::size_t>(r);
  std::vector<output> out;
  std::uint64_t seed = 1;
  // all_reduce: empty, shorter than the world, uneven slices, several tiles.
  for (std::size_t len : {0, 1, 2, 5, 1000, 4099}) {
    for (auto op : {dpl::reduce_op::sum, dpl::reduce_op::avg}) {
      auto f = values<float>(r, len, seed++);
      g.all_reduce(dpl::view(f), op).wait();
      keep(out, f, true);
      auto d = values<double>(r, len, seed++);
      g.all_reduce(dpl::view(d), op).wait();
      keep(out, d, true);
    }
  }
  {  // reduce to the last rank: the others' buffers stay unchanged
    auto f = values<float>(r, 777, seed++);
    g.reduce(dpl::view(f), n - 1, dpl::reduce_op::avg).wait();
    keep(out, f, false);
    auto d = values<double>(r, 3, seed++);
    g.reduce(dpl::view(d), 0).wait();
    keep(out, d, false);
  }
  {  // broadcast: F32 from the last rank, F16 words from rank 0
    auto f = values<float>(r, 333, seed++);
    g.broadcast(dpl::view(f), n - 1).wait();
    keep(out, f, true);
    std::vector<std::uint16_t> h(50);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::uint16_t>(1000 * r + static_cast<int>(i));
    g.broadcast(dpl::tensor_ref(h.data(), h.size(), dpl::dtype::f16), 0).wait();
    auto const hb = std::as_bytes(std::span(h));
    out.push_back({std::vector<std::byte>(hb.begin(), hb.end()), dpl::dtype::f16, true});
  }
  {  // reduce_scatter: disjoint, then in place (out = in's block r)
    std::size_t const m = 37;
    auto in = values<float>(r, m * un, seed++);
    std::vector<float> o(m);
    g.reduce_scatter(dpl::view(o), dpl::view(in), dpl::reduce_op::avg).wait();
    keep(out, o, false);
    auto in2 = values<double>(r, m * un, seed++);
    g.reduce_scatter(dpl::tensor_view<double>(in2.data() + ur * m, m), dpl::view(in2)).wait();
    keep(out, in2, false);
  }
  {  // all_gather: disjoint, then in place (in = out's block r)
    auto in = values<float>(r, 41, seed++);
    std::vector<float> o(41 * un);
    g.all_gather(dpl::view(o), dpl::view(in)).wait();
    keep(out, o, true);
    std::vector<double> o2(29 * un, -1.0);
    auto const mine = values<double>(r, 29, seed++);
    std::copy(mine.begin(), mine.end(), o2.begin() + static_cast<std::ptrdiff_t>(ur * 29));
    g.all_gather(dpl::view(o2), dpl::tensor_view<double>(o2.data() + ur * 29, 29)).wait();
    keep(out, o2, true);
  }
  // Several collectives in flight at once, waited for in reverse order.
  std::vector<std::vector<float>> many;
  std::vector<dpl::work> works;
  for (int k = 0; k < 6; ++k) many.push_back(values<float>(r, 100 + static_cast<std::size_t>(k) * 50, seed++));
  for (auto& v : many) works.push_back(g.all_reduce(dpl::view(v), dpl::reduce_op::avg));
  for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
  for (auto const& v : many) keep(out, v, true);
  run_half_ops<dpl::f16>(g, out, seed);
  run_half_ops<dpl::bf16>(g, out, seed);
  g.barrier().wait();
  return out;
}

/// Integer sums (the MPI communicator's; the host communicator reduces floating dtypes only): exact, so
/// checked against the closed form. Returns the number of wrong elements.
std::size_t integer_sums_wrong(dpl::process_group const& g) {
  int const r = g.rank();
  std::int64_t const n = g.size();
  std::vector<std::int32_t> i32(100);
  std::vector<std::int64_t> i64(100);
  std::vector<std::uint8_t> u8(100);
  for (std::size_t i = 0; i < 100; ++i) {
    i32[i] = static_cast<std::int32_t>(i) * (r + 1) - 7;
    i64[i] = static_cast<std::int64_t>(i) << (r + 20);
    u8[i] = static_cast<std::uint8_t>(i + static_cast<std::size_t>(r));
  }
  g.all_reduce(dpl::view(i32)).wait();
  g.all_reduce(dpl::view(i64)).wait();
  g.all_reduce(dpl::view(u8)).wait();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < 100; ++i) {
    auto const ii = static_cast<std::int64_t>(i);
    std::int64_t want64 = 0;
    for (int k = 0; k < n; ++k) want64 += ii << (k + 20);
    wrong += i32[i] != static_cast<std::int32_t>(ii * n * (n + 1) / 2 - 7 * n);
    wrong += i64[i] != want64;
    wrong += u8[i] != static_cast<std::uint8_t>(ii * n + n * (n - 1) / 2);
  }
  return wrong;
}

/// The outputs of run_ops on thread ranks of the host communicator (the reference), per rank.
std::vector<std::vector<output>> host_reference(int world) {
  std::vector<std::vector<output>> ref(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& rank) { ref[static_cast<std::size_t>(rank.rank())] = run_ops(rank.group()); });
  return ref;
}

using test::gather_all;
using test::hash_bytes;

/// Largest relative difference between two outputs of a floating dtype (0 for equal bytes).
double max_rel_diff(output const& a, output const& b) {
  if (a.bytes == b.bytes) return 0;
  if (a.bytes.size() != b.bytes.size() || a.type != b.type) return 1e30;
  double worst = 0;
  auto cmp = [&](auto zero) {
    using T = decltype(zero);
    std::size_t const n = a.bytes.size() / sizeof(T);
    for (std::size_t i = 0; i < n; ++i) {
      T x, y;
      std::memcpy(&x, a.bytes.data() + i * sizeof(T), sizeof(T));
      std::memcpy(&y, b.bytes.data() + i * sizeof(T), sizeof(T));
      double const scale = std::max(1e-3, std::max(std::abs(static_cast<double>(x)), std::abs(static_cast<double>(y))));
      worst = std::max(worst, std::abs(static_cast<double>(x) - static_cast<double>(y)) / scale);
    }
  };
  if (a.type == dpl::dtype::f32) cmp(float{});
  else if (a.type == dpl::dtype::f64) cmp(double{});
  else return 1e30;  // integers and moved words must be equal
  return worst;
}

}  // namespace

// =================================================================================================

TEST_CASE("mpi: rank-order collectives give the host communicator's bits, also split into short messages",
          "[comm]") {
  auto const probe = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  int const rank = probe.rank();
  auto const ref = host_reference(probe.size());
  // MPI's data path (whole and split into short messages), then the shared-memory one that
  // make_group picks on one node (mpirun here starts every rank on this machine).
  for (auto [chunk, shm] : {std::pair{std::size_t{1} << 28, false}, std::pair{std::size_t{7}, false},
                            std::pair{std::size_t{1} << 28, true}}) {
    auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.max_message_elements = chunk, .shared_memory = shm});
    auto const got = run_ops(g);
    INFO("rank " << rank << " of " << g.size() << ", max_message_elements " << chunk << ", shared memory " << shm);
    REQUIRE(got.size() == ref[static_cast<std::size_t>(rank)].size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      INFO("output " << k);
      CHECK(got[k].bytes == ref[static_cast<std::size_t>(rank)][k].bytes);
    }
  }
}

TEST_CASE("mpi: on one node make_group moves the data through shared memory unless told not to", "[comm]") {
  // The engine shows in the message of an invalid call (every rank makes it, so none waits).
  for (bool shm : {true, false}) {
    auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.shared_memory = shm});
    std::vector<float> v(4, 1.0f);
    CHECK_THROWS_WITH(g.broadcast(dpl::view(v), g.size()),
                      Catch::Contains(shm ? "shm::communicator: broadcast" : "mpi::communicator: broadcast"));
  }
}

TEST_CASE("mpi: native reductions agree within rounding and are identical on every rank", "[comm]") {
  auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.reduce = dpl::mpi::reduction::native});
  int const rank = g.rank();
  auto const ref = host_reference(g.size());
  auto const got = run_ops(g);
  REQUIRE(got.size() == ref[static_cast<std::size_t>(rank)].size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO("rank " << rank << ", output " << k);
    CHECK(max_rel_diff(got[k], ref[static_cast<std::size_t>(rank)][k]) <= 1e-6);
    if (got[k].same_on_every_rank) {
      auto const all = gather_all(g, static_cast<std::int64_t>(hash_bytes(got[k].bytes)));
      for (auto h : all) CHECK(h == all[0]);
    }
  }
}

TEST_CASE("mpi: integer sums (I32, I64, U8) are exact, in either reduction mode", "[comm]") {
  for (auto mode : {dpl::mpi::reduction::rank_order, dpl::mpi::reduction::native}) {
    auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.reduce = mode});
    CHECK(integer_sums_wrong(g) == 0);
  }
}

TEST_CASE("mpi: invalid arguments throw on the caller and abort the group, naming the rank", "[comm]") {
  auto g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  int const n = g.size();
  std::vector<float> v(4, 1.0f);
  // Every rank makes the same mistake, so no rank is left inside a collective.
  CHECK_THROWS_WITH(g.broadcast(dpl::view(v), n),
                    Catch::Contains("broadcast on rank " + std::to_string(g.rank())) &&
                        Catch::Contains("expected a root in [0, " + std::to_string(n) + "), found " + std::to_string(n)));
  std::vector<std::int32_t> h(4);
  auto const g2 = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  CHECK_THROWS_WITH(g2.all_reduce(dpl::view(h), dpl::reduce_op::avg),
                    Catch::Contains("avg needs a floating-point dtype (F32, F64, F16, BF16), found I32"));
  // A 16-bit sum MPI cannot compute (device memory: MPI has no 16-bit floating-point MPI_SUM) is
  // refused before anything reaches MPI (the view is never dereferenced).
  std::vector<dpl::bf16> b(4);
  auto const g3 = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.cuda_aware = true});
  CHECK_THROWS_WITH(g3.all_reduce(dpl::tensor_ref(b.data(), b.size(), dpl::dtype::bf16, dpl::device{dpl::device_kind::cuda, 0, 0})),
                    Catch::Contains("BF16 sums of device memory are not supported through MPI"));
  // The aborted group fails later collectives with the abort, naming a rank that aborted.
  try {
    g.barrier().wait();
    FAIL("expected the aborted group to fail");
  } catch (dpl::comm_error const& e) {
    CHECK_THAT(e.what(), Catch::Contains("aborted the process group: invalid arguments to broadcast"));
    CHECK((e.rank() >= 0 && e.rank() < n));
  }
}

TEST_CASE("mpi: init_process_group reads mpirun's environment and agrees with MPI", "[init]") {
  auto const group = dpl::mpi::init_process_group({.timeout = 45s});
  CHECK(group.rank() == world_rank());
  CHECK(group.world_size() == group.size());
  CHECK(group.timeout() == 45s);
  if (char const* r = std::getenv("OMPI_COMM_WORLD_RANK")) {
    CHECK(group.rank() == std::atoi(r));
    CHECK(group.local_rank() == std::atoi(std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")));
    CHECK(group.local_world_size() == std::atoi(std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")));
    CHECK_THAT(group.launch().source, Catch::Contains("Open MPI"));
  }
  // An explicit rank that contradicts MPI is an error on every rank (all make it here).
  int const wrong = (group.rank() + 1) % group.size();
  if (group.size() > 1) {
    CHECK_THROWS_WITH(dpl::mpi::init_process_group({.rank = wrong}),
                      Catch::Contains("inconsistent launch") &&
                          Catch::Contains("MPI_COMM_WORLD says rank " + std::to_string(group.rank())) &&
                          Catch::Contains("rank=" + std::to_string(wrong) + " (argument)"));
  }
  // The group works, and with desync detection on.
  auto const checked = dpl::mpi::init_process_group({.desync_detection = true});
  std::vector<double> v{static_cast<double>(group.rank())};
  checked.all_reduce(dpl::view(v)).wait();
  CHECK(v[0] == static_cast<double>(group.size() * (group.size() - 1) / 2));
}

TEST_CASE("mpi: the NCCL unique id bootstrap goes through the MPI group", "[init]") {
  auto const group = dpl::mpi::init_process_group();
  std::vector<std::byte> id(dpl::nccl_unique_id_bytes);
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<std::byte>((i * 37 + 11) & 0xff);
  std::vector<std::byte> const mine = group.rank() == 0 ? id : std::vector<std::byte>{};
  auto const got = dpl::share_root_bytes(group.launch(), mine, dpl::nccl_unique_id_bytes, group);
  CHECK(got == id);
}

TEST_CASE("mpi: desync detection shows every rank's call; the MPI group stays healthy", "[desync]") {
  auto const inner = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  int const n = inner.size();
  if (n < 2) return;
  auto const g = dpl::with_desync_detection(inner);
  std::vector<float> v(g.rank() == 1 ? 12 : 10, 1.0f);
  try {
    g.all_reduce(dpl::view(v)).wait();
    FAIL("expected a desync error");
  } catch (dpl::comm_error const& e) {
    CHECK(e.rank() == 1);
    std::string const what = e.what();
    CHECK_THAT(what, Catch::Contains("desync detected at collective #1") &&
                         Catch::Contains("rank 0 called #1 all_reduce(10 x F32, sum)") &&
                         Catch::Contains("rank 1 called #1 all_reduce(12 x F32, sum)"));
    if (n == 3) CHECK_THAT(what, Catch::Contains("rank 2 called #1 all_reduce(10 x F32, sum)"));
  }
  std::vector<float> w(3, 1.0f);
  inner.all_reduce(dpl::view(w)).wait();
  CHECK(w == std::vector<float>(3, static_cast<float>(n)));
}

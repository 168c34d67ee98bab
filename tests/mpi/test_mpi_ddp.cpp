// DDP over MPI processes (mpirun -np 2|3 test_mpi_ddp): it trains the parameters of thread-rank
// DDP with the same world size, seed and bucket plan, bitwise (also with the fp16/bf16 compression
// hooks, and join with uneven inputs), and within 1e-5 of one device on the union of the samples;
// replicas are identical across ranks and runs reproducible; with MPI's native reduction it stays
// within 1e-6; a bucket is reduced while backward still runs.
//
// The reference runs in each process: the same training through dparallel::spawn's thread ranks.
#include "../join_run.hpp"
#include "../models.hpp"
#include "mpi_checks.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/comm/mpi.hpp>
#include <dparallel/policy/compress_hooks.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <thread>
#include <vector>

namespace dpl = dparallel;
using namespace std::chrono_literals;

namespace {

using test::gather_all;
using test::hash_bytes;

using model = test::chunked<float>;

dpl::options tiny_buckets() {
  return {.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024)};
}

/// Five DDP steps of rank `rank` over `group` (initial parameters differ per rank until DDP
/// broadcasts rank 0's); returns the parameter hash after each step and the final parameters.
struct ddp_run {
  std::vector<std::uint64_t> hashes;
  std::vector<double> params;
};
/// `compress`: 0 no communication hook, 1 fp16_compress, 2 bf16_compress with error feedback.
ddp_run train_ddp(dpl::process_group const& group, bool hook, bool many_buckets, int compress = 0) {
  int const rank = group.rank();
  int const world = group.size();
  model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(100 + rank));
  dpl::distributed_data_parallel<model> ddp(m, group, many_buckets ? tiny_buckets() : dpl::options{});
  if (compress == 1) ddp.reducer().register_comm_hook(dpl::compress_state{}, dpl::fp16_compress);
  if (compress == 2) ddp.reducer().register_comm_hook(dpl::compress_state{.error_feedback = true}, dpl::bf16_compress);
  ddp_run out;
  for (int step = 0; step < 5; ++step) {
    auto const data = test::dataset<float>::make(6 * static_cast<std::size_t>(world), m.dim,
                                                 static_cast<std::uint64_t>(step + 10 * hook), false);
    auto const first = static_cast<std::size_t>(rank) * 6;
    ddp.step(dpl::slice_batch(data.all(), first, first + 6), [hook](model& r, test::samples<float> s, dpl::step_context& ctx) {
      return hook ? r.forward_backward(s, &ctx) : r.forward_backward(s);
    });
    ddp.module().sgd(0.05f);
    out.hashes.push_back(test::param_hash(m));
  }
  out.params = test::flat(m, false);
  return out;
}

/// The independent reference of train_ddp: one model (rank 0's initial parameters, which DDP
/// broadcasts) trained on the union of the ranks' samples, the gradient the mean over all of them
/// (equal shards: the average of the ranks' means), with no communicator and no DDP involved.
std::vector<double> train_one_device(int world, bool hook) {
  model m({3, 5, 1, 8, 2, 4}, 100);
  for (int step = 0; step < 5; ++step) {
    auto const data = test::dataset<float>::make(6 * static_cast<std::size_t>(world), m.dim,
                                                 static_cast<std::uint64_t>(step + 10 * hook), false);
    m.forward_backward(data.all());
    m.sgd(0.05f);
  }
  return test::flat(m, false);
}

}  // namespace

TEST_CASE("mpi: DDP over N processes gives the parameters of DDP over N thread ranks, bitwise", "[ddp]") {
  auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  int const rank = g.rank();
  int const world = g.size();
  for (bool hook : {false, true}) {
    for (bool many_buckets : {false, true}) {
      INFO("rank " << rank << " of " << world << ", grad_ready " << hook << ", many buckets " << many_buckets);
      // The reference: the same training on thread ranks of the host communicator.
      std::vector<ddp_run> ref(static_cast<std::size_t>(world));
      dpl::spawn(world, [&](dpl::rank_context& ctx) {
        ref[static_cast<std::size_t>(ctx.rank())] = train_ddp(ctx.group(), hook, many_buckets);
      });
      auto const a = train_ddp(g, hook, many_buckets);
      auto const b = train_ddp(g, hook, many_buckets);
      CHECK(a.params == ref[static_cast<std::size_t>(rank)].params);  // bitwise: the same reduction order
      // Both runs above are dparallel's DDP: a wrong average would pass that comparison.
      CHECK(test::rel_error(a.params, train_one_device(world, hook)) <= 1e-5);
      CHECK(a.hashes == ref[static_cast<std::size_t>(rank)].hashes);  // after every step
      CHECK(std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(double)) == 0);  // run to run
      // Replicas identical across ranks after every step.
      for (auto h : a.hashes) {
        auto const all = gather_all(g, static_cast<std::int64_t>(h));
        for (auto x : all) CHECK(x == all[0]);
      }
    }
  }
}

TEST_CASE("mpi: DDP with fp16_compress / bf16_compress gives thread-rank DDP's bits, in either reduction mode",
          "[ddp]") {
  for (auto mode : {dpl::mpi::reduction::rank_order, dpl::mpi::reduction::native}) {
    auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.reduce = mode});
    int const rank = g.rank();
    int const world = g.size();
    for (int compress : {1, 2}) {
      // 16-bit averages always take the rank-order path: bitwise the thread ranks' even in native mode.
      std::vector<ddp_run> ref(static_cast<std::size_t>(world));
      dpl::spawn(world, [&](dpl::rank_context& ctx) {
        ref[static_cast<std::size_t>(ctx.rank())] = train_ddp(ctx.group(), true, true, compress);
      });
      auto const a = train_ddp(g, true, true, compress);
      INFO("rank " << rank << " of " << world << ", hook " << compress << ", native " << (mode == dpl::mpi::reduction::native));
      CHECK(a.params == ref[static_cast<std::size_t>(rank)].params);
      CHECK(a.hashes == ref[static_cast<std::size_t>(rank)].hashes);
      CHECK(test::rel_error(a.params, train_one_device(world, true)) <= 1e-2);  // compressed, but the same training
    }
  }
}

TEST_CASE("mpi: DDP with MPI's native reduction stays within 1e-6 of thread-rank DDP; replicas identical",
          "[ddp]") {
  auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s, {.reduce = dpl::mpi::reduction::native});
  int const rank = g.rank();
  int const world = g.size();
  std::vector<ddp_run> ref(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& ctx) { ref[static_cast<std::size_t>(ctx.rank())] = train_ddp(ctx.group(), true, true); });
  auto const a = train_ddp(g, true, true);
  auto const b = train_ddp(g, true, true);
  INFO("rank " << rank << " of " << world);
  CHECK(test::rel_error(a.params, ref[static_cast<std::size_t>(rank)].params) <= 1e-6);
  CHECK(test::rel_error(a.params, train_one_device(world, true)) <= 1e-5);
  CHECK(a.params == b.params);
  for (auto h : a.hashes) {
    auto const all = gather_all(g, static_cast<std::int64_t>(h));
    for (auto x : all) CHECK(x == all[0]);
  }
}

TEST_CASE("mpi: join with uneven inputs and sample weighting gives thread-rank join's bits", "[ddp]") {
  auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  int const rank = g.rank();
  int const world = g.size();
  test::join::uneven_plan p;  // rank r: 1 + 2 (world - 1 - r) steps of 2 + 3r samples (np3: 5, 3, 1 steps)
  for (int r = 0; r < world; ++r) {
    p.steps.push_back(1 + 2 * (world - 1 - r));
    p.batch.push_back(static_cast<std::size_t>(2 + 3 * r));
  }
  dpl::options o{.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024)};
  o.uneven_inputs = true;
  o.average = dpl::average_mode::samples;
  std::vector<test::join::uneven_result> ref(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& ctx) {
    ref[static_cast<std::size_t>(ctx.rank())] = test::join::train_uneven(ctx.group(), p, o, true);
  });
  auto const a = test::join::train_uneven(g, p, o, true);
  INFO("rank " << rank << " of " << world);
  CHECK(a.grads == ref[static_cast<std::size_t>(rank)].grads);  // bitwise: the same reduction order
  CHECK(a.params == ref[static_cast<std::size_t>(rank)].params);
  CHECK(test::rel_error(a.params, test::join::train_union(p).params) <= 1e-5);  // one device on the union
  auto const all = gather_all(g, static_cast<std::int64_t>(hash_bytes(std::as_bytes(std::span(a.params)))));
  for (auto x : all) CHECK(x == all[0]);  // join() leaves every rank the same parameters
}

TEST_CASE("mpi: DDP overlaps: a bucket is reduced while backward still runs", "[ddp]") {
  auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  int overlapped = 0;
  {
    model m;
    dpl::distributed_data_parallel<model> ddp(m, g, tiny_buckets());
    auto const data = test::dataset<float>::make(4 * static_cast<std::size_t>(g.size()), m.dim, 3, false);
    auto const first = static_cast<std::size_t>(g.rank()) * 4;
    ddp.step(dpl::slice_batch(data.all(), first, first + 4), [&](model& r, test::samples<float> s, dpl::step_context& ctx) {
      auto const before = g.completed_ops();
      return r.forward_backward(s, &ctx, [&](std::size_t p) {
        if (p != r.w.size() - 1) return;
        auto const deadline = std::chrono::steady_clock::now() + 20s;
        while (g.completed_ops() == before && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(1ms);
        overlapped = g.completed_ops() > before ? 1 : 0;
      });
    });
  }
  CHECK(overlapped == 1);
}

// ZeRO stage 1 over MPI processes (mpirun -np 2|3 test_mpi_zero): the parameters after 20 steps
// of ddp_zero1 + zero_redundancy_optimizer are bitwise those of DDP with the same rule, over the
// same MPI group and over thread ranks of the host communicator (the reference runs in each
// process through dparallel::spawn), on every rank, also with the all-gathers overlapping the next
// forward (zero_options::overlap_gather), and over bf16 parameters with F32 master shards
// (zero_options::master_weights); each rank holds its share of the state.
#include "../test_zero_common.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/comm/mpi.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dpl = dparallel;
using namespace std::chrono_literals;

TEST_CASE("mpi: ZeRO-1 over N processes gives bitwise the parameters of DDP with the same rule", "[zero]") {
  auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  int const rank = g.rank(), world = g.size();
  for (bool hook : {false, true}) {
    for (bool tiny : {false, true}) {
      INFO("rank " << rank << " of " << world << ", grad_ready " << hook << ", tiny buckets " << tiny);
      std::vector<test::zero_run> ref(static_cast<std::size_t>(world));
      dpl::spawn(world, [&](dpl::rank_context& ctx) {
        ref[static_cast<std::size_t>(ctx.rank())] = test::train_zero_or_ddp(ctx.group(), false, hook, tiny);
      });
      auto const ddp = test::train_zero_or_ddp(g, false, hook, tiny);
      auto const zero = test::train_zero_or_ddp(g, true, hook, tiny);
      CHECK(ddp.params == ref[0].params);   // MPI DDP = thread-rank DDP (rank-order reductions)
      CHECK(zero.params == ref[0].params);  // ZeRO-1 = DDP, bitwise
      CHECK(zero.hashes == ddp.hashes);     // after every step
      auto const overlap = test::train_overlap(g, hook, tiny);  // gathers running on into the next forward
      CHECK(overlap.params == ref[0].params);
      CHECK(overlap.pending.front() >= 1);
      CHECK(zero.state_bytes == zero.expected_state_bytes);
      // The shards of all ranks cover every parameter element once.
      std::vector<std::int64_t> mine{static_cast<std::int64_t>(zero.valid_elements)};
      std::vector<std::int64_t> all(static_cast<std::size_t>(world));
      g.all_gather(dpl::view(all), dpl::view(mine)).wait();
      std::int64_t covered = 0, total = 0;
      for (auto v : all) covered += v;
      for (auto s : test::zero_sizes()) total += static_cast<std::int64_t>(s);
      CHECK(covered == total);
    }
  }
}

TEST_CASE("mpi: ZeRO-1 over bf16 parameters with F32 master shards gives bitwise DDP with master weights", "[zero]") {
  auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, 60s);
  int const rank = g.rank(), world = g.size();
  for (bool tiny : {false, true}) {
    INFO("rank " << rank << " of " << world << ", tiny buckets " << tiny);
    std::vector<test::half_run> ref(static_cast<std::size_t>(world));
    dpl::spawn(world, [&](dpl::rank_context& ctx) {
      ref[static_cast<std::size_t>(ctx.rank())] = test::train_half_rank<dpl::bf16>(ctx.group(), false, true, tiny);
    });
    auto const ddp = test::train_half_rank<dpl::bf16>(g, false, true, tiny);
    auto const zero = test::train_half_rank<dpl::bf16>(g, true, true, tiny);
    CHECK(ddp.bits == ref[0].bits);   // MPI DDP over bf16 = thread-rank DDP
    CHECK(zero.bits == ref[0].bits);  // ZeRO-1 with master shards = DDP with master weights
    CHECK(zero.hashes == ddp.hashes);
    CHECK(ddp.hashes.front() != ddp.hashes.back());
    CHECK(zero.state_bytes == zero.expected_state_bytes);
  }
}

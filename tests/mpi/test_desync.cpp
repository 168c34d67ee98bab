// Desync detection over thread ranks (dparallel::with_desync_detection): matching collectives run
// as without it; a mismatched one (size, operation, dtype, root, reduce op) fails every rank with
// every rank's call and leaves the wrapped group healthy; DDP trains under it as without it.
#include "../models.hpp"

#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dpl = dparallel;

TEST_CASE("desync: matching collectives run as without detection", "[desync]") {
  // Catch2 assertions are not thread-safe: rank threads record, the test thread checks.
  std::vector<std::vector<float>> out(3);
  std::vector<std::uint64_t> ops(3);
  dpl::spawn(3, [&](dpl::rank_context& rank) {
    auto g = dpl::with_desync_detection(rank.group());
    std::vector<float> v(10, static_cast<float>(rank.rank() + 1));
    g.all_reduce(dpl::view(v)).wait();
    std::vector<float> all(30);
    g.all_gather(dpl::view(all), dpl::view(v)).wait();
    g.barrier().wait();
    out[static_cast<std::size_t>(rank.rank())] = all;
    ops[static_cast<std::size_t>(rank.rank())] = g.completed_ops();
  });
  for (auto const& o : out) CHECK(o == std::vector<float>(30, 6.0f));
  CHECK(ops == std::vector<std::uint64_t>(3, 3));
}

TEST_CASE("desync: a collective of another size fails every rank with every rank's call; the group survives",
          "[desync]") {
  std::vector<std::string> what(3);
  std::vector<int> culprit(3, -1);
  std::vector<int> later(3, 0);
  dpl::spawn(3, [&](dpl::rank_context& rank) {
    auto g = dpl::with_desync_detection(rank.group());
    auto const r = static_cast<std::size_t>(rank.rank());
    std::vector<float> v(rank.rank() == 1 ? 12 : 10, 1.0f);
    g.barrier().wait();
    try {
      g.all_reduce(dpl::view(v)).wait();
    } catch (dpl::comm_error const& e) {
      what[r] = e.what();
      culprit[r] = e.rank();
    }
    // Sticky on the wrapper, but the wrapped group is healthy: nothing mismatched ran on it.
    try {
      g.barrier().wait();
    } catch (dpl::comm_error const&) {
      later[r] = 1;
    }
    std::vector<float> w(4, 1.0f);
    rank.group().all_reduce(dpl::view(w)).wait();
    if (w != std::vector<float>(4, 3.0f)) later[r] = 2;
  });
  for (std::size_t r = 0; r < 3; ++r) {
    INFO("rank " << r);
    CHECK(culprit[r] == 1);
    CHECK_THAT(what[r], Catch::Contains("desync detected at collective #2") &&
                            Catch::Contains("rank 0 called #2 all_reduce(10 x F32, sum)") &&
                            Catch::Contains("rank 1 called #2 all_reduce(12 x F32, sum)") &&
                            Catch::Contains("rank 2 called #2 all_reduce(10 x F32, sum)") &&
                            Catch::Contains("rank 1 differs from ranks 0 and 2"));
    CHECK(later[r] == 1);
  }
}

TEST_CASE("desync: another operation, dtype, root or reduce op is reported the same way", "[desync]") {
  std::vector<std::string> what(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    auto g = dpl::with_desync_detection(rank.group());
    std::vector<double> v(4, 1.0);
    try {
      if (rank.rank() == 0) g.broadcast(dpl::view(v), 0).wait();
      else g.broadcast(dpl::view(v), 1).wait();
    } catch (dpl::comm_error const& e) {
      what[static_cast<std::size_t>(rank.rank())] = e.what();
    }
  });
  for (auto const& w : what)
    CHECK_THAT(w, Catch::Contains("rank 0 called #1 broadcast(4 x F64, root 0)") &&
                      Catch::Contains("rank 1 called #1 broadcast(4 x F64, root 1)"));
}

TEST_CASE("desync: DDP under desync detection trains as without it", "[desync][ddp]") {
  using model = test::chunked<float>;
  auto train = [](bool detect) {
    std::vector<double> params;
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      model m;
      auto g = detect ? dpl::with_desync_detection(rank.group()) : rank.group();
      dpl::distributed_data_parallel<model> ddp(
          m, g, {.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024)});
      for (int step = 0; step < 3; ++step) {
        auto const data = test::dataset<float>::make(8, m.dim, static_cast<std::uint64_t>(step), false);
        auto const first = static_cast<std::size_t>(rank.rank()) * 4;
        ddp.step(dpl::slice_batch(data.all(), first, first + 4),
                 [](model& r, test::samples<float> s, dpl::step_context& ctx) { return r.forward_backward(s, &ctx); });
        ddp.module().sgd(0.05f);
      }
      if (rank.rank() == 0) params = test::flat(m, false);
    });
    return params;
  };
  CHECK(train(true) == train(false));
}

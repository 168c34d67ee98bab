// process_group::all_reduce_coalesced on thread ranks: a list of tensors reduced in place as one
// array gives the bits of all_reduce over a buffer holding them, whatever cut each rank makes
// (and next to a peer's plain all_reduce); mismatched counts fail every rank, bad lists are
// refused. The same for reduce_scatter_coalesced and all_gather_coalesced against their plain
// forms. And DDP, which reduces its copying buckets this way once the step function has
// returned, leaves the gradients alone while the step function still runs.
#include "models.hpp"
#include "rank_threads.hpp"

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace dp = dparallel;
using namespace std::chrono_literals;

namespace {

/// Rank r's cut of an array of `count` elements into tensor sizes (lengths that depend on the rank).
std::vector<std::size_t> cut(std::size_t count, int r) {
  std::vector<std::size_t> sizes;
  std::size_t const pattern[] = {1, 15, 16, 17, 1000, 70001, 3};
  std::size_t left = count, k = static_cast<std::size_t>(r);
  while (left > 0) {
    std::size_t const s = std::min(left, pattern[k++ % 7] * static_cast<std::size_t>(r + 1));
    sizes.push_back(s);
    left -= s;
  }
  return sizes;
}

template <class T>
void check_against_all_reduce(int n, std::size_t count, dp::reduce_op op, bool plain_rank0) {
  // With plain_rank0, rank 0 passes its array as one buffer to a plain all_reduce.
  INFO(n << " ranks, " << count << " elements, op " << dp::name_of(op) << ", rank 0 plain " << plain_rank0);
  // Rank r's array, twice: once cut into tensors (reduced coalesced), once whole (all_reduce).
  std::vector<std::vector<T>> whole(static_cast<std::size_t>(n)), parts_data(static_cast<std::size_t>(n));
  test::rng g{count * 31 + static_cast<std::uint64_t>(n)};
  for (auto& v : whole) {
    v.resize(count);
    for (auto& x : v) x = static_cast<T>(static_cast<float>(g.uniform() * 2 - 1));
  }
  parts_data = whole;
  std::vector<std::vector<dp::tensor_ref>> lists(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::size_t at = 0;
    for (std::size_t s : cut(count, r)) {
      lists[static_cast<std::size_t>(r)].push_back(
          dp::tensor_ref(dp::view(parts_data[static_cast<std::size_t>(r)])).subview(at, s));
      at += s;
    }
  }
  auto coalesced = dp::host::make_group(n), plain = dp::host::make_group(n);
  for (auto const& grp : coalesced) CHECK(grp.coalesces_in_place());
  test::rethrow_first(test::on_ranks(coalesced, [&](int r, dp::process_group& grp) {
    auto const ur = static_cast<std::size_t>(r);
    if (plain_rank0 && r == 0) grp.all_reduce(dp::view(parts_data[0]), op).wait();
    else grp.all_reduce_coalesced(lists[ur], op).wait();
  }));
  test::rethrow_first(test::on_ranks(plain, [&](int r, dp::process_group& grp) {
    grp.all_reduce(dp::view(whole[static_cast<std::size_t>(r)]), op).wait();
  }));
  for (int r = 0; r < n; ++r)
    CHECK(std::memcmp(parts_data[static_cast<std::size_t>(r)].data(), whole[static_cast<std::size_t>(r)].data(),
                      count * sizeof(T)) == 0);
}

/// Rank r's array `data` cut as cut() says, as a list of views.
template <class T>
std::vector<dp::tensor_ref> cut_list(std::vector<T>& data, int r) {
  std::vector<dp::tensor_ref> list;
  std::size_t at = 0;
  for (std::size_t s : cut(data.size(), r)) {
    list.push_back(dp::tensor_ref(dp::view(data)).subview(at, s));
    at += s;
  }
  return list;
}

template <class T>
void check_against_reduce_scatter(int n, std::size_t block, dp::reduce_op op, bool plain_rank0) {
  INFO(n << " ranks, blocks of " << block << ", op " << dp::name_of(op) << ", rank 0 plain " << plain_rank0);
  auto const un = static_cast<std::size_t>(n);
  std::vector<std::vector<T>> whole(un), parts_data(un), out_plain(un, std::vector<T>(block)),
      out_listed(un, std::vector<T>(block));
  test::rng g{block * 17 + un};
  for (auto& v : whole) {
    v.resize(un * block);
    for (auto& x : v) x = static_cast<T>(static_cast<float>(g.uniform() * 2 - 1));
  }
  parts_data = whole;
  std::vector<std::vector<dp::tensor_ref>> lists(un);
  for (int r = 0; r < n; ++r) lists[static_cast<std::size_t>(r)] = cut_list(parts_data[static_cast<std::size_t>(r)], r);
  auto coalesced = dp::host::make_group(n), plain = dp::host::make_group(n);
  test::rethrow_first(test::on_ranks(coalesced, [&](int r, dp::process_group& grp) {
    auto const ur = static_cast<std::size_t>(r);
    if (plain_rank0 && r == 0) grp.reduce_scatter(dp::view(out_listed[0]), dp::view(parts_data[0]), op).wait();
    else grp.reduce_scatter_coalesced(dp::view(out_listed[ur]), lists[ur], op).wait();
  }));
  test::rethrow_first(test::on_ranks(plain, [&](int r, dp::process_group& grp) {
    auto const ur = static_cast<std::size_t>(r);
    grp.reduce_scatter(dp::view(out_plain[ur]), dp::view(whole[ur]), op).wait();
  }));
  for (std::size_t r = 0; r < un; ++r) {
    CHECK(std::memcmp(out_listed[r].data(), out_plain[r].data(), block * sizeof(T)) == 0);
    CHECK(std::memcmp(parts_data[r].data(), whole[r].data(), un * block * sizeof(T)) == 0);  // inputs unchanged
  }
}

template <class T>
void check_all_gather(int n, std::size_t block, bool plain_rank0) {
  INFO(n << " ranks, blocks of " << block << ", rank 0 plain " << plain_rank0);
  auto const un = static_cast<std::size_t>(n);
  std::vector<std::vector<T>> arrays(un, std::vector<T>(un * block, static_cast<T>(-7.0f)));
  std::vector<T> expected(un * block);
  test::rng g{block * 5 + un};
  for (std::size_t r = 0; r < un; ++r)
    for (std::size_t i = 0; i < block; ++i)
      expected[r * block + i] = arrays[r][r * block + i] = static_cast<T>(static_cast<float>(g.uniform()));
  std::vector<std::vector<dp::tensor_ref>> lists(un);
  for (int r = 0; r < n; ++r) lists[static_cast<std::size_t>(r)] = cut_list(arrays[static_cast<std::size_t>(r)], r);
  auto groups = dp::host::make_group(n);
  test::rethrow_first(test::on_ranks(groups, [&](int r, dp::process_group& grp) {
    auto const ur = static_cast<std::size_t>(r);
    if (plain_rank0 && r == 0) {
      dp::tensor_ref const out = dp::view(arrays[0]);
      grp.all_gather(out, out.subview(0, block)).wait();
    } else {
      grp.all_gather_coalesced(lists[ur]).wait();
    }
  }));
  for (std::size_t r = 0; r < un; ++r) CHECK(std::memcmp(arrays[r].data(), expected.data(), un * block * sizeof(T)) == 0);
}

/// Every rank failed with a mismatched-collectives error that shows both calls.
void check_mismatch(std::vector<std::exception_ptr> const& errors, std::string const& one, std::string const& other) {
  using Catch::Matchers::Contains;
  for (auto const& e : errors) {
    REQUIRE(e);
    try {
      std::rethrow_exception(e);
    } catch (dp::comm_error const& x) {
      CHECK_THAT(x.what(), Contains("mismatched collectives"));
      CHECK_THAT(x.what(), Contains(one));
      CHECK_THAT(x.what(), Contains(other));
    }
  }
}

}  // namespace

TEST_CASE("all_reduce_coalesced gives all_reduce's bits, whatever cut each rank makes", "[host][comm]") {
  for (int n : {1, 2, 3, 4}) {
    // 1000 elements: the one-meeting path of small collectives; the others: stripes.
    for (std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{70001}, std::size_t{407050}}) {
      for (auto op : {dp::reduce_op::sum, dp::reduce_op::avg}) {
        check_against_all_reduce<float>(n, count, op, false);
        if (n > 1) check_against_all_reduce<float>(n, count, op, true);
      }
      check_against_all_reduce<double>(n, count, dp::reduce_op::avg, n > 2);
      check_against_all_reduce<dp::bf16>(n, count, dp::reduce_op::avg, false);
    }
  }
}

TEST_CASE("all_reduce_coalesced: a different count fails every rank, bad lists are refused", "[host][comm][error]") {
  using Catch::Matchers::Contains;
  std::vector<float> a(10), b(20), c(11);
  auto groups = dp::host::make_group(2, 10s);
  std::vector<dp::tensor_ref> mine{dp::view(a), dp::view(b)}, theirs{dp::view(b), dp::view(c)};
  auto const errors = test::on_ranks(groups, [&](int r, dp::process_group& g) {
    g.all_reduce_coalesced(r == 0 ? mine : theirs, dp::reduce_op::sum).wait();
  });
  check_mismatch(errors, "all_reduce_coalesced(30 x F32 in 2 tensors, sum)",
                 "all_reduce_coalesced(31 x F32 in 2 tensors, sum)");

  auto one = dp::host::make_group(1);
  std::vector<double> d(4);
  std::vector<dp::tensor_ref> const mixed{dp::view(a), dp::view(d)};
  CHECK_THROWS_WITH(one[0].all_reduce_coalesced(mixed), Contains("found tensor 1 of F64"));
  auto empty = dp::host::make_group(1);
  CHECK_THROWS_WITH(empty[0].all_reduce_coalesced({}), Contains("expected at least one tensor"));
}

TEST_CASE("reduce_scatter_coalesced and all_gather_coalesced give their plain forms' bits, whatever the cuts",
          "[host][comm]") {
  for (int n : {1, 2, 3, 4}) {
    // 300 elements per block: the one-meeting path of small collectives; the others: large.
    for (std::size_t block : {std::size_t{1}, std::size_t{300}, std::size_t{20000}, std::size_t{100003}}) {
      for (auto op : {dp::reduce_op::sum, dp::reduce_op::avg}) {
        check_against_reduce_scatter<float>(n, block, op, false);
        if (n > 1) check_against_reduce_scatter<float>(n, block, op, true);
      }
      check_against_reduce_scatter<dp::bf16>(n, block, dp::reduce_op::avg, n > 2);
      check_all_gather<float>(n, block, false);
      if (n > 1) check_all_gather<float>(n, block, true);
      check_all_gather<dp::bf16>(n, block, n > 2);
    }
  }
}

TEST_CASE("reduce_scatter_coalesced and all_gather_coalesced: mismatches fail every rank, bad lists are refused",
          "[host][comm][error]") {
  using Catch::Matchers::Contains;
  std::vector<float> a(10), b(20), c(12), out(15), out16(16);
  auto groups = dp::host::make_group(2, 10s);
  std::vector<dp::tensor_ref> mine{dp::view(a), dp::view(b)}, theirs{dp::view(b), dp::view(c)};
  auto const errors = test::on_ranks(groups, [&](int r, dp::process_group& g) {
    if (r == 0) g.reduce_scatter_coalesced(dp::view(out), mine).wait();
    else g.reduce_scatter_coalesced(dp::view(out16), theirs).wait();
  });
  check_mismatch(errors, "reduce_scatter_coalesced(out 15 x F32, in 30 x F32 in 2 tensors, sum)",
                 "reduce_scatter_coalesced(out 16 x F32, in 32 x F32 in 2 tensors, sum)");

  auto two = dp::host::make_group(2, 10s);
  CHECK_THROWS_WITH(two[1].reduce_scatter_coalesced(dp::view(out16), mine),
                    Contains("expected the tensors to hold size() * out.size() = 2 * 16 = 32 elements, found 30"));
  std::vector<dp::tensor_ref> const odd{dp::view(a), dp::tensor_ref(dp::view(c)).subview(0, 11)};
  CHECK_THROWS_WITH(two[0].all_gather_coalesced(odd), Contains("expected the tensors to hold size() = 2 blocks"));
  auto three = dp::host::make_group(2, 10s);
  std::vector<dp::tensor_ref> const in{dp::view(b)};
  CHECK_THROWS_WITH(three[0].reduce_scatter_coalesced(dp::tensor_ref(dp::view(b)).subview(5, 10), in),
                    Contains("expected `out` apart from the tensors it reduces, found it overlapping tensor 0"));
  std::vector<double> d(10);
  auto four = dp::host::make_group(2, 10s);
  CHECK_THROWS_WITH(four[0].reduce_scatter_coalesced(dp::view(d), in), Contains("expected `out` of the tensors' dtype F32"));
}

TEST_CASE("DDP with copying buckets leaves the gradients alone until the step function returns",
          "[host][ddp][contract]") {
  using model = test::chunked<float>;
  std::vector<std::size_t> const sizes = {3, 5, 1, 8, 2, 4};
  auto const data = test::dataset<float>::make(8, model(sizes).dim, 9, false);
  std::vector<std::vector<std::vector<float>>> local(2), seen(2), after(2);
  std::vector<std::uint64_t> done(2);
  std::size_t buckets_issued = 0;
  dp::spawn(2, [&](dp::rank_context& rank) {
    auto const r = static_cast<std::size_t>(rank.rank());
    model m(sizes, 3);
    dp::distributed_data_parallel<model> ddp(
        m, rank.group(), {.bucket_cap_mb = 16.0 / (1024 * 1024), .first_bucket_cap_mb = 16.0 / (1024 * 1024)});
    // A first step (the buckets are rebuilt after it, in the order backward marked them), then
    // the one observed.
    ddp.step(dp::slice_batch(data.all(), 4 * r, 4 * r + 4),
             [](model& x, test::samples<float> s, dp::step_context& ctx) { x.forward_backward(s, &ctx); });
    // The step's collectives: the broadcast of the model's buffer at its start, then one
    // all-reduce per bucket (as rebuilt after the first step).
    auto const ops = 1 + ddp.reducer().buckets().size();
    if (r == 0) buckets_issued = ops - 1;
    auto const before = rank.group().completed_ops();
    auto const shard = dp::slice_batch(data.all(), 4 * r, 4 * r + 4);
    ddp.step(shard, [&](model& x, test::samples<float> s, dp::step_context& ctx) {
      x.forward_backward(s, &ctx);  // marks every gradient ready: every bucket is issued
      local[r] = x.g;
      // Every bucket's all-reduce finishes while the step function still runs; then the gradients
      // must still be this rank's own.
      auto const deadline = std::chrono::steady_clock::now() + 10s;
      while (rank.group().completed_ops() < before + ops && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(100us);
      done[r] = rank.group().completed_ops() - before;
      seen[r] = x.g;
    });
    after[r] = m.g;
  });
  for (std::size_t r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(done[r] == buckets_issued + 1);  // the all-reduces did run during the step function
    CHECK(seen[r] == local[r]);
    CHECK(after[r] == after[0]);
  }
  CHECK(buckets_issued > 1);
  CHECK(local[0] != local[1]);
  CHECK(after[0] != local[0]);
}

// DDP on the host backend with thread ranks: the contracts of docs/design.md ("The four contracts") as equalities.
#include "models.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dpl = dparallel;
using model = test::chunked<float>;

namespace {

/// Rank r's slice of the global batch: rows [r*b, (r+1)*b).
test::samples<float> rank_slice(test::dataset<float> const& d, int rank, std::size_t b) {
  return dpl::slice_batch(d.all(), static_cast<std::size_t>(rank) * b, static_cast<std::size_t>(rank + 1) * b);
}

std::vector<double> one_device_gradient(test::dataset<float> const& d) {
  model m;
  m.forward_backward(d.all());
  return test::flat(m, true);
}

dpl::options tiny_buckets() {
  return {.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024)};
}

}  // namespace

TEST_CASE("DDP over N ranks equals one device on the global batch", "[host][ddp][contract]") {
  for (int world = 1; world <= 4; ++world) {
    for (bool hook : {false, true}) {
      for (bool many_buckets : {false, true}) {
        for (bool exact : {false, true}) {
          if (exact && world == 3) continue;  // averaging over 3 ranks is not exact in binary
          std::size_t const b = 8;
          auto const data = test::dataset<float>::make(b * static_cast<std::size_t>(world), model().dim,
                                                       static_cast<std::uint64_t>(world * 10 + hook), exact);
          auto const want = one_device_gradient(data);
          std::vector<std::vector<double>> got(static_cast<std::size_t>(world));
          dpl::spawn(world, [&](dpl::rank_context& rank) {
            model m;
            dpl::distributed_data_parallel<model> ddp(m, rank.group(), many_buckets ? tiny_buckets() : dpl::options{});
            ddp.step(rank_slice(data, rank.rank(), b), [&](model& r, test::samples<float> s, dpl::step_context& ctx) {
              return hook ? r.forward_backward(s, &ctx) : r.forward_backward(s);
            });
            got[static_cast<std::size_t>(rank.rank())] = test::flat(m, true);
          });
          INFO("world = " << world << ", grad_ready = " << hook << ", many buckets = " << many_buckets
                          << ", exact = " << exact);
          for (auto const& g : got) {
            if (exact) CHECK(g == want);
            else CHECK(test::rel_error(g, want) <= 1e-6);
            CHECK(g == got[0]);  // bitwise identical on every rank
          }
        }
      }
    }
  }
}

TEST_CASE("DDP replicas stay bitwise identical after every step; runs are reproducible", "[host][ddp][contract]") {
  auto train = [](int world) {
    std::vector<std::vector<std::uint64_t>> hashes(static_cast<std::size_t>(world));
    std::vector<double> final_params;
    dpl::spawn(world, [&](dpl::rank_context& rank) {
      model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(100 + rank.rank()));  // different until broadcast
      dpl::distributed_data_parallel<model> ddp(m, rank.group(), tiny_buckets());
      for (int step = 0; step < 5; ++step) {
        auto const data = test::dataset<float>::make(6 * static_cast<std::size_t>(world), m.dim,
                                                     static_cast<std::uint64_t>(step), false);
        ddp.step(rank_slice(data, rank.rank(), 6),
                 [](model& r, test::samples<float> s, dpl::step_context& ctx) { return r.forward_backward(s, &ctx); });
        ddp.module().sgd(0.05f);
        hashes[static_cast<std::size_t>(rank.rank())].push_back(test::param_hash(m));
      }
      if (rank.rank() == 0) final_params = test::flat(m, false);
    });
    for (auto const& h : hashes) CHECK(h == hashes[0]);
    return final_params;
  };
  for (int world : {2, 3, 4}) {
    auto const a = train(world), b = train(world);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
  }
}

TEST_CASE("DDP construction broadcasts rank 0's parameters and buffers", "[host][ddp]") {
  std::vector<std::vector<double>> params(3);
  std::vector<float> stats(3);
  dpl::spawn(3, [&](dpl::rank_context& rank) {
    model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(7 + rank.rank()));
    m.stats[0] = static_cast<float>(rank.rank() + 10);
    dpl::distributed_data_parallel<model> ddp(m, rank.group());
    params[static_cast<std::size_t>(rank.rank())] = test::flat(m, false);
    stats[static_cast<std::size_t>(rank.rank())] = m.stats[0];
  });
  model zero({3, 5, 1, 8, 2, 4}, 7);
  for (auto const& p : params) CHECK(p == test::flat(zero, false));
  CHECK(stats == std::vector<float>{10, 10, 10});
}

TEST_CASE("DDP broadcasts rank 0's buffers before each step unless told not to", "[host][ddp]") {
  for (bool broadcast : {true, false}) {
    std::vector<float> stats(2);
    dpl::spawn(2, [&](dpl::rank_context& rank) {
      model m;
      dpl::distributed_data_parallel<model> ddp(m, rank.group(), {.broadcast_buffers = broadcast});
      auto const data = test::dataset<float>::make(4, m.dim, 1, true);
      m.stats[0] = rank.rank() == 0 ? 100.0f : 500.0f;  // diverged running statistics
      ddp.step(rank_slice(data, rank.rank(), 2), [](model& r, test::samples<float> s) { return r.forward_backward(s); });
      stats[static_cast<std::size_t>(rank.rank())] = m.stats[0];
    });
    if (broadcast) CHECK(stats == std::vector<float>{102, 102});
    else CHECK(stats == std::vector<float>{102, 502});
  }
}

namespace {

// A model with buffers of three dtypes: four F32 (stats first), one I64, two U8.
struct many_buffers : model {
  std::vector<float> mean = std::vector<float>(5), var = std::vector<float>(3), scale = std::vector<float>(1);
  std::vector<std::int64_t> batches = std::vector<std::int64_t>(1);
  std::vector<std::uint8_t> mask = std::vector<std::uint8_t>(4), flags = std::vector<std::uint8_t>(2);
  std::vector<dpl::tensor_ref> buffers() {
    return {dpl::view(stats), dpl::view(mean), dpl::view(batches), dpl::view(var), dpl::view(mask), dpl::view(scale),
            dpl::view(flags)};
  }
  // Rank r's diverged running statistics (rank 0's have a -0 and a NaN with a payload: they must
  // arrive bit for bit).
  void diverge(int r, int step) {
    auto const f = static_cast<float>(r * 10 + step);
    for (std::size_t i = 0; i < mean.size(); ++i) mean[i] = f + 0.1f * static_cast<float>(i);
    for (std::size_t i = 0; i < var.size(); ++i) var[i] = -f - 0.3f * static_cast<float>(i);
    if (r == 0) {
      mean[1] = -0.0f;
      std::uint32_t const payload = 0x7fc12345u;
      std::memcpy(&var[2], &payload, sizeof payload);
    }
    scale[0] = f * 3.0f;
    batches[0] = 1000 * r + step;
    for (std::size_t i = 0; i < mask.size(); ++i) mask[i] = static_cast<std::uint8_t>(r * 7 + static_cast<int>(i));
    flags = {static_cast<std::uint8_t>(r), static_cast<std::uint8_t>(step)};
    stats[0] = f;
  }
  // Every buffer's bytes, in order.
  std::vector<unsigned char> bytes() {
    std::vector<unsigned char> out;
    for (auto const& b : buffers()) {
      auto const* p = static_cast<unsigned char const*>(b.data());
      out.insert(out.end(), p, p + b.size_bytes());
    }
    return out;
  }
};

// A group counting the broadcasts issued through it (the rest forwarded to the rank's group).
class counting_broadcasts {
 public:
  explicit counting_broadcasts(dpl::process_group inner) : inner_(std::move(inner)) {}
  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  dpl::work all_reduce(dpl::tensor_ref t, dpl::reduce_op op) { return inner_.all_reduce(t, op); }
  dpl::work reduce(dpl::tensor_ref t, int root, dpl::reduce_op op) { return inner_.reduce(t, root, op); }
  dpl::work broadcast(dpl::tensor_ref t, int root) {
    ++broadcasts;
    return inner_.broadcast(t, root);
  }
  dpl::work reduce_scatter(dpl::tensor_ref o, dpl::tensor_ref i, dpl::reduce_op op) { return inner_.reduce_scatter(o, i, op); }
  dpl::work all_gather(dpl::tensor_ref o, dpl::tensor_ref i) { return inner_.all_gather(o, i); }
  dpl::work barrier() { return inner_.barrier(); }
  void abort(std::string const& why) { inner_.abort(why); }
  std::atomic<int> broadcasts{0};

 private:
  dpl::process_group inner_;
};

}  // namespace

TEST_CASE("DDP broadcasts the buffers before each step as one broadcast per dtype, bit for bit rank 0's",
          "[host][ddp]") {
  // Seven buffers of three dtypes: three broadcasts per step (F32 and U8 packed into a block, the
  // one I64 in place) more than the same steps without broadcast_buffers (DDP's own broadcasts,
  // e.g. the bucket order after the first step, are the same in both), every rank ending with
  // rank 0's bytes.
  int const world = 3, steps = 3;
  std::vector<std::vector<int>> counts[2];  // [broadcast_buffers][rank][step]
  std::vector<std::vector<std::vector<unsigned char>>> got(world), sent(world);
  for (bool const broadcast : {true, false}) {
    auto& count = counts[broadcast ? 1 : 0];
    count.assign(world, {});
    dpl::spawn(world, [&](dpl::rank_context& rank) {
      int const r = rank.rank();
      auto const counter = std::make_shared<counting_broadcasts>(rank.group());
      many_buffers m;
      dpl::distributed_data_parallel<many_buffers> ddp(m, dpl::process_group(counter), {.broadcast_buffers = broadcast});
      auto const data = test::dataset<float>::make(6, m.dim, 3, true);
      for (int step = 0; step < steps; ++step) {
        m.diverge(r, step);
        if (broadcast) sent[static_cast<std::size_t>(r)].push_back(m.bytes());
        int const before = counter->broadcasts;
        ddp.step(rank_slice(data, r, 2), [](many_buffers& x, test::samples<float> s) { return x.forward_backward(s); });
        count[static_cast<std::size_t>(r)].push_back(counter->broadcasts - before);
        m.stats[0] -= 2.0f;  // the step's own update of stats (2 samples): only the broadcast remains
        if (broadcast) got[static_cast<std::size_t>(r)].push_back(m.bytes());
      }
    });
  }
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    for (int step = 0; step < steps; ++step) {
      INFO("step " << step);
      auto const u = static_cast<std::size_t>(r), k = static_cast<std::size_t>(step);
      CHECK(counts[1][u][k] - counts[0][u][k] == 3);
      CHECK(got[u][k] == sent[0][k]);
      if (r != 0) CHECK(sent[u][k] != sent[0][k]);
    }
  }
}

TEST_CASE("DDP overlaps: a bucket is reduced while backward is still running", "[host][ddp][overlap]") {
  // Every parameter is its own bucket. After marking the last parameter (the first bucket) ready,
  // backward waits until the communicator reports a finished collective. Without overlap, nothing
  // would be reduced before the step function returns, and the wait would give up.
  std::vector<int> overlapped(2, 0);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model m;
    dpl::distributed_data_parallel<model> ddp(m, rank.group(), tiny_buckets());
    auto const data = test::dataset<float>::make(8, m.dim, 3, false);
    ddp.step(rank_slice(data, rank.rank(), 4), [&](model& r, test::samples<float> s, dpl::step_context& ctx) {
      auto const before = rank.group().completed_ops();
      return r.forward_backward(s, &ctx, [&](std::size_t p) {
        if (p != r.w.size() - 1) return;
        auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (rank.group().completed_ops() == before && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        overlapped[static_cast<std::size_t>(rank.rank())] = rank.group().completed_ops() > before;
      });
    });
  });
  CHECK(overlapped == std::vector<int>{1, 1});
}

TEST_CASE("no_sync for k micro-steps then one synced step equals one step on the concatenated batch",
          "[host][ddp][contract]") {
  for (int world : {1, 2, 4}) {
    for (int k : {1, 3}) {
      std::size_t const b = 4;
      std::size_t const per_rank = b * static_cast<std::size_t>(k + 1);
      // Rank r's micro-batches are rows [r*per_rank + j*b, ...): together, the whole dataset.
      auto const data = test::dataset<float>::make(per_rank * static_cast<std::size_t>(world), model().dim,
                                                   static_cast<std::uint64_t>(world + k), false);
      auto const want = one_device_gradient(data);
      std::vector<std::vector<double>> got(static_cast<std::size_t>(world));
      dpl::spawn(world, [&](dpl::rank_context& rank) {
        model m;
        dpl::distributed_data_parallel<model> ddp(m, rank.group(), tiny_buckets());
        auto micro = [&](int j) {
          std::size_t const first = static_cast<std::size_t>(rank.rank()) * per_rank + static_cast<std::size_t>(j) * b;
          return dpl::slice_batch(data.all(), first, first + b);
        };
        auto fn = [](model& r, test::samples<float> s, dpl::step_context& ctx) { return r.forward_backward(s, &ctx); };
        {
          auto scope = ddp.no_sync();
          for (int j = 0; j < k; ++j) ddp.step(micro(j), fn);
        }
        ddp.step(micro(k), fn);
        got[static_cast<std::size_t>(rank.rank())] = test::flat(m, true);
      });
      INFO("world = " << world << ", k = " << k);
      for (auto const& g : got) {
        CHECK(test::rel_error(g, want) <= 1e-6);
        CHECK(g == got[0]);
      }
    }
  }
}

TEST_CASE("a rank that throws in step_fn fails every rank, naming it; nothing hangs", "[host][ddp][error]") {
  std::vector<std::string> seen(3);
  std::mutex mu;
  auto const t0 = std::chrono::steady_clock::now();
  try {
    dpl::spawn(
        3,
        [&](dpl::rank_context& rank) {
          model m;
          dpl::distributed_data_parallel<model> ddp(m, rank.group());
          auto const data = test::dataset<float>::make(6, m.dim, 3, false);
          try {
            ddp.step(rank_slice(data, rank.rank(), 2), [&](model& r, test::samples<float> s, dpl::step_context& ctx) {
              if (rank.rank() == 1) throw std::runtime_error("out of memory in layer 3");
              return r.forward_backward(s, &ctx);
            });
          } catch (std::exception const& e) {
            std::lock_guard lock(mu);
            seen[static_cast<std::size_t>(rank.rank())] = e.what();
            throw;
          }
        },
        {.timeout = std::chrono::seconds(30)});
    FAIL("spawn must rethrow");
  } catch (dpl::error const& e) {
    CHECK_THAT(e.what(), Catch::Contains("rank 1") && Catch::Contains("out of memory in layer 3"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(25));  // failed by abort, not by timeout
  for (int r : {0, 2}) CHECK_THAT(seen[static_cast<std::size_t>(r)], Catch::Contains("rank 1"));
}

TEST_CASE("a parameter never marked ready is reported by index, or tolerated on request", "[host][ddp][error]") {
  // Marks every gradient but parameter 2's.
  auto skip_two = [](model& r, test::samples<float> s, dpl::step_context& ctx) {
    float const loss = r.forward_backward(s);
    for (std::size_t p = r.w.size(); p-- > 0;)
      if (p != 2) ctx.grad_ready(p);
    return loss;
  };
  try {
    dpl::spawn(
        2,
        [&](dpl::rank_context& rank) {
          model m;
          dpl::distributed_data_parallel<model> ddp(m, rank.group());
          auto const data = test::dataset<float>::make(4, m.dim, 3, false);
          ddp.step(rank_slice(data, rank.rank(), 2), skip_two);
        },
        {.timeout = std::chrono::seconds(30)});
    FAIL("expected the unused parameter to be reported");
  } catch (dpl::error const& e) {
    CHECK_THAT(e.what(), Catch::Contains("never for parameter(s) 2") && Catch::Contains("find_unused_parameters"));
  }
  std::vector<std::vector<float>> g2(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model m;
    dpl::distributed_data_parallel<model> ddp(m, rank.group(), {.find_unused_parameters = true});
    auto const data = test::dataset<float>::make(4, m.dim, 3, false);
    ddp.step(rank_slice(data, rank.rank(), 2), skip_two);
    g2[static_cast<std::size_t>(rank.rank())] = m.g[2];
  });
  CHECK(g2[0] == std::vector<float>{0.0f});  // an unused parameter contributes a zero gradient
  CHECK(g2[1] == std::vector<float>{0.0f});
}

TEST_CASE("ranks with different parameters fail construction on every rank, naming the rank and parameter",
          "[host][ddp][error]") {
  std::vector<std::string> seen(3);
  std::mutex mu;
  CHECK_THROWS(dpl::spawn(3, [&](dpl::rank_context& rank) {
    model m(rank.rank() == 2 ? std::vector<std::size_t>{3, 5, 1, 7, 2, 4} : std::vector<std::size_t>{3, 5, 1, 8, 2, 4});
    try {
      dpl::distributed_data_parallel<model> ddp(m, rank.group());
    } catch (std::exception const& e) {
      std::lock_guard lock(mu);
      seen[static_cast<std::size_t>(rank.rank())] = e.what();
      throw;
    }
  }));
  for (auto const& s : seen) CHECK_THAT(s, Catch::Contains("rank 2's parameter 3 has 7 elements"));
}

namespace {
/// Two parameters whose gradients alias: gradient 0 over parameter 0's memory (`over_param`), or
/// both gradients over one buffer; `own` gives each its own memory.
struct aliased_grads {
  enum class kind { own, over_param, one_buffer } k = kind::own;
  std::vector<float> w1{1, 2}, w2{3, 4}, g1{0, 0}, g2{0, 0};
  auto parameters() { return std::array{dpl::view(w1), dpl::view(w2)}; }
  auto gradients() {
    return std::array{dpl::view(k == kind::over_param ? w1 : g1), dpl::view(k == kind::one_buffer ? g1 : g2)};
  }
};
}  // namespace

TEST_CASE("DDP refuses gradients that share memory with a parameter or with each other, on every rank",
          "[host][ddp][error]") {
  using kind = aliased_grads::kind;
  for (auto const& [k, expected] : {std::pair{kind::over_param, "gradient 0 shares memory with parameter 0"},
                                   std::pair{kind::one_buffer, "gradient 1 shares memory with gradient 0"}}) {
    for (bool as_view : {false, true}) {
      std::vector<std::string> seen(2);
      std::mutex mu;
      CHECK_THROWS(dpl::spawn(2, [&, k = k](dpl::rank_context& rank) {
        aliased_grads m;
        m.k = k;
        try {
          dpl::distributed_data_parallel<aliased_grads> ddp(m, rank, {.gradient_as_bucket_view = as_view});
        } catch (std::exception const& e) {
          std::lock_guard lock(mu);
          seen[static_cast<std::size_t>(rank.rank())] = e.what();
          throw;
        }
      }));
      for (int r = 0; r < 2; ++r)
        CHECK_THAT(seen[static_cast<std::size_t>(r)],
                   Catch::Contains("DDP on rank " + std::to_string(r) + ": the model: " + expected) &&
                       Catch::Contains("every gradient needs memory of its own"));
    }
  }
  dpl::spawn(2, [&](dpl::rank_context& rank) {  // each gradient in memory of its own: fine
    aliased_grads m;
    dpl::distributed_data_parallel<aliased_grads> ddp(m, rank);
  });
}

TEST_CASE("buckets are rebuilt once, in the order gradients became ready", "[host][ddp]") {
  struct plans {
    std::vector<dpl::bucket_spec> initial, rebuilt, later;
  };
  std::vector<plans> seen(2);  // one slot per rank; checked after spawn (Catch2 asserts on one thread)
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model m;
    dpl::distributed_data_parallel<model> ddp(m, rank.group(), tiny_buckets());
    auto& mine = seen[static_cast<std::size_t>(rank.rank())];
    mine.initial = ddp.reducer().buckets();
    auto const data = test::dataset<float>::make(4, m.dim, 3, false);
    // Mark gradients in forward order 0, 1, 2, ... (after computing them all).
    auto forward_order = [](model& r, test::samples<float> s, dpl::step_context& ctx) {
      float const loss = r.forward_backward(s);
      for (std::size_t p = 0; p < r.w.size(); ++p) ctx.grad_ready(p);
      return loss;
    };
    ddp.step(rank_slice(data, rank.rank(), 2), forward_order);
    mine.rebuilt = ddp.reducer().buckets();
    ddp.step(rank_slice(data, rank.rank(), 2),
             [](model& r, test::samples<float> s, dpl::step_context& ctx) { return r.forward_backward(s, &ctx); });
    mine.later = ddp.reducer().buckets();
  });
  for (auto const& p : seen) {
    REQUIRE(p.initial.size() > 1);
    CHECK(p.initial.front().params.front() == model().w.size() - 1);  // reverse parameter order at first
    CHECK(p.rebuilt.front().params.front() == 0);                      // then the observed order
    CHECK(p.later == p.rebuilt);                                       // rebuilt only once
    CHECK(p.rebuilt == seen[0].rebuilt);                               // the same plan on every rank
  }
}

TEST_CASE("bucket plan: caps, first bucket, dtypes never mixed", "[core][buckets]") {
  using dpl::dtype;
  // 4-byte floats: sizes in elements 100, 200, 300, 50; first cap 400 bytes, cap 1000 bytes.
  auto b = dpl::plan_buckets({100, 200, 300, 50}, {dtype::f32, dtype::f32, dtype::f32, dtype::f32},
                             dpl::reverse_order(4), 400, 1000);
  REQUIRE(b.size() == 2);
  CHECK(b[0].params == std::vector<std::size_t>{3, 2});  // 200 B, then 1400 B >= 400: closed
  CHECK(b[0].offsets == std::vector<std::size_t>{0, 50});
  CHECK(b[1].params == std::vector<std::size_t>{1, 0});
  CHECK(b[1].elements == 300);
  auto mixed = dpl::plan_buckets({10, 10, 10}, {dtype::f32, dtype::f64, dtype::f32}, {0, 1, 2}, 1 << 20, 1 << 20);
  REQUIRE(mixed.size() == 2);
  CHECK(mixed[0].params == std::vector<std::size_t>{0, 2});
  CHECK(mixed[1].dtype == dtype::f64);
  CHECK_THROWS_AS(dpl::plan_buckets({1, 2}, {dtype::f32, dtype::f32}, {0, 0}, 1, 1), dpl::invalid_argument);
}

namespace {
/// DDP where gradients are reduced onto rank 0 only and rank 0 alone updates the model; its
/// parameters reach the other ranks before each step.
struct ddp_to_root : dpl::ddp {
  using replicate = dpl::policy::broadcast_each_step;
  using reduce = dpl::policy::bucketed_reduce_to_root;
};
static_assert(dpl::semantics<ddp_to_root>);
}  // namespace

TEST_CASE("policies compose: DDP with reduce-to-root equals DDP with all-reduce on rank 0", "[host][ddp][policy]") {
  int const world = 3;
  auto train = [&](auto semantics_tag, std::vector<std::vector<std::uint64_t>>& hashes) {
    using S = decltype(semantics_tag);
    std::vector<double> rank0;
    dpl::spawn(world, [&](dpl::rank_context& rank) {
      model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(5 + rank.rank()));
      dpl::parallel<model, S> wrapped(m, rank.group(), tiny_buckets());
      for (int step = 0; step < 4; ++step) {
        auto const data = test::dataset<float>::make(4 * world, m.dim, static_cast<std::uint64_t>(step), false);
        wrapped.step(rank_slice(data, rank.rank(), 4), [&](model& r, test::samples<float> s, dpl::step_context& ctx) {
          hashes[static_cast<std::size_t>(rank.rank())].push_back(test::param_hash(r));  // parameters at step start
          return r.forward_backward(s, &ctx);
        });
        if (rank.rank() == 0 || !std::is_same_v<S, ddp_to_root>) m.sgd(0.05f);
      }
      if (rank.rank() == 0) rank0 = test::flat(m, false);
    });
    return rank0;
  };
  std::vector<std::vector<std::uint64_t>> h_root(world), h_all(world);
  auto const root = train(ddp_to_root{}, h_root);
  auto const all = train(dpl::ddp{}, h_all);
  CHECK(root == all);
  for (int r = 0; r < world; ++r) {
    CHECK(h_root[static_cast<std::size_t>(r)] == h_root[0]);  // every rank starts each step from rank 0's model
    CHECK(h_root[static_cast<std::size_t>(r)] == h_all[0]);
  }
}

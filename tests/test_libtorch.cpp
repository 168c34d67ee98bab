// The libtorch adapter (<dparallel/adapters/libtorch.hpp>): a torch::nn module under DP and DDP
// equals the same module trained on one device; autograd's hooks start DDP's buckets during
// backward; gradients keep their memory; torch::Tensor batches slice on dim 0. One translation
// unit on purpose (libtorch is heavy to compile). The hidden case "[.python]" writes the files
// that tests/test_libtorch_state_dict.py loads into the Python module.
#include <dparallel/adapters/libtorch.hpp>  // first: the adapter's header compiles on its own

#include <dparallel/dparallel.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/spawn.hpp>
#if DPARALLEL_TEST_LIBTORCH_MPI
#include <dparallel/comm/mpi.hpp>
#endif

#include <catch2/catch.hpp>

#include "libtorch_fixture.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace dpl = dparallel;

namespace {

using namespace libtorch_fixture;

dpl::options tiny_buckets() {
  dpl::options o;
  o.bucket_cap_mb = 8.0 / (1024 * 1024);
  o.first_bucket_cap_mb = 4.0 / (1024 * 1024);
  return o;
}

// DDP over `world` thread ranks, rank r feeding rows [r*b, (r+1)*b); each rank's final parameters.
std::vector<torch::Tensor> ddp_run(fixture const& f, int world, dpl::options const& opts) {
  std::vector<Net> nets;
  for (int r = 0; r < world; ++r) nets.push_back(f.copy());
  std::vector<torch::Tensor> out(static_cast<std::size_t>(world));
  std::int64_t const b = f.x.size(0) / world;
  dpl::spawn(world, [&](dpl::rank_context& rank) {
    auto const r = static_cast<std::size_t>(rank.rank());
    Net& m = nets[r];
    dpl::distributed_data_parallel<Net> ddp(m, rank, opts);
    torch::optim::SGD opt(m->parameters(), lr);
    batch_t const mine{f.x.narrow(0, rank.rank() * b, b), f.y.narrow(0, rank.rank() * b, b)};
    for (int s = 0; s < steps; ++s) {
      ddp.step(mine, step_fn);
      opt.step();
    }
    out[r] = flat(m);
  });
  return out;
}

}  // namespace

TEST_CASE("libtorch: the adapter describes the module as named views of its own tensors", "[libtorch]") {
  fixture const f;
  Net m = f.copy();
  static_assert(dpl::model<Net> && dpl::replicable_model<Net>);
  static_assert(dpl::model<std::shared_ptr<NetImpl>>);
  auto const params = dpl::parameter_refs(m);
  auto const grads = dpl::gradient_refs(m);  // allocates the gradients autograd has not made yet
  REQUIRE(params.size() == 4);
  REQUIRE(grads.size() == 4);
  auto const named = m->named_parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    CHECK(params[i].data() == named[i].value().data_ptr());
    CHECK(grads[i].data() == named[i].value().grad().data_ptr());
    CHECK(params[i].dtype() == dpl::dtype::f64);
    CHECK(params[i].size() == static_cast<std::size_t>(named[i].value().numel()));
  }
  CHECK(dpl::parameter_names(m) == std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"});
  CHECK(dpl::buffer_names(m) == std::vector<std::string>{"scale"});
  CHECK(dpl::buffer_refs(m).at(0).data() == m->scale.data_ptr());
  CHECK(dpl::gradient_refs(m).at(0).data() == grads[0].data());  // made once, not per call

  Net replica = f.copy();
  CHECK(dpl::parameter_refs(replica).at(0).data() != params[0].data());
  CHECK(torch::equal(replica->fc1->weight, m->fc1->weight));

  Net frozen = f.copy();
  frozen->fc1->weight.set_data(frozen->fc1->weight.t());  // a non-contiguous parameter
  CHECK_THROWS_WITH(dpl::parameter_refs(frozen), Catch::Contains("fc1.weight") && Catch::Contains("not contiguous"));
}

TEST_CASE("libtorch: torch::Tensor, tuples and structs of tensors are batches sliced on dim 0", "[libtorch]") {
  fixture const f;
  struct xy {
    torch::Tensor x, y;
  };
  static_assert(dpl::batch<torch::Tensor> && dpl::batch<batch_t> && dpl::batch<xy>);
  CHECK(dpl::batch_size(f.x) == 12);
  CHECK(torch::equal(dpl::slice_batch(f.x, 2, 5), f.x.narrow(0, 2, 3)));
  xy const s = dpl::slice_batch(xy{f.x, f.y}, 4, 10);
  CHECK(torch::equal(s.x, f.x.narrow(0, 4, 6)));
  CHECK(torch::equal(s.y, f.y.narrow(0, 4, 6)));
  CHECK(dpl::slice_batch(f.x, 0, 3).data_ptr() == f.x.data_ptr());  // a view, not a copy
  CHECK_THROWS_WITH(dpl::batch_size(batch_t{f.x, f.y.narrow(0, 0, 5)}), Catch::Contains("same number of samples"));
  CHECK_THROWS_WITH(dpl::batch_size(torch::tensor(1.0)), Catch::Contains("0-dimensional"));
}

TEST_CASE("libtorch: DataParallel over 2 and 3 host devices equals one device after 20 steps", "[libtorch][dp]") {
  fixture const f;
  torch::Tensor const ref = one_device(f);
  for (int n : {2, 3}) {
    Net m = f.copy();
    dpl::data_parallel<Net> dp(m, host_devices(n));
    torch::optim::SGD opt(m->parameters(), lr);
    std::vector<void*> grads_before;
    for (int s = 0; s < steps; ++s) {
      if (s % 2 == 0) opt.zero_grad();  // not needed (each shard starts from zeroed gradients), but harmless
      dp.step(batch_t{f.x, f.y}, step_fn);
      opt.step();
      if (s == 0)
        for (auto const& g : dpl::gradient_refs(dp.replica(static_cast<std::size_t>(n - 1)))) grads_before.push_back(g.data());
    }
    INFO(n << " devices");
    CHECK(relative(flat(m), ref) <= 1e-5);
    std::vector<void*> grads_after;
    for (auto const& g : dpl::gradient_refs(dp.replica(static_cast<std::size_t>(n - 1)))) grads_after.push_back(g.data());
    CHECK(grads_after == grads_before);  // the gradients kept their memory: allocated once
  }
  // A struct batch takes the same path as the tuple.
  struct xy {
    torch::Tensor x, y;
  };
  Net a = f.copy(), b = f.copy();
  dpl::data_parallel<Net> da(a, host_devices(2)), db(b, host_devices(2));
  da.step(batch_t{f.x, f.y}, step_fn);
  db.step(xy{f.x, f.y}, [](Net& m, xy s) { torch::mse_loss(m->forward(s.x), s.y).backward(); });
  CHECK(torch::equal(a->fc1->weight.grad(), b->fc1->weight.grad()));
}

TEST_CASE("libtorch: DDP over 2 thread ranks equals one device after 20 steps", "[libtorch][ddp]") {
  fixture const f;
  torch::Tensor const ref = one_device(f);
  dpl::options view;
  view.gradient_as_bucket_view = true;
  std::vector<std::pair<char const*, dpl::options>> const variants{
      {"default buckets", dpl::options{}}, {"one bucket per parameter", tiny_buckets()}, {"gradient_as_bucket_view", view}};
  for (auto const& [name, opts] : variants) {
    auto const out = ddp_run(f, 2, opts);
    INFO(name);
    CHECK(relative(out[0], ref) <= 1e-5);
    CHECK(torch::equal(out[0], out[1]));  // replicas identical
  }
}

TEST_CASE("libtorch: with gradient_as_bucket_view DDP lays the gradients out in one block, values kept",
          "[libtorch][ddp]") {
  fixture const f;
  std::vector<Net> nets{f.copy(), f.copy()};
  std::vector<std::string> problems(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    auto const r = static_cast<std::size_t>(rank.rank());
    Net& m = nets[r];
    std::vector<torch::Tensor> before;
    {
      torch::NoGradGuard const no_grad;
      for (auto& p : m->parameters()) {
        p.mutable_grad() = torch::rand_like(p);
        before.push_back(p.grad().clone());
      }
    }
    dpl::options opts;
    opts.gradient_as_bucket_view = true;
    dpl::distributed_data_parallel<Net> ddp(m, rank, opts);
    std::string& problem = problems[r];
    if (!ddp.reducer().gradients_bound()) problem += "not bound; ";
    auto const params = m->parameters();
    auto const* next = static_cast<std::byte const*>(params[0].grad().data_ptr());
    for (std::size_t i = 0; i < params.size(); ++i) {
      torch::Tensor const g = params[i].grad();
      if (g.data_ptr() != next) problem += "gradient " + std::to_string(i) + " not after the one before; ";
      if (!torch::equal(g, before[i])) problem += "gradient " + std::to_string(i) + " lost its values; ";
      next = static_cast<std::byte const*>(g.data_ptr()) + g.nbytes();
    }
  });
  CHECK(problems == std::vector<std::string>{"", ""});
}

TEST_CASE("libtorch: autograd's hooks start DDP's buckets while backward is still running", "[libtorch][ddp][overlap]") {
  // Every parameter is its own bucket. Backward reaches the hidden activation's gradient after
  // fc2's parameters are accumulated (their accumulators run first); a hook there waits until
  // the communicator reports a finished collective. Without overlap nothing would be reduced
  // before the step function returns, and the wait would give up.
  fixture const f;
  std::vector<Net> nets{f.copy(), f.copy()};
  std::vector<int> overlapped(2, 0);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    auto const r = static_cast<std::size_t>(rank.rank());
    dpl::distributed_data_parallel<Net> ddp(nets[r], rank, tiny_buckets());
    batch_t const mine{f.x.narrow(0, rank.rank() * 6, 6), f.y.narrow(0, rank.rank() * 6, 6)};
    ddp.step(mine, [&](Net& m, batch_t b) {
      auto const before = rank.group().completed_ops();
      torch::Tensor h = torch::tanh(m->fc1(std::get<0>(b)));
      h.register_hook([&](torch::Tensor const&) {
        auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (rank.group().completed_ops() == before && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        overlapped[r] = rank.group().completed_ops() > before;
      });
      torch::mse_loss(m->fc2(h) * m->scale, std::get<1>(b)).backward();
    });
  });
  CHECK(overlapped == std::vector<int>{1, 1});
}

TEST_CASE("libtorch: a second backward in one step is reported, naming the parameter", "[libtorch][ddp][error]") {
  fixture const f;
  std::vector<Net> nets{f.copy(), f.copy()};
  std::vector<std::string> errors(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    auto const r = static_cast<std::size_t>(rank.rank());
    dpl::distributed_data_parallel<Net> ddp(nets[r], rank);
    try {
      ddp.step(batch_t{f.x, f.y}, [](Net& m, batch_t b) {
        step_fn(m, b);
        step_fn(m, b);
      });
    } catch (std::exception const& e) {
      errors[r] = e.what();
    }
  });
  for (auto const& e : errors) CHECK_THAT(e, Catch::Contains("marked ready twice"));
}

#if DPARALLEL_TEST_LIBTORCH_MPI
// Run by the test mpi:np2:libtorch under `mpirun -np 2` (this executable then has the MPI Catch2
// runner, tests/mpi/mpi_main.cpp); hidden from the single-process run.
TEST_CASE("libtorch: DDP over MPI processes equals one device after 20 steps", "[.mpi]") {
  auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, std::chrono::seconds(60));
  fixture const f;
  REQUIRE(f.x.size(0) % g.size() == 0);
  torch::Tensor const ref = one_device(f);
  std::int64_t const b = f.x.size(0) / g.size();
  dpl::options view;
  view.gradient_as_bucket_view = true;  // the gradients in the group's memory (on one node)
  for (auto const& opts : {dpl::options{}, tiny_buckets(), view}) {
    Net m = f.copy();
    dpl::distributed_data_parallel<Net> ddp(m, g, opts);
    torch::optim::SGD opt(m->parameters(), lr);
    batch_t const mine{f.x.narrow(0, g.rank() * b, b), f.y.narrow(0, g.rank() * b, b)};
    for (int s = 0; s < steps; ++s) {
      ddp.step(mine, step_fn);
      opt.step();
    }
    INFO("rank " << g.rank() << " of " << g.size() << ", " << opts.bucket_cap_mb << " MiB buckets, bucket view "
                  << opts.gradient_as_bucket_view);
    CHECK(ddp.reducer().gradients_bound() == opts.gradient_as_bucket_view);
    CHECK(relative(flat(m), ref) <= 1e-5);
  }
}
#endif

// Not run by default: tests/test_libtorch_state_dict.py runs it with DPARALLEL_TORCH_STATE_DIR
// set, then loads net.safetensors into the Python module and checks its output on io.safetensors.
TEST_CASE("libtorch: write a trained state dict and a forward pass for Python", "[.python]") {
  char const* dir = std::getenv("DPARALLEL_TORCH_STATE_DIR");
  REQUIRE(dir != nullptr);
  std::filesystem::path const out(dir);
  std::filesystem::create_directories(out);
  fixture const f;
  Net m = f.copy();
  {
    dpl::data_parallel<Net> dp(m, host_devices(2));
    torch::optim::SGD opt(m->parameters(), lr);
    for (int s = 0; s < 3; ++s) {
      dp.step(batch_t{f.x, f.y}, step_fn);
      opt.step();
    }
    dpl::save_state_dict(out / "net.safetensors", dp);
  }
  torch::Tensor expected;
  {
    torch::NoGradGuard const no_grad;
    expected = m->forward(f.x).contiguous();
  }
  torch::Tensor const x = f.x.contiguous();
  dpl::save_safetensors(out / "io.safetensors",
                        {dpl::named_tensor{"x", dpl::libtorch::view(x, "x"), std::vector<std::uint64_t>{12, 6}},
                         dpl::named_tensor{"expected", dpl::libtorch::view(expected, "expected"),
                                           std::vector<std::uint64_t>{12, 3}}});
}

// The libtorch adapter where PyTorch's own habits meet dparallel's contract: frozen parameters,
// step functions that drop or replace .grad (zero_grad(set_to_none), libtorch 2.x's default),
// bool buffers, DataParallel's tensor outputs, modules that are not Cloneable, the errors' text.
// Each case is an equality against libtorch alone on one device.
#include <dparallel/adapters/libtorch_hooks.hpp>  // first: the hooks' header compiles on its own

#include <dparallel/adapters/libtorch.hpp>

#include <dparallel/dparallel.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "libtorch_fixture.hpp"
#include "scratch.hpp"

namespace dpl = dparallel;
using namespace libtorch_fixture;

namespace {

// SGD with weight decay: a frozen parameter given a zero .grad would shrink.
torch::optim::SGD sgd(Net& m) {
  return torch::optim::SGD(m->parameters(), torch::optim::SGDOptions(lr).weight_decay(0.1));
}

Net frozen_copy(fixture const& f) {
  Net m = f.copy();
  m->fc1->weight.set_requires_grad(false);
  return m;
}

// libtorch alone, one device: `steps` steps of `fn` on the whole batch.
torch::Tensor alone(fixture const& f, Net m, std::function<void(Net&, batch_t)> const& fn) {
  auto opt = sgd(m);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    fn(m, batch_t{f.x, f.y});
    opt.step();
  }
  return flat(m);
}

// DDP over 2 thread ranks (rank r: rows [6r, 6r + 6)) with `fn`; each rank's final parameters.
std::vector<torch::Tensor> ddp_pair(fixture const& f, std::vector<Net>& nets, dpl::options const& opts,
                                    std::function<void(Net&, batch_t)> const& fn) {
  std::vector<torch::Tensor> out(2);
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    auto const r = static_cast<std::size_t>(rank.rank());
    dpl::distributed_data_parallel<Net> ddp(nets[r], rank, opts);
    auto opt = sgd(nets[r]);
    batch_t const mine{f.x.narrow(0, rank.rank() * 6, 6), f.y.narrow(0, rank.rank() * 6, 6)};
    for (int s = 0; s < steps; ++s) {
      ddp.step(mine, fn);
      opt.step();
    }
    out[r] = flat(nets[r]);
  });
  return out;
}

dpl::options bucket_view() {
  dpl::options o;
  o.gradient_as_bucket_view = true;
  return o;
}

}  // namespace

TEST_CASE("libtorch: frozen parameters get no .grad and stay unchanged, as in PyTorch", "[libtorch][frozen]") {
  fixture const f;
  Net const start = frozen_copy(f);
  torch::Tensor const frozen_before = start->fc1->weight.detach().clone();
  torch::Tensor const ref = alone(f, frozen_copy(f), step_fn);
  SECTION("DataParallel over 2 devices: the replicas are frozen too") {
    Net m = frozen_copy(f);
    dpl::data_parallel<Net> dp(m, host_devices(2));
    CHECK_FALSE(dp.replica(1)->fc1->weight.requires_grad());
    auto opt = sgd(m);
    for (int s = 0; s < steps; ++s) {
      dp.step(batch_t{f.x, f.y}, step_fn);
      CHECK_FALSE(m->fc1->weight.grad().defined());
      opt.step();
    }
    CHECK(torch::equal(m->fc1->weight, frozen_before));
    CHECK(relative(flat(m), ref) <= 1e-5);
  }
  SECTION("DataParallel: the replicas follow the module's flags when they change between steps") {
    // fc1.weight frozen for 7 steps, then trainable; fc2.bias frozen from step 12 on.
    auto const flags = [](Net& m, int s) {
      if (s == 7) m->fc1->weight.set_requires_grad(true);
      if (s == 12) m->fc2->bias.set_requires_grad(false);
    };
    Net lone = frozen_copy(f);
    auto lone_opt = sgd(lone);
    Net m = frozen_copy(f);
    dpl::data_parallel<Net> dp(m, host_devices(3));
    auto opt = sgd(m);
    for (int s = 0; s < steps; ++s) {
      flags(lone, s);
      flags(m, s);
      lone->zero_grad(/*set_to_none=*/false);  // what the adapter does: fc2.bias keeps a zero .grad
      step_fn(lone, batch_t{f.x, f.y});
      lone_opt.step();
      dp.step(batch_t{f.x, f.y}, step_fn);
      opt.step();
    }
    CHECK(dp.replica(2)->fc1->weight.requires_grad());
    CHECK_FALSE(dp.replica(2)->fc2->bias.requires_grad());
    CHECK(relative(flat(m), flat(lone)) <= 1e-5);
  }
  SECTION("DDP over 2 thread ranks, without find_unused_parameters, with and without bucket views") {
    for (auto const& opts : {dpl::options{}, bucket_view()}) {
      std::vector<Net> nets{frozen_copy(f), frozen_copy(f)};
      auto const out = ddp_pair(f, nets, opts, step_fn);
      INFO("gradient_as_bucket_view " << opts.gradient_as_bucket_view);
      for (auto& m : nets) {
        CHECK_FALSE(m->fc1->weight.grad().defined());
        CHECK(torch::equal(m->fc1->weight, frozen_before));
      }
      CHECK(relative(out[0], ref) <= 1e-5);
      CHECK(torch::equal(out[0], out[1]));
    }
  }
}

TEST_CASE("libtorch: a step function that drops or replaces .grad trains as one that does not", "[libtorch][grad]") {
  fixture const f;
  torch::Tensor const ref = alone(f, f.copy(), step_fn);
  std::vector<std::pair<char const*, std::function<void(Net&, batch_t)>>> const fns{
      {"zero_grad(set_to_none) first",
       [](Net& m, batch_t b) {
         m->zero_grad(/*set_to_none=*/true);
         step_fn(m, std::move(b));
       }},
      {"a fresh .grad tensor assigned after backward", [](Net& m, batch_t b) {
         step_fn(m, std::move(b));
         torch::NoGradGuard const no_grad;
         for (auto& p : m->parameters()) p.mutable_grad() = p.grad().clone();
       }}};
  for (auto const& [name, fn] : fns) {
    INFO(name);
    Net m = f.copy();
    dpl::data_parallel<Net> dp(m, host_devices(3));
    auto opt = sgd(m);
    std::vector<void*> memory;
    for (int s = 0; s < steps; ++s) {
      dp.step(batch_t{f.x, f.y}, fn);
      opt.step();
      std::vector<void*> now;
      for (auto const& g : dpl::gradient_refs(dp.replica(2))) now.push_back(g.data());
      if (s == 0) memory = now;
      CHECK(now == memory);  // the memory dparallel reads stays .grad
    }
    CHECK(relative(flat(m), ref) <= 1e-5);
    for (auto const& opts : {dpl::options{}, bucket_view()}) {
      std::vector<Net> nets{f.copy(), f.copy()};
      auto const out = ddp_pair(f, nets, opts, fn);
      INFO("DDP, gradient_as_bucket_view " << opts.gradient_as_bucket_view);
      CHECK(relative(out[0], ref) <= 1e-5);
      CHECK(torch::equal(out[0], out[1]));
    }
  }
}

TEST_CASE("libtorch: a .grad replaced by a tensor of another shape is an error naming the parameter",
          "[libtorch][grad][error]") {
  // No backward: no hook reports fc2.bias, so the step function's tensor would be copied.
  fixture const f;
  Net m = f.copy();
  dpl::data_parallel<Net> dp(m, host_devices(2));
  auto bad = [](Net& n, batch_t) { n->fc2->bias.mutable_grad() = torch::zeros({5}, torch::kDouble); };
  CHECK_THROWS_WITH(dp.step(batch_t{f.x, f.y}, bad),
                    Catch::Contains("replaced fc2.bias.grad by a tensor of [5] Double on cpu; expected the "
                                    "parameter's shape, dtype and device"));
  dp.step(batch_t{f.x, f.y}, step_fn);  // the wrapper stays usable, and the gradient is the batch's again
  Net ref = f.copy();
  step_fn(ref, batch_t{f.x, f.y});
  CHECK(relative(m->fc2->bias.grad(), ref->fc2->bias.grad()) <= 1e-12);
}

namespace {
struct MaskedImpl : torch::nn::Cloneable<MaskedImpl> {
  MaskedImpl() { reset(); }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    mask = register_buffer("mask", torch::tensor({true, false, true, true}));
  }
  torch::Tensor forward(torch::Tensor const& x) { return fc(x) * mask; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor mask;
};
TORCH_MODULE(Masked);
}  // namespace

TEST_CASE("libtorch: bool buffers are broadcast and saved as their bytes", "[libtorch][buffers]") {
  torch::set_num_threads(1);
  std::vector<Masked> nets{Masked(), Masked()};
  nets[1]->mask.fill_(false);  // rank 0's mask reaches rank 1 at construction
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    dpl::distributed_data_parallel<Masked> ddp(nets[static_cast<std::size_t>(rank.rank())], rank);
  });
  CHECK(torch::equal(nets[1]->mask, torch::tensor({true, false, true, true})));
  auto const dir = test::scratch_dir("test_libtorch_semantics", "bool");
  dpl::save_state_dict(dir / "masked.safetensors", nets[0]);
  Masked other;
  other->mask.fill_(false);
  dpl::load_state_dict(dir / "masked.safetensors", other);
  CHECK(torch::equal(other->mask, nets[0]->mask));
  CHECK(other->mask.scalar_type() == torch::kBool);
}

TEST_CASE("libtorch: DataParallel gathers tensor outputs as torch.nn.DataParallel does", "[libtorch][dp][gather]") {
  fixture const f;
  Net m = f.copy();
  dpl::data_parallel<Net> dp(m, host_devices(3));
  torch::Tensor const out = dp.step(batch_t{f.x, f.y}, [](Net& n, batch_t b) {
    torch::Tensor y = n->forward(std::get<0>(b));
    torch::mse_loss(y, std::get<1>(b)).backward();
    return y;
  });
  torch::Tensor expected;
  {
    torch::NoGradGuard const no_grad;
    expected = m->forward(f.x);
  }
  CHECK(out.sizes() == expected.sizes());
  CHECK(relative(out, expected) <= 1e-12);
  CHECK_FALSE(out.requires_grad());
  torch::Tensor const losses = dp.step(batch_t{f.x, f.y}, [](Net& n, batch_t b) {
    torch::Tensor loss = torch::mse_loss(n->forward(std::get<0>(b)), std::get<1>(b));
    loss.backward();
    return loss;
  });
  CHECK(losses.sizes() == torch::IntArrayRef{3});  // 0-dimensional outputs: one value per replica
}

namespace {
// A module that is not Cloneable: DDP needs no replica, so it works there (DataParallel refuses
// it at compile time, with the adapter's static_assert in make_replica).
struct PlainImpl : torch::nn::Module {
  PlainImpl() : fc(register_module("fc", torch::nn::Linear(6, 3))) { fc->to(torch::kDouble); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Plain);
}  // namespace

TEST_CASE("libtorch: DDP takes modules that are not Cloneable", "[libtorch][ddp]") {
  fixture const f;
  torch::manual_seed(3);
  std::vector<Plain> nets{Plain(), Plain()};
  Plain ref;
  {
    torch::NoGradGuard const no_grad;
    auto const mine = ref->parameters(), rank0 = nets[0]->parameters();
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i].copy_(rank0[i]);
  }
  torch::Tensor const y = f.y;
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    auto const r = static_cast<std::size_t>(rank.rank());
    dpl::distributed_data_parallel<Plain> ddp(nets[r], rank);
    ddp.step(batch_t{f.x.narrow(0, rank.rank() * 6, 6), y.narrow(0, rank.rank() * 6, 6)},
             [](Plain& m, batch_t b) { torch::mse_loss(m->fc(std::get<0>(b)), std::get<1>(b)).backward(); });
  });
  torch::mse_loss(ref->fc(f.x), f.y).backward();
  CHECK(relative(nets[1]->fc->weight.grad(), ref->fc->weight.grad()) <= 1e-12);
}

TEST_CASE("libtorch: the adapter's errors name the tensor once prefixed", "[libtorch][error]") {
  fixture const f;
  Net m = f.copy();
  {
    torch::NoGradGuard const no_grad;
    m->fc1->weight.set_data(m->fc1->weight.t().contiguous().t());  // the same values, transposed strides
  }
  REQUIRE_FALSE(m->fc1->weight.is_contiguous());
  CHECK_THROWS_WITH(dpl::data_parallel<Net>(m, host_devices(2)),
                    Catch::StartsWith("dparallel: libtorch: tensor 'fc1.weight' is not contiguous"));
  CHECK_THROWS_WITH(dpl::batch_size(torch::tensor(1.0)),
                    Catch::StartsWith("dparallel: libtorch: expected a batch tensor with a first (batch) dimension"));
}

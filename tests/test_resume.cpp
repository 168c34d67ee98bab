// Exact resume: stopping after k steps, checkpointing, rebuilding everything and continuing gives
// bitwise the same parameters as never stopping, in single-device, DP and DDP modes (SGD with
// momentum, a warmup learning rate, a shuffling sampler). Also: the checkpoint's own contract
// and the learning-rate helpers.
#include "models.hpp"
#include "scratch.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/train/lr.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

namespace dpl = dparallel;
namespace fs = std::filesystem;
using model = test::chunked<float>;

namespace {

fs::path scratch(std::string const& name) { return test::scratch_dir("test_resume", name); }

std::vector<std::size_t> const sizes = {3, 5, 1, 8, 2, 4};
constexpr std::uint64_t seed = 1234;
constexpr std::size_t n_samples = 45;

test::dataset<float> const& data() {
  static auto const d = test::dataset<float>::make(n_samples, model(sizes).dim, 77, false);
  return d;
}

/// SGD with momentum (PyTorch's: v = mu v + g; p -= lr v) with a warmup schedule over steps.
struct sgd_momentum {
  std::vector<std::vector<float>> v;
  dpl::warmup_schedule<dpl::step_decay> schedule{0.05, 4, dpl::step_decay{.every = 5, .gamma = 0.5}};
  float mu = 0.9f;
  explicit sgd_momentum(model const& m) {
    for (auto const& w : m.w) v.emplace_back(w.size(), 0.0f);
  }
  void register_with(dpl::checkpoint& ck) {
    std::vector<dpl::tensor_view<float>> views;
    for (auto& x : v) views.push_back(dpl::view(x));
    ck.add_all("momentum", views);
  }
  void step(model& m, std::uint64_t step) {
    auto const lr = static_cast<float>(schedule(step));
    for (std::size_t p = 0; p < m.w.size(); ++p)
      for (std::size_t j = 0; j < m.w[p].size(); ++j) {
        v[p][j] = mu * v[p][j] + m.g[p][j];
        m.w[p][j] -= lr * v[p][j];
      }
  }
};

/// The rows of `idx` gathered into a contiguous batch.
struct gathered {
  std::vector<float> x, y;
  test::samples<float> view() const {
    return {dpl::tensor_view<const float>(x.data(), x.size(), y.size()), dpl::view(y)};
  }
};
gathered gather(std::vector<std::size_t> const& idx, std::size_t first, std::size_t count) {
  auto const& d = data();
  gathered g;
  for (std::size_t k = first; k < first + count; ++k) {
    g.x.insert(g.x.end(), d.x.begin() + static_cast<std::ptrdiff_t>(idx[k] * d.dim),
               d.x.begin() + static_cast<std::ptrdiff_t>((idx[k] + 1) * d.dim));
    g.y.push_back(d.y[idx[k]]);
  }
  return g;
}

/// The training loop, driven by the checkpoint's progress: it reads the sampler position from
/// it and advances it, so a checkpoint taken at any step holds where the data stream stands.
/// An epoch's incomplete last batch is dropped.
template <class Step>
void train_until(std::uint64_t until, dpl::checkpoint& ck, dpl::distributed_sampler& sampler, std::size_t batch,
                 sgd_momentum& opt, model& master, Step&& forward_backward) {
  auto& p = ck.progress();
  while (p.step < until) {
    sampler.set_epoch(p.sampler.epoch);
    if (p.sampler.index + batch > sampler.size()) {
      p.epoch = ++p.sampler.epoch;
      p.sampler.index = 0;
      continue;
    }
    auto const b = gather(sampler.indices(), static_cast<std::size_t>(p.sampler.index), batch);
    forward_backward(b.view());
    opt.step(master, p.step);
    p.sampler.index += batch;
    ++p.step;
  }
}

enum class mode { single, dp, ddp };

/// What a resume may leave out, to show that the test notices.
enum class omit { nothing, momentum, sampler_position, sampler_order };

struct outcome {
  model rank0;                          ///< rank 0's (or the only) model at the end
  std::vector<std::uint64_t> hashes;    ///< every rank's parameter hash at the end
  dpl::training_progress progress;      ///< rank 0's progress at the end
};

/// One session: builds everything fresh (model, wrapper, optimizer, sampler, checkpoint),
/// optionally loads `from`, trains until step `until`, optionally saves to `to` (rank 0 only).
/// A fresh session shuffles in `order`; a resumed one in the checkpoint's (or, leaving out the
/// order, in the default one).
outcome session(mode md, int n, std::uint64_t until, std::optional<fs::path> from, std::optional<fs::path> to,
                omit leave_out = omit::nothing, dpl::shuffle_order order = dpl::shuffle_order::torch) {
  std::size_t const batch = 4;  // per rank in DDP, global in single and DP
  outcome out{model(sizes), std::vector<std::uint64_t>(static_cast<std::size_t>(md == mode::ddp ? n : 1)), {}};

  auto run_rank = [&](model& m, dpl::checkpoint& ck, auto&& fb, int rank, int world) {
    sgd_momentum opt(m);
    if (leave_out != omit::momentum || !from) opt.register_with(ck);
    ck.progress().seed = seed;
    ck.progress().sampler.order = order;
    if (from) {
      ck.load(*from, {.strict = leave_out != omit::momentum});
      if (leave_out == omit::sampler_position) ck.progress().sampler.index = 0;
    }
    auto const resumed_order =
        leave_out == omit::sampler_order ? dpl::sampler_options{}.order : ck.progress().sampler.order;
    dpl::distributed_sampler sampler(n_samples, world, rank,
                                     {.shuffle = true, .seed = ck.progress().seed, .order = resumed_order});
    train_until(until, ck, sampler, batch, opt, m, fb);
    if (to && rank == 0) ck.save(*to);
  };

  if (md == mode::single) {
    model m(sizes, 5);
    dpl::checkpoint ck(m);
    run_rank(m, ck, [&](test::samples<float> b) { m.forward_backward(b); }, 0, 1);
    out.rank0 = m;
    out.hashes[0] = test::param_hash(m);
    out.progress = ck.progress();
  } else if (md == mode::dp) {
    model m(sizes, 5);
    dpl::data_parallel<model> dp(m, dpl::host::devices(n));
    dpl::checkpoint ck(dp);
    run_rank(dp.module(), ck, [&](test::samples<float> b) {
      dp.step(b, [](model& r, test::samples<float> s) { return r.forward_backward(s); });
    }, 0, 1);
    out.rank0 = m;
    out.hashes[0] = test::param_hash(m);
    out.progress = ck.progress();
  } else {
    dpl::spawn(n, [&](dpl::rank_context& rank) {
      model m(sizes, static_cast<std::uint64_t>(5 + 10 * rank.rank()));  // made equal by DDP's broadcast
      dpl::distributed_data_parallel<model> ddp(m, rank.group());
      dpl::checkpoint ck(ddp);
      run_rank(
          ddp.module(), ck,
          [&](test::samples<float> b) {
            ddp.step(b, [](model& r, test::samples<float> s, dpl::step_context& ctx) {
              return r.forward_backward(s, &ctx);
            });
          },
          rank.rank(), rank.world_size());
      out.hashes[static_cast<std::size_t>(rank.rank())] = test::param_hash(m);
      if (rank.rank() == 0) {
        out.rank0 = m;
        out.progress = ck.progress();
      }
    });
  }
  return out;
}

bool same_state(model& a, model& b) { return test::same_bits(a, b) && a.stats == b.stats; }

}  // namespace

TEST_CASE("resuming from a checkpoint is bitwise the same as never stopping", "[resume][contract]") {
  struct config {
    mode md;
    int n;
    std::uint64_t total, stop;
    char const* name;
  };
  // single: 11 steps per epoch; dp (global batch 4 over 3 devices): 11; ddp over 2 ranks: 5.
  // The stops fall inside an epoch, after the warmup and across a step of the decay.
  for (config c : {config{mode::single, 1, 30, 17, "single"}, config{mode::dp, 3, 30, 13, "dp"},
                   config{mode::ddp, 2, 14, 7, "ddp"}, config{mode::ddp, 3, 9, 4, "ddp3"}}) {
    INFO("mode " << c.name << ", stop after " << c.stop << " of " << c.total << " steps");
    auto const dir = scratch(c.name);
    auto straight = session(c.md, c.n, c.total, std::nullopt, std::nullopt);
    auto const first = session(c.md, c.n, c.stop, std::nullopt, dir / "ckpt.safetensors");
    CHECK(first.progress.step == c.stop);
    auto resumed = session(c.md, c.n, c.total, dir / "ckpt.safetensors", std::nullopt);

    CHECK(same_state(resumed.rank0, straight.rank0));
    CHECK(resumed.progress == straight.progress);
    for (auto h : resumed.hashes) CHECK(h == straight.hashes[0]);  // every rank, bitwise
    for (auto h : straight.hashes) CHECK(h == straight.hashes[0]);
  }
}

TEST_CASE("a resume without the momentum or the sampler position is not exact", "[resume]") {
  // The test above would not notice a checkpoint that dropped state: show that it would.
  auto const dir = scratch("sensitivity");
  auto straight = session(mode::single, 1, 30, std::nullopt, std::nullopt);
  session(mode::single, 1, 17, std::nullopt, dir / "ckpt.safetensors");
  auto no_momentum = session(mode::single, 1, 30, dir / "ckpt.safetensors", std::nullopt, omit::momentum);
  auto no_position = session(mode::single, 1, 30, dir / "ckpt.safetensors", std::nullopt, omit::sampler_position);
  CHECK_FALSE(test::same_bits(no_momentum.rank0, straight.rank0));
  CHECK_FALSE(test::same_bits(no_position.rank0, straight.rank0));
}

TEST_CASE("a checkpoint keeps the sampler's shuffle order, and a resume needs it", "[resume][checkpoint]") {
  // A run shuffling in the other order (splitmix64) resumes exactly from the order its checkpoint
  // records; a resume in the default order reads other samples from the same position.
  auto const dir = scratch("order");
  auto const other = dpl::shuffle_order::splitmix64;
  for (mode md : {mode::single, mode::ddp}) {
    int const n = md == mode::ddp ? 2 : 1;
    std::uint64_t const total = md == mode::ddp ? 14 : 30, stop = md == mode::ddp ? 7 : 17;
    INFO((md == mode::ddp ? "ddp over 2 ranks" : "single"));
    auto straight = session(md, n, total, std::nullopt, std::nullopt, omit::nothing, other);
    session(md, n, stop, std::nullopt, dir / "ckpt.safetensors", omit::nothing, other);
    CHECK(dpl::safetensors_reader(dir / "ckpt.safetensors").metadata().at("sampler.order") == "splitmix64");
    auto resumed = session(md, n, total, dir / "ckpt.safetensors", std::nullopt);  // fresh sessions: torch
    CHECK(resumed.progress.sampler.order == other);
    CHECK(resumed.progress == straight.progress);
    CHECK(same_state(resumed.rank0, straight.rank0));
    for (auto h : resumed.hashes) CHECK(h == straight.hashes[0]);
    auto no_order = session(md, n, total, dir / "ckpt.safetensors", std::nullopt, omit::sampler_order);
    CHECK_FALSE(test::same_bits(no_order.rank0, straight.rank0));
    // The order makes the difference: the default order's own run is another run.
    auto torch_run = session(md, n, total, std::nullopt, std::nullopt);
    CHECK_FALSE(test::same_bits(torch_run.rank0, straight.rank0));
  }
}

TEST_CASE("a checkpoint keeps the progress, the model and the registered tensors", "[resume][checkpoint]") {
  auto const dir = scratch("checkpoint");
  model m(sizes, 3);
  m.stats[0] = 17;
  std::vector<float> mom(5, 0.25f), adam_step(1, 3.0f);
  dpl::checkpoint ck(m);
  ck.add("momentum", dpl::view(mom)).add("adam.step", dpl::view(adam_step), std::vector<std::uint64_t>{});
  ck.progress() = {.epoch = 4, .step = 18446744073709551615ull, .sampler = {4, 12, dpl::shuffle_order::splitmix64},
                   .seed = 99, .extra = {{"lr", "0.125"}, {"run", "a/b"}}};
  ck.save(dir / "c.safetensors");

  {  // A plain safetensors file: prefixed names, scalars in the metadata.
    dpl::safetensors_reader const file(dir / "c.safetensors");
    std::vector<std::string> names;
    for (auto const& t : file.tensors()) names.push_back(t.name);
    CHECK(names == std::vector<std::string>{"model.param.0", "model.param.1", "model.param.2", "model.param.3",
                                            "model.param.4", "model.param.5", "model.buffer.0",
                                            "optimizer.momentum", "optimizer.adam.step"});
    CHECK(file.find("optimizer.adam.step")->shape.empty());  // a scalar
    CHECK(file.metadata() == dpl::safetensors_metadata{{"dparallel.checkpoint", "1"}, {"epoch", "4"},
                                                       {"step", "18446744073709551615"}, {"sampler.epoch", "4"},
                                                       {"sampler.index", "12"}, {"sampler.order", "splitmix64"},
                                                       {"seed", "99"}, {"user.lr", "0.125"}, {"user.run", "a/b"}});
  }

  model m2(sizes, 8);
  std::vector<float> mom2(5), step2(1);
  dpl::checkpoint back(m2);
  back.add("momentum", dpl::view(mom2)).add("adam.step", dpl::view(step2));
  back.load(dir / "c.safetensors");
  CHECK(back.progress() == ck.progress());
  CHECK(same_state(m2, m));
  CHECK(mom2 == mom);
  CHECK(step2 == adam_step);

  // A tensor registered but absent: strict load fails, listing it, and changes nothing.
  model m3(sizes, 9);
  std::vector<float> extra(2, 1.0f);
  dpl::checkpoint more(m3);
  more.add("momentum", dpl::view(mom2)).add("adam.step", dpl::view(step2)).add("ema", dpl::view(extra));
  more.progress().epoch = 123;
  auto const before = test::param_hash(m3);
  CHECK_THROWS_WITH(more.load(dir / "c.safetensors"), Catch::Contains("missing in the file: optimizer.ema"));
  CHECK(test::param_hash(m3) == before);
  CHECK(more.progress().epoch == 123);
  auto const r = more.load(dir / "c.safetensors", {.strict = false});
  CHECK(r.missing == std::vector<std::string>{"optimizer.ema"});
  CHECK(extra == std::vector<float>{1, 1});
  CHECK(same_state(m3, m));

  CHECK_THROWS_WITH(more.add("ema", dpl::view(extra)), Catch::Contains("already registered"));

  // A state dict is not a checkpoint; a checkpoint with a damaged scalar is refused.
  dpl::save_state_dict(dir / "sd.safetensors", m);
  CHECK_THROWS_WITH(back.load(dir / "sd.safetensors"), Catch::Contains("not a dparallel checkpoint"));
  std::vector<dpl::named_tensor> const tensors = back.tensors();
  dpl::save_safetensors(dir / "bad.safetensors", tensors,
                        {{"dparallel.checkpoint", "1"}, {"epoch", "4"}, {"step", "-1"}, {"sampler.epoch", "4"},
                         {"sampler.index", "12"}, {"seed", "99"}});
  CHECK_THROWS_WITH(back.load(dir / "bad.safetensors"), Catch::Contains("'step' to be an unsigned decimal integer"));
  dpl::save_safetensors(dir / "order.safetensors", tensors,
                        {{"dparallel.checkpoint", "1"}, {"epoch", "4"}, {"step", "1"}, {"sampler.epoch", "4"},
                         {"sampler.index", "12"}, {"sampler.order", "numpy"}, {"seed", "99"}});
  CHECK_THROWS_WITH(back.load(dir / "order.safetensors"),
                    Catch::Contains("'sampler.order' to be 'torch' or 'splitmix64', found 'numpy'"));
  CHECK(back.progress() == ck.progress());
  // A file from before the order was recorded: splitmix64, the only order of that time.
  dpl::save_safetensors(dir / "old.safetensors", tensors,
                        {{"dparallel.checkpoint", "1"}, {"epoch", "4"}, {"step", "1"}, {"sampler.epoch", "4"},
                         {"sampler.index", "12"}, {"seed", "99"}});
  back.progress().sampler.order = dpl::shuffle_order::torch;
  back.load(dir / "old.safetensors");
  CHECK(back.progress().sampler.order == dpl::shuffle_order::splitmix64);
  CHECK(back.progress().step == 1);
  back.load(dir / "c.safetensors");
  dpl::save_safetensors(dir / "v2.safetensors", tensors, {{"dparallel.checkpoint", "2"}});
  CHECK_THROWS_WITH(back.load(dir / "v2.safetensors"), Catch::Contains("of version '2'"));
  CHECK(back.progress() == ck.progress());
}

TEST_CASE("linear scaling rule", "[lr]") {
  CHECK(dpl::scale_lr_linear(0.5, 1024, 256) == 2.0);
  CHECK(dpl::scale_lr_linear(0.75, 96, 32) == 2.25);
  CHECK(dpl::scale_lr_linear(0.75, 32, 32) == 0.75);
  CHECK(dpl::scale_lr_linear(1.0, 64, 256) == 0.25);
  CHECK_THROWS_AS(dpl::scale_lr_linear(0.1, 0, 256), dpl::invalid_argument);
  CHECK_THROWS_AS(dpl::scale_lr_linear(0.1, 256, 0), dpl::invalid_argument);
  CHECK_THROWS_AS(dpl::scale_lr_linear(-0.1, 256, 256), dpl::invalid_argument);
  CHECK_THROWS_AS(dpl::scale_lr_linear(std::numeric_limits<double>::quiet_NaN(), 256, 256), dpl::invalid_argument);
}

TEST_CASE("warmup then constant, step, linear or cosine decay", "[lr]") {
  auto values = [](auto const& schedule, std::uint64_t n) {
    std::vector<double> out;
    for (std::uint64_t s = 0; s < n; ++s) out.push_back(schedule(s));
    return out;
  };
  CHECK(values([](std::uint64_t s) { return dpl::warmup_lr(s, 1.0, 4); }, 7) ==
        std::vector<double>{0, 0.25, 0.5, 0.75, 1, 1, 1});
  CHECK(values([](std::uint64_t s) { return dpl::warmup_lr(s, 1.0, 4, 0.5); }, 6) ==
        std::vector<double>{0.5, 0.625, 0.75, 0.875, 1, 1});
  CHECK(dpl::warmup_lr(0, 0.5, 0) == 0.5);  // no warmup

  dpl::warmup_schedule constant(1.0, 4);
  CHECK(values(constant, 7) == std::vector<double>{0, 0.25, 0.5, 0.75, 1, 1, 1});
  dpl::warmup_schedule stepped(1.0, 2, dpl::step_decay{.every = 2, .gamma = 0.5});
  CHECK(values(stepped, 8) == std::vector<double>{0, 0.5, 1, 1, 0.5, 0.5, 0.25, 0.25});
  dpl::warmup_schedule linear(1.0, 2, dpl::linear_decay{.steps = 4, .end_lr = 0.0});
  CHECK(values(linear, 8) == std::vector<double>{0, 0.5, 1, 0.75, 0.5, 0.25, 0, 0});
  dpl::warmup_schedule cosine(1.0, 1, dpl::cosine_decay{.steps = 2, .min_lr = 0.0});
  CHECK(values(cosine, 5) == std::vector<double>{0, 1, 0.5, 0, 0});
  dpl::warmup_schedule cosine_floor(1.0, 0, dpl::cosine_decay{.steps = 2, .min_lr = 0.5});
  CHECK(values(cosine_floor, 4) == std::vector<double>{1, 0.75, 0.5, 0.5});
  dpl::warmup_schedule custom(1.0, 2, [](double lr, std::uint64_t s) { return lr / static_cast<double>(1 + s); });
  CHECK(values(custom, 5) == std::vector<double>{0, 0.5, 1, 0.5, 1.0 / 3.0});
  CHECK(custom.target_lr() == 1.0);
  CHECK(custom.warmup_steps() == 2);

  CHECK_THROWS_AS(dpl::warmup_schedule(-1.0, 4), dpl::invalid_argument);
  CHECK_THROWS_AS(dpl::warmup_lr(0, 1.0, 4, std::numeric_limits<double>::infinity()), dpl::invalid_argument);
  CHECK_THROWS_AS(dpl::warmup_schedule(1.0, 0, dpl::cosine_decay{.steps = 0})(0), dpl::invalid_argument);
}

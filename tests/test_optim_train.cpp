// optim::optimizer over models, DP and DDP: it applies its rule to every parameter, DP's master
// and DDP's replicas train as one device does (bitwise where the gradients are), DDP's replicas
// stay bitwise identical, a wrong model is refused, and the state saves and resumes bitwise.
#include "models.hpp"
#include "scratch.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/sgd.hpp>
#include <dparallel/optim/state.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;
namespace fs = std::filesystem;
using model = test::chunked<float>;

namespace {

std::vector<std::size_t> const sizes = {3, 5, 1, 8, 2, 4};

/// The four optimizers of the example's --optimizer flag.
using any_rule = std::variant<optim::sgd, optim::adam, optim::adamw>;
std::vector<std::pair<char const*, any_rule>> rules() {
  return {{"sgd", optim::sgd()},
          {"momentum", optim::sgd({.momentum = 0.9, .weight_decay = 1e-3})},
          {"adam", optim::adam({.weight_decay = 1e-2})},
          {"adamw", optim::adamw()}};
}

double lr_at(int t) { return 0.02 * (1.0 + 0.5 * (t % 4)); }

/// The global batch of step t.
test::dataset<float> batch(int t, std::size_t rows, bool exact) {
  return test::dataset<float>::make(rows, model(sizes).dim, 500 + static_cast<std::uint64_t>(t), exact);
}

enum class mode { single, dp, ddp };

struct result {
  std::vector<double> params;           ///< rank 0's (or the only) parameters
  std::vector<std::uint64_t> hashes;    ///< every rank's parameter fingerprint after every step
};

/// `steps` steps of `rule` in `md` over `n` devices or ranks; the global batch is 8 * n rows
/// (8 per rank in DDP).
template <class Rule>
result train(mode md, int n, Rule const& rule, int steps, bool exact) {
  result r;
  auto const rows = static_cast<std::size_t>(8 * n);
  if (md == mode::single) {
    model m(sizes, 5);
    optim::optimizer opt(m, rule);
    for (int t = 1; t <= steps; ++t) {
      m.forward_backward(batch(t, rows, exact).all());
      opt.step(m, lr_at(t));
    }
    r.params = test::flat(m, false);
  } else if (md == mode::dp) {
    model m(sizes, 5);
    dpl::data_parallel<model> dp(m, dpl::host::devices(n));
    optim::optimizer opt(dp, rule);
    for (int t = 1; t <= steps; ++t) {
      dp.step(batch(t, rows, exact).all(), [](model& x, test::samples<float> s) { return x.forward_backward(s); });
      opt.step(dp, lr_at(t));
    }
    r.params = test::flat(m, false);
  } else {
    std::vector<std::vector<std::uint64_t>> hashes(static_cast<std::size_t>(n));
    dpl::spawn(n, [&](dpl::rank_context& rank) {
      model m(sizes, static_cast<std::uint64_t>(5 + rank.rank()));  // made equal by DDP's broadcast
      dpl::distributed_data_parallel<model> ddp(m, rank.group(), {.bucket_cap_mb = 16.0 / (1024 * 1024)});
      optim::optimizer opt(ddp, rule);
      for (int t = 1; t <= steps; ++t) {
        auto const d = batch(t, rows, exact);
        auto const lo = static_cast<std::size_t>(rank.rank()) * 8;
        ddp.step(dpl::slice_batch(d.all(), lo, lo + 8),
                 [](model& x, test::samples<float> s, dpl::step_context& ctx) { return x.forward_backward(s, &ctx); });
        opt.step(ddp, lr_at(t));
        hashes[static_cast<std::size_t>(rank.rank())].push_back(test::param_hash(m));
      }
      if (rank.rank() == 0) r.params = test::flat(m, false);
    });
    for (auto const& h : hashes) CHECK(h == hashes[0]);  // replicas bitwise identical after every step
    r.hashes = hashes[0];
  }
  return r;
}

bool same_bits(std::vector<double> const& a, std::vector<double> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

TEST_CASE("the optimizer applies its rule to every parameter with its own state", "[optim][optimizer]") {
  model m(sizes, 3), ref(sizes, 3);
  optim::adam const rule({.beta1 = 0.8});
  optim::optimizer opt(m, rule);
  STATIC_REQUIRE(std::is_same_v<decltype(opt), optim::optimizer<optim::adam, dpl::host::backend>>);
  std::vector<std::vector<float>> mom, sq;  // the reference's state, per parameter
  for (auto s : sizes) {
    mom.emplace_back(s, 0.0f);
    sq.emplace_back(s, 0.0f);
  }
  for (int t = 1; t <= 20; ++t) {
    auto const d = batch(t, 7, false);
    m.forward_backward(d.all());
    ref.forward_backward(d.all());
    opt.step(m, lr_at(t));
    auto const c = rule.constants(static_cast<std::uint64_t>(t), lr_at(t));
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      float* s[2] = {mom[p].data(), sq[p].data()};
      rule.apply(c, ref.w[p], ref.g[p], s);
    }
  }
  CHECK(opt.steps() == 20);
  CHECK(test::same_bits(m, ref));
  for (std::size_t p = 0; p < sizes.size(); ++p) {
    CHECK(std::memcmp(opt.slot(p, 0).data(), mom[p].data(), sizes[p] * sizeof(float)) == 0);
    CHECK(std::memcmp(opt.slot(p, 1).data(), sq[p].data(), sizes[p] * sizeof(float)) == 0);
  }
  CHECK(opt.state_bytes() == 2 * 23 * sizeof(float));
  optim::optimizer plain(m, optim::sgd());
  CHECK(plain.state_bytes() == 0);  // plain SGD keeps no momentum buffer
}

TEST_CASE("DP and DDP with an optimizer train as one device does", "[optim][dp][ddp][contract]") {
  for (auto const& [name, any] : rules()) {
    std::visit(
        [&, name = name](auto const& rule) {
          INFO("optimizer " << name);
          // One step on exact data over 2 and 4 devices / ranks (8 rows each: every mean and weight is
          // a power of two): DP's and DDP's gradients are bitwise the one-device gradient (over 3,
          // averaging by 1/3 is not exact), and so are the updates.
          for (int n : {2, 4}) {
            auto const one = train(mode::single, n, rule, 1, true).params;
            CHECK(same_bits(train(mode::dp, n, rule, 1, true).params, one));
            CHECK(same_bits(train(mode::ddp, n, rule, 1, true).params, one));
          }
          // 20 steps: rounding of the gradients' sums differs, the replicas never do.
          for (int n : {2, 3}) {
            INFO("devices / ranks: " << n);
            auto const single = train(mode::single, n, rule, 20, false).params;
            auto const dp = train(mode::dp, n, rule, 20, false).params;
            auto const ddp = train(mode::ddp, n, rule, 20, false);
            CHECK(test::rel_error(dp, single) <= 1e-5);
            CHECK(test::rel_error(ddp.params, single) <= 1e-5);
            CHECK(!same_bits(single, train(mode::single, n, rule, 0, false).params));
            CHECK(train(mode::ddp, n, rule, 20, false).hashes == ddp.hashes);  // reproducible
          }
        },
        any);
  }
}

TEST_CASE("an optimizer refuses a model it was not built for", "[optim][error]") {
  using Catch::Matchers::Contains;
  model m(sizes, 1);
  optim::optimizer opt(m, optim::adam());
  model other({3, 5, 1, 8, 2, 5}, 1), fewer({3, 5}, 1);
  auto const before = test::flat(other, false);
  CHECK_THROWS_WITH(opt.step(other, 1e-3), Contains("optim::optimizer<adam>") && Contains("parameter 5") &&
                                               Contains("'param.5'") && Contains("had 4 F32") &&
                                               Contains("found a parameter of 5"));
  CHECK_THROWS_WITH(opt.step(fewer, 1e-3), Contains("with 6 parameters") && Contains("found a model with 2"));
  CHECK_THROWS_WITH(opt.step(m, -1.0), Contains("learning rate"));
  CHECK(test::flat(other, false) == before);
  CHECK(opt.steps() == 0);
  test::linreg<double> f64;
  CHECK_THROWS_WITH(optim::optimizer(f64, optim::sgd()), Contains("is F64") && Contains("F32 parameters"));
}

TEST_CASE("optimizer state saves and resumes bitwise: own file and checkpoint, single and DDP",
          "[optim][io][contract]") {
  auto const dir = test::scratch_dir("test_optim_train", "resume");
  // Loads the model from `load` and, with `with_optim`, the optimizer's state; trains from_step..to_step.
  auto run = [&](mode md, int from_step, int to_step, std::optional<fs::path> load, std::optional<fs::path> save,
                 bool own_file, bool with_optim = true) {
    std::vector<double> out;
    std::vector<std::uint64_t> loaded_steps(2, 0);  // per rank, checked on this thread
    auto session = [&](model& m, auto& wrapper_or_model, auto&& step_fn, int rank) {
      optim::optimizer opt(wrapper_or_model, optim::adamw({.weight_decay = 0.05}));
      dpl::checkpoint ck(wrapper_or_model);
      if (with_optim) optim::add_to(ck, opt, wrapper_or_model);
      if (load) {
        if (own_file) {
          dpl::load_state_dict(*load / "model.safetensors", wrapper_or_model);
          if (with_optim) optim::load_state(*load / "optim.safetensors", opt, wrapper_or_model);
        } else {
          ck.load(*load / "run.ckpt", {.strict = with_optim});
        }
        loaded_steps[static_cast<std::size_t>(rank)] = opt.steps();
      }
      for (int t = from_step + 1; t <= to_step; ++t) {
        step_fn(t);
        opt.step(wrapper_or_model, lr_at(t));
      }
      if (save && rank == 0) {
        fs::create_directories(*save);
        if (own_file) {
          dpl::save_state_dict(*save / "model.safetensors", wrapper_or_model);
          optim::save_state(*save / "optim.safetensors", opt, wrapper_or_model);
        } else {
          ck.save(*save / "run.ckpt");
        }
      }
      if (rank == 0) out = test::flat(m, false);
    };
    auto check_loaded = [&](std::size_t ranks) {
      for (std::size_t r = 0; r < ranks; ++r)
        CHECK(loaded_steps[r] == (load && with_optim ? static_cast<std::uint64_t>(from_step) : 0u));
    };
    if (md == mode::single) {
      model m(sizes, 9);
      session(m, m, [&](int t) { m.forward_backward(batch(t, 12, false).all()); }, 0);
      check_loaded(1);
    } else {
      dpl::spawn(2, [&](dpl::rank_context& rank) {
        model m(sizes, 9);
        dpl::distributed_data_parallel<model> ddp(m, rank.group());
        auto step_fn = [&](int t) {
          auto const d = batch(t, 12, false);
          auto const lo = static_cast<std::size_t>(rank.rank()) * 6;
          ddp.step(dpl::slice_batch(d.all(), lo, lo + 6), [](model& x, test::samples<float> s) { return x.forward_backward(s); });
        };
        session(m, ddp, step_fn, rank.rank());
      });
      check_loaded(2);
    }
    return out;
  };
  for (mode md : {mode::single, mode::ddp}) {
    for (bool own_file : {true, false}) {
      INFO((md == mode::single ? "single" : "ddp") << (own_file ? ", own files" : ", checkpoint"));
      auto const at = dir / (std::string(md == mode::single ? "single" : "ddp") + (own_file ? "_own" : "_ckpt"));
      auto const straight = run(md, 0, 15, std::nullopt, std::nullopt, own_file);
      (void)run(md, 0, 7, std::nullopt, at, own_file);
      auto const resumed = run(md, 7, 15, at, std::nullopt, own_file);
      CHECK(same_bits(resumed, straight));
      // Resuming the model without the optimizer's state (a fresh AdamW at step 7) does not give those bits.
      auto const fresh = run(md, 7, 15, at, std::nullopt, own_file, false);
      CHECK(!same_bits(fresh, straight));
    }
  }
}

TEST_CASE("loading optimizer state validates it and changes nothing on error", "[optim][io][error]") {
  using Catch::Matchers::Contains;
  auto const dir = test::scratch_dir("test_optim_train", "bad_loads");
  model m(sizes, 2);
  optim::optimizer adam(m, optim::adam());
  m.forward_backward(batch(1, 8, false).all());
  adam.step(m, 1e-3);
  optim::save_state(dir / "adam.safetensors", adam, m);
  dpl::checkpoint ck_adam(m);
  optim::add_to(ck_adam, adam, m);
  ck_adam.save(dir / "adam.ckpt");

  optim::optimizer adamw(m, optim::adamw());
  m.forward_backward(batch(2, 8, false).all());
  adamw.step(m, 1e-3);
  adamw.step(m, 1e-3);
  auto snapshot = [&] {
    std::vector<float> out;
    for (std::size_t p = 0; p < sizes.size(); ++p)
      for (std::size_t k = 0; k < 2; ++k) {
        auto const v = adamw.slot(p, k).as<float>();
        out.insert(out.end(), v.begin(), v.end());
      }
    return out;
  };
  auto const before = snapshot();
  auto unchanged = [&] { return adamw.steps() == 2 && snapshot() == before; };

  // Another optimizer's own file: named by the metadata.
  CHECK_THROWS_WITH(optim::load_state(dir / "adam.safetensors", adamw, m),
                    Contains("adam.safetensors") && Contains("optimizer 'adam'") && Contains("expected 'adamw'"));
  CHECK(unchanged());
  // Another optimizer's checkpoint: its step tensor is named after the rule.
  dpl::checkpoint ck_w(m);
  optim::add_to(ck_w, adamw, m);
  CHECK_THROWS_WITH(ck_w.load(dir / "adam.ckpt"), Contains("adam.ckpt") && Contains("missing in the file: optimizer.adamw.step") &&
                                                       Contains("optimizer.adam.step"));
  CHECK(unchanged());
  // Another model: the shapes differ, the tensor is named.
  model other({3, 5, 1, 8, 2, 5}, 2);
  optim::optimizer adam_other(other, optim::adam());
  CHECK_THROWS_WITH(optim::load_state(dir / "adam.safetensors", adam_other, other),
                    Contains("'param.5.exp_avg'") && Contains("shape or dtype mismatch"));
  CHECK(adam_other.steps() == 0);
  // A missing tensor: named; nothing of the rest is loaded.
  optim::save_state(dir / "adamw.safetensors", adamw, m);
  {
    dpl::safetensors_reader const full(dir / "adamw.safetensors");
    std::vector<std::vector<std::byte>> keep;
    std::vector<dpl::named_tensor> part;
    for (auto const& t : full.tensors()) {
      if (t.name == "optim.param.2.exp_avg_sq") continue;
      keep.emplace_back(t.size_bytes());
      full.read_bytes(t, keep.back().data());
      part.push_back({t.name, dpl::tensor_ref(keep.back().data(), t.elements(), t.type), t.shape});
    }
    dpl::save_safetensors(dir / "partial.safetensors", part, full.metadata());
  }
  optim::optimizer fresh(m, optim::adamw());
  CHECK_THROWS_WITH(optim::load_state(dir / "partial.safetensors", fresh, m),
                    Contains("partial.safetensors") && Contains("missing in the file: param.2.exp_avg_sq") &&
                        Contains("nothing was loaded"));
  CHECK(fresh.steps() == 0);
  CHECK(std::all_of(fresh.slot(0, 0).as<float>().begin(), fresh.slot(0, 0).as<float>().end(),
                    [](float v) { return v == 0; }));
  // The good file loads.
  optim::load_state(dir / "adamw.safetensors", fresh, m);
  CHECK(fresh.steps() == 2);
}

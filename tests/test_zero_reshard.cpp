// ZeRO-1 optimizer state that reshards (optim/zero_checkpoint.hpp): K steps on N ranks, a save
// (every rank its shard, or rank 0 the gathered file), the rest on M ranks, on plain DDP or on one
// device, give bitwise the parameters of a run whose whole, unsharded optimizer state was handed
// from N to M ranks (DDP with optim::optimizer and optim::save_state, which test_zero shows equal
// to ZeRO-1 at every world size), also over bf16 parameters with F32 master shards. Bad input: a
// missing shard, another optimizer, another model.
#include "models.hpp"
#include "scratch.hpp"
#include "test_zero_common.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/state.hpp>
#include <dparallel/optim/zero_checkpoint.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;
namespace fs = std::filesystem;
using model = test::chunked<float>;

namespace {

/// How one leg of a run trains: ZeRO-1, DDP with the unsharded optimizer, or one device.
enum class kind { zero, ddp, single };

struct leg {
  kind how = kind::zero;
  int world = 1;
  optim::zero_save_mode mode = optim::zero_save_mode::sharded;  // a ZeRO-1 leg's save
};

/// What a leg ended with: rank 0's parameter hash after every step, each rank's at the end.
struct leg_result {
  std::vector<std::uint64_t> hashes;
  std::vector<std::uint64_t> last;  // per rank
};

dpl::options opts_for(bool tiny) { return tiny ? test::zero_tiny_buckets() : dpl::options{}; }

/// Steps [from, to) of the run as leg `l`, with AdamW; resumes from `in` (model.safetensors and
/// the optimizer state opt.safetensors) when from > 0, saves to `out` when it is not empty. Over
/// a model of 16-bit parameters (test::half_chunked) both optimizers keep F32 master copies.
template <class Model = model>
leg_result run_leg(leg l, int from, int to, fs::path const& in, fs::path const& out, bool tiny) {
  leg_result res;
  res.last.resize(static_cast<std::size_t>(l.world));
  optim::adamw const rule({.weight_decay = 0.05});
  bool const master = !std::is_same_v<Model, model>;
  auto const fn = [](Model& r, test::samples<float> s) { return r.forward_backward(s); };
  auto const body = [&](int rank, int world, auto& m, auto& w, auto& opt, auto&& save_opt, auto&& step) {
    for (int k = from; k < to; ++k) {
      auto const d = test::dataset<float>::make(4 * static_cast<std::size_t>(world), m.dim,
                                                static_cast<std::uint64_t>(k + 1), false);
      step(dpl::slice_batch(d.all(), static_cast<std::size_t>(rank) * 4, static_cast<std::size_t>(rank + 1) * 4));
      opt.step(w, 0.01);
      if (rank == 0) res.hashes.push_back(test::param_hash(m));
    }
    if (!out.empty()) {
      if (rank == 0) dpl::save_state_dict(out / "model.safetensors", m);
      save_opt();
    }
    res.last[static_cast<std::size_t>(rank)] = test::param_hash(m);
  };
  auto const resume_model = [&](Model& m) {
    if (from > 0) dpl::load_state_dict(in / "model.safetensors", m);
  };
  if (l.how == kind::single) {
    Model m(test::zero_sizes(), 7);
    resume_model(m);
    optim::optimizer opt(m, rule, {.master_weights = master});
    if (from > 0) optim::load_state(in / "opt.safetensors", opt, m);
    body(0, 1, m, m, opt, [&] { optim::save_state(out / "opt.safetensors", opt, m); },
         [&](auto const& batch) { m.forward_backward(batch); });
    return res;
  }
  dpl::spawn(l.world, [&](dpl::rank_context& ctx) {
    int const rank = ctx.rank();
    Model m(test::zero_sizes(), static_cast<std::uint64_t>(7 + rank));
    resume_model(m);
    if (l.how == kind::zero) {
      dpl::parallel<Model, dpl::ddp_zero1> w(m, ctx.group(), opts_for(tiny));
      dpl::optim::zero_redundancy_optimizer opt(w, rule, {.master_weights = master});
      if (from > 0) optim::load_zero_state(in / "opt.safetensors", opt);
      body(rank, l.world, m, w, opt, [&] { optim::save_zero_state(out / "opt.safetensors", opt, l.mode); },
           [&](auto const& batch) { w.step(batch, fn); });
    } else {
      dpl::distributed_data_parallel<Model> w(m, ctx.group(), opts_for(tiny));
      optim::optimizer opt(w, rule, {.master_weights = master});
      if (from > 0) optim::load_state(in / "opt.safetensors", opt, w);
      body(rank, l.world, m, w, opt,
           [&] {
             if (rank == 0) optim::save_state(out / "opt.safetensors", opt, w);
           },
           [&](auto const& batch) { w.step(batch, fn); });
    }
  });
  return res;
}

/// K steps as `first`, a save, `total` - K steps as `second` after loading it; the hashes of both legs.
template <class Model = model>
std::vector<std::uint64_t> two_legs(leg first, leg second, fs::path const& dir, bool tiny, int k = 4, int total = 9) {
  auto const a = run_leg<Model>(first, 0, k, {}, dir, tiny);
  auto const b = run_leg<Model>(second, k, total, dir, {}, tiny);
  for (auto const h : b.last) CHECK(h == b.last[0]);  // every rank holds the same parameters
  auto h = a.hashes;
  h.insert(h.end(), b.hashes.begin(), b.hashes.end());
  return h;
}

/// The reference: the same two legs with DDP and the whole optimizer state handed over (optim::save_state).
template <class Model = model>
std::vector<std::uint64_t> reference(int n, kind second, int m, fs::path const& dir, bool tiny) {
  return two_legs<Model>({kind::ddp, n}, {second, m}, dir, tiny);
}

char const* mode_name(optim::zero_save_mode m) { return m == optim::zero_save_mode::sharded ? "sharded" : "gathered"; }

}  // namespace

TEST_CASE("ZeRO-1 state saved on N ranks resumes on M ranks bitwise, in both save modes", "[host][zero][checkpoint]") {
  struct world_pair {
    int n, m;
  };
  for (auto const [n, m] : {world_pair{2, 3}, world_pair{3, 2}, world_pair{4, 1}}) {
    for (bool tiny : {false, true}) {
      auto const want = reference(n, kind::ddp, m, test::scratch_dir("test_zero_reshard", "ref"), tiny);
      for (auto mode : {optim::zero_save_mode::sharded, optim::zero_save_mode::gathered}) {
        INFO(n << " -> " << m << " ranks, " << mode_name(mode) << ", tiny buckets " << tiny);
        auto const dir = test::scratch_dir("test_zero_reshard", "run");
        auto const got = two_legs({kind::zero, n, mode}, {kind::zero, m}, dir, tiny);
        CHECK(got == want);
        CHECK(want.front() != want.back());  // the run moved the parameters
        auto const files = optim::zero_state_files(dir / "opt.safetensors");  // the commit, then the shards
        CHECK(files.size() == (mode == optim::zero_save_mode::sharded ? static_cast<std::size_t>(n) + 1 : 1));
        for (auto const& f : files) CHECK(fs::exists(f));
      }
    }
  }
}

TEST_CASE("ZeRO-1's gathered state resumes on plain DDP and on one device with optim::optimizer, bitwise",
          "[host][zero][checkpoint]") {
  auto const g = optim::zero_save_mode::gathered;
  auto const dir = test::scratch_dir("test_zero_reshard", "run");
  auto const ref_dir = test::scratch_dir("test_zero_reshard", "ref");
  CHECK(two_legs({kind::zero, 2, g}, {kind::ddp, 2}, dir, false) == reference(2, kind::ddp, 2, ref_dir, false));
  CHECK(two_legs({kind::zero, 3, g}, {kind::single, 1}, dir, true) == reference(3, kind::single, 1, ref_dir, true));
  // And back: an unsharded optimizer's file (optim::save_state) resumes ZeRO-1 on another world size.
  CHECK(two_legs({kind::ddp, 2}, {kind::zero, 3}, dir, true) == reference(2, kind::ddp, 3, ref_dir, true));
}

TEST_CASE("ZeRO-1's F32 master shards of bf16 parameters reshard: N to M ranks, to and from the unsharded optimizer",
          "[host][zero][checkpoint][master]") {
  // The master shards are saved as "<parameter>.master", the name optim::save_state gives a master
  // copy; without them a resumed run would widen the bf16 parameters and differ.
  using model16 = test::half_chunked<dpl::bf16>;
  auto const dir = test::scratch_dir("test_zero_reshard", "run");
  auto const ref_dir = test::scratch_dir("test_zero_reshard", "ref");
  auto const ref2 = reference<model16>(3, kind::ddp, 2, ref_dir, true);
  auto const ref4 = reference<model16>(3, kind::ddp, 4, ref_dir, true);
  CHECK(ref2.front() != ref2.back());
  for (auto mode : {optim::zero_save_mode::sharded, optim::zero_save_mode::gathered}) {
    INFO(mode_name(mode));
    CHECK(two_legs<model16>({kind::zero, 3, mode}, {kind::zero, 2}, dir, true) == ref2);
    CHECK(two_legs<model16>({kind::zero, 3, mode}, {kind::zero, 4}, dir, true) == ref4);
  }
  auto const g = optim::zero_save_mode::gathered;
  CHECK(two_legs<model16>({kind::zero, 3, g}, {kind::ddp, 2}, dir, true) == ref2);
  CHECK(two_legs<model16>({kind::zero, 3, g}, {kind::single, 1}, dir, true) ==
        reference<model16>(3, kind::single, 1, ref_dir, true));
  CHECK(two_legs<model16>({kind::ddp, 3}, {kind::zero, 2}, dir, true) == ref2);
}

namespace {

/// Every rank's error message from `fn(rank)` ("" where it threw nothing).
template <class F>
std::vector<std::string> messages(int world, F fn) {
  std::vector<std::string> seen(static_cast<std::size_t>(world));
  std::mutex mu;
  dpl::spawn(world, [&](dpl::rank_context& ctx) {
    try {
      fn(ctx);
    } catch (dpl::error const& e) {  // the calls raise on every rank: no rank waits for another
      std::lock_guard lock(mu);
      seen[static_cast<std::size_t>(ctx.rank())] = e.what();
    }
  });
  return seen;
}

/// A ZeRO-1 run of `steps` steps on this rank with `rule`, over a model of `sizes`, then `then(w, opt)`.
template <class Rule, class F>
void train_zero(dpl::rank_context& ctx, Rule rule, std::vector<std::size_t> const& sizes, int steps, F then) {
  model m(sizes, 7);
  dpl::parallel<model, dpl::ddp_zero1> w(m, ctx.group(), test::zero_tiny_buckets());
  dpl::optim::zero_redundancy_optimizer opt(w, rule);
  for (int k = 0; k < steps; ++k) {
    auto const d = test::dataset<float>::make(4 * static_cast<std::size_t>(ctx.world_size()), m.dim,
                                              static_cast<std::uint64_t>(k + 1), false);
    auto const r = static_cast<std::size_t>(ctx.rank());
    w.step(dpl::slice_batch(d.all(), r * 4, r * 4 + 4), [](model& x, test::samples<float> s) { return x.forward_backward(s); });
    opt.step(0.01);
  }
  then(w, opt);
}

/// This rank's state (every slot of every bucket) and step count.
template <class Z>
std::vector<float> state_of(Z const& opt, std::size_t buckets) {
  std::vector<float> out;
  for (std::size_t k = 0; k < 2; ++k)
    for (std::size_t b = 0; b < buckets; ++b)
      for (float v : opt.state_shard(k, b)) out.push_back(v);
  out.push_back(static_cast<float>(opt.steps()));
  return out;
}

/// Loads `path` into a ZeRO-1 optimizer (rule adamw, model of `sizes`) on `world` ranks after two
/// steps; returns each rank's error, and checks that the state did not change. (Catch2's
/// assertions are not thread-safe: the ranks only record, the calling thread checks.)
std::vector<std::string> load_fails(fs::path const& path, int world, std::vector<std::size_t> const& sizes) {
  std::vector<char> changed(static_cast<std::size_t>(world), 0);
  auto out = messages(world, [&](dpl::rank_context& ctx) {
    train_zero(ctx, optim::adamw(), sizes, 2, [&](auto& w, auto& opt) {
      auto const buckets = w.reducer().buckets().size();
      auto const before = state_of(opt, buckets);
      try {
        optim::load_zero_state(path, opt);
      } catch (...) {
        changed[static_cast<std::size_t>(ctx.rank())] = state_of(opt, buckets) != before;
        throw;
      }
    });
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    CHECK(changed[static_cast<std::size_t>(r)] == 0);  // nothing half-loaded
  }
  return out;
}

}  // namespace

TEST_CASE("A ZeRO-1 shard set missing a rank's file, another optimizer's or another model's state are refused, "
          "naming the file, tensor or rank, and nothing is loaded",
          "[host][zero][checkpoint][errors]") {
  auto const dir = test::scratch_dir("test_zero_reshard", "bad");
  auto const path = dir / "opt.safetensors";
  auto const save = [&](auto rule, std::vector<std::size_t> const& sizes, optim::zero_save_mode mode) {
    for (auto const& e : messages(3, [&](dpl::rank_context& ctx) {
           train_zero(ctx, rule, sizes, 3, [&](auto&, auto& opt) { optim::save_zero_state(path, opt, mode); });
         }))
      REQUIRE(e.empty());
  };
  SECTION("a missing shard file") {
    save(optim::adamw(), test::zero_sizes(), optim::zero_save_mode::sharded);
    fs::remove(optim::zero_state_files(path).at(2));  // after the manifest: rank 0's, rank 1's, rank 2's
    for (auto const& e : load_fails(path, 2, test::zero_sizes())) {
      CHECK_THAT(e, Catch::Contains("misses rank 1's file") && Catch::Contains(".rank1-of-3.safetensors"));
      CHECK_THAT(e, Catch::Contains("nothing was loaded"));
    }
  }
  SECTION("another optimizer") {
    for (auto mode : {optim::zero_save_mode::sharded, optim::zero_save_mode::gathered}) {
      fs::remove_all(dir);
      fs::create_directories(dir);
      save(optim::adam(), test::zero_sizes(), mode);
      for (auto const& e : load_fails(path, 2, test::zero_sizes()))
        CHECK_THAT(e, Catch::Contains("optimizer 'adam', expected 'adamw'") && Catch::Contains("opt."));
    }
  }
  SECTION("another model") {
    auto other = test::zero_sizes();
    other.back() += 1;  // parameter 5 has one element more
    save(optim::adamw(), test::zero_sizes(), optim::zero_save_mode::sharded);
    for (auto const& e : load_fails(path, 2, other))
      CHECK_THAT(e, Catch::Contains("'optim.param.5.exp_avg") && Catch::Contains("another model"));
    fs::remove_all(dir);
    fs::create_directories(dir);
    save(optim::adamw(), test::zero_sizes(), optim::zero_save_mode::gathered);
    for (auto const& e : load_fails(path, 2, other))
      CHECK_THAT(e, Catch::Contains("'param.5.exp_avg'") && Catch::Contains("nothing was loaded"));
  }
  SECTION("a save before the first step, on every rank") {
    for (auto const& e : messages(2, [&](dpl::rank_context& ctx) {
           train_zero(ctx, optim::adamw(), test::zero_sizes(), 0,
                    [&](auto&, auto& opt) { optim::save_zero_state(path, opt, optim::zero_save_mode::sharded); });
         }))
      CHECK_THAT(e, Catch::Contains("expected an optimizer that has taken a step"));
  }
}

TEST_CASE("A ZeRO-1 save replaces what earlier saves to the same path left, in either mode and on any world size",
          "[host][zero][checkpoint]") {
  auto const dir = test::scratch_dir("test_zero_reshard", "replace");
  auto const path = dir / "opt.safetensors";
  struct save_step {
    int world, steps;
    optim::zero_save_mode mode;
  };
  for (auto const s : {save_step{2, 3, optim::zero_save_mode::gathered}, save_step{3, 2, optim::zero_save_mode::sharded},
                       save_step{2, 4, optim::zero_save_mode::sharded}, save_step{3, 1, optim::zero_save_mode::gathered}}) {
    INFO(s.world << " ranks, " << s.steps << " steps, " << mode_name(s.mode));
    for (auto const& e : messages(s.world, [&](dpl::rank_context& ctx) {
           train_zero(ctx, optim::adamw(), test::zero_sizes(), s.steps,
                      [&](auto&, auto& opt) { optim::save_zero_state(path, opt, s.mode); });
         }))
      REQUIRE(e.empty());
    std::vector<std::uint64_t> loaded(2);
    for (auto const& e : messages(2, [&](dpl::rank_context& ctx) {
           train_zero(ctx, optim::adamw(), test::zero_sizes(), 0, [&](auto&, auto& opt) {
             optim::load_zero_state(path, opt);
             loaded[static_cast<std::size_t>(ctx.rank())] = opt.steps();
           });
         }))
      CHECK(e.empty());
    CHECK(loaded == std::vector<std::uint64_t>(2, static_cast<std::uint64_t>(s.steps)));
    // The committed save and the one before it stay (Note [ZeRO save sets]); no other save's file.
    std::set<std::string> sets;
    for (auto const& f : fs::directory_iterator(dir))
      if (f.path() != path) sets.insert(f.path().filename().string().substr(4, 16));  // "opt.<set>..."
    CHECK(sets.size() <= 2);
    auto const committed = optim::zero_state_files(path);
    REQUIRE(committed.size() == (s.mode == optim::zero_save_mode::sharded ? static_cast<std::size_t>(s.world) + 1 : 1));
    if (committed.size() > 1) CHECK(sets.contains(committed[1].filename().string().substr(4, 16)));
  }
}

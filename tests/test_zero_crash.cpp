// ZeRO-1 saves survive a kill (Note [ZeRO save sets] in optim/detail/zero_sets.hpp). A job that
// resumes from a checkpoint, trains two steps and saves again (save_zero_state on every rank, then
// the training checkpoint on rank 0, recording the save's identity) is killed at every point where
// the files on disk change state, and at random moments. After each kill the checkpoint on disk
// resumes with exactly its own optimizer state: one more step gives bitwise the parameters of an
// uninterrupted resume from the previous save or from the new one, never anything else, and a
// resume always succeeds. A save's files never mix with another's: a shard of another save with
// the right name is refused.
#include "models.hpp"
#include "scratch.hpp"
#include "test_zero_common.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/zero_checkpoint.hpp>
#include <dparallel/io/detail/atomic_file.hpp>
#include <dparallel/optim/detail/zero_sets.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// A child killed at a probe ends with its rank threads unjoined: that is the kill being tested,
// not a leak to report (ThreadSanitizer builds).
#if defined(__SANITIZE_THREAD__)
extern "C" char const* __tsan_default_options() { return "report_thread_leaks=0"; }
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
extern "C" char const* __tsan_default_options() { return "report_thread_leaks=0"; }
#endif
#endif

namespace dpl = dparallel;
namespace optim = dparallel::optim;
namespace fs = std::filesystem;
using model = test::chunked<float>;

namespace {

constexpr int world = 2;

/// Where a resume stands: the checkpoint's step, and rank 0's parameters after one more step.
struct outcome {
  std::uint64_t step = 0;
  std::uint64_t hash = 0;
  friend bool operator==(outcome const&, outcome const&) = default;
};

template <class Wrapper, class Optimizer>
void train_steps(dpl::rank_context& ctx, model& m, Wrapper& w, Optimizer& opt, int from, int to) {
  for (int k = from; k < to; ++k) {
    auto const d = test::dataset<float>::make(4 * world, m.dim, static_cast<std::uint64_t>(k + 1), false);
    auto const r = static_cast<std::size_t>(ctx.rank());
    w.step(dpl::slice_batch(d.all(), r * 4, r * 4 + 4), [](model& x, test::samples<float> s) { return x.forward_backward(s); });
    opt.step(0.01);
  }
}

/// A job on `world` thread ranks: from the checkpoint in `dir` (none: from scratch) to step `to`;
/// then, with `save`, the optimizer state and the checkpoint, in that order. Returns what a step
/// after the start gives (rank 0's parameters), and the start's step.
outcome job(fs::path const& dir, int to, optim::zero_save_mode mode, bool save) {
  outcome out;
  std::mutex mu;
  dpl::spawn(world, [&](dpl::rank_context& ctx) {
    model m(test::zero_sizes(), static_cast<std::uint64_t>(7 + ctx.rank()));
    dpl::checkpoint ckpt(m);
    std::optional<optim::zero_state_id> id;
    if (fs::exists(dir / "c.safetensors")) {
      ckpt.load(dir / "c.safetensors");
      id = optim::zero_state_id::recorded(ckpt.progress());
    }
    dpl::parallel<model, dpl::ddp_zero1> w(m, ctx.group(), test::zero_tiny_buckets());
    dpl::optim::zero_redundancy_optimizer opt(w, optim::adamw());
    int const from = static_cast<int>(ckpt.progress().step);
    if (id) optim::load_zero_state(dir / "opt.safetensors", opt, id);
    train_steps(ctx, m, w, opt, from, to);
    if (ctx.rank() == 0) {
      std::lock_guard lock(mu);
      out = {static_cast<std::uint64_t>(from), test::param_hash(m)};
    }
    if (!save) return;
    auto const saved = optim::save_zero_state(dir / "opt.safetensors", opt, mode);
    optim::detail::zero_save_probe("checkpoint next");
    if (ctx.rank() != 0) return;
    dpl::checkpoint next(m);
    next.progress().step = static_cast<std::uint64_t>(to);
    saved.record(next.progress());
    next.save(dir / "c.safetensors");
  });
  return out;
}

/// Resumes from the checkpoint in `dir` and takes one step.
outcome resume(fs::path const& dir) {
  model m(test::zero_sizes(), 7);
  dpl::checkpoint c(m);
  c.load(dir / "c.safetensors");
  return job(dir, static_cast<int>(c.progress().step) + 1, optim::zero_save_mode::sharded, false);
}

void copy_dir(fs::path const& from, fs::path const& to) {
  fs::remove_all(to);
  fs::create_directories(to);
  fs::copy(from, to, fs::copy_options::recursive);
}

std::atomic<int> probes_left{0};
void kill_at_probe(char const*) {
  if (probes_left.fetch_sub(1) == 1) ::_exit(0);  // as a kill: no destructor, no flush
}

/// Runs job(dir, 5) in a child process; with `at_probe` > 0 the child dies at that probe, with
/// `after` > 0 it is killed (SIGKILL) that long after it started. Returns whether it finished.
bool child_job(fs::path const& dir, optim::zero_save_mode mode, int at_probe, std::chrono::microseconds after) {
  pid_t const pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    probes_left = at_probe;
    if (at_probe > 0) optim::detail::zero_save_probe_fn = &kill_at_probe;
    try {
      job(dir, 5, mode, true);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(3);
  }
  if (after.count() > 0) {
    std::this_thread::sleep_for(after);
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE_FALSE((WIFEXITED(status) && WEXITSTATUS(status) == 2));  // a save that failed by itself
  return WIFEXITED(status) && WEXITSTATUS(status) == 3;
}

char const* name_of(optim::zero_save_mode m) { return m == optim::zero_save_mode::sharded ? "sharded" : "gathered"; }

}  // namespace

TEST_CASE("A ZeRO-1 save killed at any point leaves a checkpoint that resumes bitwise with its own optimizer state",
          "[host][zero][checkpoint][fault]") {
  for (auto const mode : {optim::zero_save_mode::sharded, optim::zero_save_mode::gathered}) {
    INFO(name_of(mode));
    auto const root = test::scratch_dir("test_zero_crash", name_of(mode));
    auto const start = root / "start", run = root / "run";
    fs::create_directories(start);
    job(start, 3, mode, true);  // the previous checkpoint: step 3
    copy_dir(start, run);
    auto const previous = resume(run);
    copy_dir(start, run);
    auto const t0 = std::chrono::steady_clock::now();
    job(run, 5, mode, true);  // the new one: step 5
    auto const took = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0);
    auto const next = resume(run);
    REQUIRE(previous.step == 3);
    REQUIRE(next.step == 5);
    REQUIRE(previous.hash != next.hash);

    // Every point where the files change state, in order, until the job finishes.
    std::set<std::uint64_t> seen;
    int points = 0;
    for (int k = 1; k < 50; ++k) {
      copy_dir(start, run);
      bool const finished = child_job(run, mode, k, {});
      auto const got = resume(run);
      INFO("killed at probe " << k << (finished ? " (finished)" : ""));
      CHECK((got == previous || got == next));
      seen.insert(got.step);
      if (finished) {
        CHECK(got == next);
        break;
      }
      ++points;
    }
    CHECK(points >= 2);  // at least: a shard or the set written, the commit, the checkpoint next
    CHECK(seen == std::set<std::uint64_t>{3, 5});

    // At random moments of the save (and of the training before it).
    std::mt19937 rng(12345);
    std::uniform_int_distribution<long> when(1, 2 * took.count() + 1000);
    for (int k = 0; k < 12; ++k) {
      copy_dir(start, run);
      child_job(run, mode, 0, std::chrono::microseconds(when(rng)));
      auto const got = resume(run);
      CHECK((got == previous || got == next));
    }
    // A later save cleans up after the kills: no temporary left, at most three saves' files.
    job(run, 7, mode, true);
    std::set<std::string> sets;
    for (auto const& f : fs::directory_iterator(run)) {
      std::string const n = f.path().filename().string();
      CHECK(n.find(".tmp-") == std::string::npos);
      if (n.starts_with("opt.") && n != "opt.safetensors") sets.insert(n.substr(4, 16));
    }
    CHECK(sets.size() <= 3);
  }
}

TEST_CASE("A ZeRO-1 shard of another save, the checkpoint's save gone, or another step count are refused by name",
          "[host][zero][checkpoint][errors]") {
  auto const dir = test::scratch_dir("test_zero_crash", "mix");
  auto const path = dir / "opt.safetensors";
  job(dir, 2, optim::zero_save_mode::sharded, true);
  auto const first = optim::zero_state_files(path);
  REQUIRE(first.size() == 3);
  auto const keep = dir / "keep";
  fs::create_directories(keep);
  fs::copy(first[2], keep / first[2].filename());
  job(dir, 4, optim::zero_save_mode::sharded, true);
  auto const second = optim::zero_state_files(path);
  // Rank 1's file of the first save under the second save's name: refused, naming both saves.
  fs::copy(keep / first[2].filename(), second[2], fs::copy_options::overwrite_existing);
  auto const error_of = [&](auto&& load) {
    std::string what;
    std::mutex mu;
    dpl::spawn(world, [&](dpl::rank_context& ctx) {
      model m(test::zero_sizes(), 7);
      dpl::parallel<model, dpl::ddp_zero1> w(m, ctx.group(), test::zero_tiny_buckets());
      dpl::optim::zero_redundancy_optimizer opt(w, optim::adamw());
      try {
        load(opt);
      } catch (dpl::error const& e) {
        std::lock_guard lock(mu);
        what = e.what();
      }
    });
    return what;
  };
  CHECK_THAT(error_of([&](auto& opt) { optim::load_zero_state(path, opt); }),
             Catch::Contains("(shard files of different saves)") && Catch::Contains("nothing was loaded"));
  // A checkpoint naming a save whose files are gone.
  CHECK_THAT(error_of([&](auto& opt) { optim::load_zero_state(path, opt, optim::zero_state_id{"0123456789abcdef", 2}); }),
             Catch::Contains("names ZeRO save '0123456789abcdef' (step 2), but no file of it is beside") &&
                 Catch::Contains("optim::zero_state_files"));
  // The right save with another step count (a checkpoint edited, or of another run).
  auto const set = first[1].filename().string().substr(4, 16);
  CHECK_THAT(error_of([&](auto& opt) { optim::load_zero_state(path, opt, optim::zero_state_id{set, 3}); }),
             Catch::Contains("holds step 2, the checkpoint expects step 3"));
  // optim::load_state on a sharded save's manifest says what it is.
  model m(test::zero_sizes(), 7);
  optim::optimizer opt(m, optim::adamw());
  CHECK_THROWS_WITH(optim::load_state(path, opt, m), Catch::Contains("is the manifest of a sharded ZeRO-1 save"));
}

TEST_CASE("A ZeRO-1 save removes what killed saves of any world size left, and keeps a live writer's temporary",
          "[host][zero][checkpoint][fault]") {
  auto const dir = test::scratch_dir("test_zero_crash", "stale");
  pid_t const dead = ::fork();  // a process that has ended: the writer killed during a save
  REQUIRE(dead >= 0);
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  auto const temporary = [&](std::string const& target, long long pid) {
    return dir / (dpl::detail::temporary_prefix(dir / target) + std::to_string(pid) + "-1");
  };
  auto const plant = [](fs::path const& p) {
    std::ofstream(p) << "partial";
    return p;
  };
  std::string const other = optim::detail::set_name(0x5eed);  // a save of 4 ranks that never committed
  std::vector<fs::path> const stale{
      plant(temporary("opt." + other + ".rank3-of-4.safetensors", dead)),
      plant(temporary("opt." + other + ".opt.safetensors", dead)),
      plant(temporary("opt.rank3-of-4.safetensors", dead)),  // of a save without sets
      plant(dir / ("opt." + other + ".rank1-of-4.safetensors")),
      plant(dir / "opt.rank2-of-4.safetensors"),
  };
  auto const live = plant(temporary("opt." + other + ".rank2-of-4.safetensors", ::getpid()));
  job(dir, 2, optim::zero_save_mode::sharded, true);  // a fresh job's first save, on 2 ranks
  for (auto const& p : stale) {
    INFO(p.filename().string());
    CHECK_FALSE(fs::exists(p));
  }
  CHECK(fs::exists(live));  // its writer (this process) may still rename it
  CHECK(resume(dir).step == 2);
}

TEST_CASE("Loading a ZeRO-1 save that does not exist says so and names the save's path",
          "[host][zero][checkpoint][errors]") {
  auto const dir = test::scratch_dir("test_zero_crash", "absent");
  std::string what;
  std::mutex mu;
  dpl::spawn(world, [&](dpl::rank_context& ctx) {
    model m(test::zero_sizes(), 7);
    dpl::parallel<model, dpl::ddp_zero1> w(m, ctx.group(), test::zero_tiny_buckets());
    dpl::optim::zero_redundancy_optimizer opt(w, optim::adamw());
    try {
      optim::load_zero_state(dir / "absent.safetensors", opt);
    } catch (dpl::error const& e) {
      std::lock_guard lock(mu);
      what = e.what();
    }
  });
  CHECK_THAT(what, Catch::Contains("found no ZeRO save at") && Catch::Contains("absent.safetensors") &&
                       Catch::Contains("save_zero_state"));
  CHECK_THAT(what, !Catch::Contains("rank0-of-0"));
}

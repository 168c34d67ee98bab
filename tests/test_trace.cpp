// Step traces (core/trace.hpp): DP over 2 devices and DDP over 2 thread ranks write one Chrome
// trace event file per wrapper and rank, valid JSON, with one "step" event per step (its number
// in args), the phases inside the step and one step-function event per device inside it; DDP's
// gradients marked ready (instants) and its buckets' collectives (spans) on every step; the
// ranks' files are aligned at the DDP constructor. scripts/merge-traces joins them (a CTest of
// its own, trace:merge, runs it on the files this test leaves in DPARALLEL_TEST_TRACE_DIR).
#include "models.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/io/detail/json.hpp>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace dpl = dparallel;
namespace fs = std::filesystem;
using model = test::chunked<float>;

namespace {

struct event {
  std::string name, cat;
  int pid = 0, tid = 0;
  double ts = 0, dur = 0;
  long step = -1;
};

/// The trace's events (one per line, as step_trace writes them), after checking the whole file is
/// valid JSON.
std::vector<event> read_trace(fs::path const& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string const text = ss.str();
  dpl::detail::json::cursor in(text, p.string());
  in.skip_value(0);  // throws on invalid JSON
  std::vector<event> out;
  std::regex const re(
      R"re(\{"name":"([^"]*)","cat":"([^"]*)","ph":"X","pid":(\d+),"tid":(\d+),"ts":([-0-9.]+),"dur":([0-9.]+)(,"args":\{"step":(\d+))?)re");
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (!std::regex_search(line, m, re)) continue;
    out.push_back({m[1], m[2], std::stoi(m[3]), std::stoi(m[4]), std::stod(m[5]), std::stod(m[6]),
                   m[8].matched ? std::stol(m[8]) : -1});
  }
  return out;
}

std::vector<fs::path> traces_in(fs::path const& dir) {
  std::vector<fs::path> out;
  for (auto const& e : fs::directory_iterator(dir))
    if (e.path().filename().string().starts_with("dparallel.rank")) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

/// Checks one file of `steps` steps of a wrapper with `devices` devices on rank `rank`.
void check_trace(std::vector<event> const& ev, int rank, int steps, int devices) {
  std::set<std::string> const cats{"step", "compute", "comm", "wait", "data"};
  std::vector<event> step_events;
  for (auto const& e : ev) {
    CHECK(cats.contains(e.cat));
    CHECK(e.pid == rank);
    if (e.name == "step") step_events.push_back(e);
  }
  REQUIRE(step_events.size() == static_cast<std::size_t>(steps));
  for (int k = 0; k < steps; ++k) {
    event const& s = step_events[static_cast<std::size_t>(k)];
    CHECK(s.step == k);
    int compute = 0, phases = 0;
    for (auto const& e : ev) {
      bool const inside = e.ts >= s.ts - 1e-3 && e.ts + e.dur <= s.ts + s.dur + 1e-3;
      if (!inside || e.name == "step") continue;
      if (e.name == "step function") {
        ++compute;
        CHECK(e.tid >= 1);
        CHECK(e.tid <= devices);
      } else if (e.name == "scatter" || e.name == "replicate" || e.name == "reduce wait" || e.name == "gather") {
        ++phases;
      }
    }
    CHECK(compute == devices);
    CHECK(phases == 4);
  }
}

}  // namespace

TEST_CASE("trace: DP and DDP write a timeline of their steps per rank", "[trace]") {
  char const* keep = std::getenv("DPARALLEL_TEST_TRACE_DIR");
  fs::path const dir = keep != nullptr ? fs::path(keep) : fs::temp_directory_path() / "dparallel_test_trace";
  fs::remove_all(dir);
  auto const data = test::dataset<float>::make(8, model().dim, 5, true);

  {
    model m;
    dpl::data_parallel<model> dp(m, dpl::host::devices(2), {.trace = (dir / "dp").string()});
    dp.note_data_wait(std::chrono::microseconds(250));
    for (int k = 0; k < 3; ++k) dp.step(data.all(), [](model& r, test::samples<float> s) { r.forward_backward(s); });
  }
  auto const dp_files = traces_in(dir / "dp");
  REQUIRE(dp_files.size() == 1);
  auto const dp_events = read_trace(dp_files[0]);
  check_trace(dp_events, 0, 3, 2);
  bool waited = false;
  for (auto const& e : dp_events) waited |= e.name == "data wait" && e.cat == "data" && e.dur >= 249;
  CHECK(waited);

  // DDP with small buckets, the step function marking each gradient ready as backward makes it.
  std::size_t buckets = 0;
  dpl::spawn(2, [&](dpl::rank_context& rank) {
    model m;
    dpl::distributed_data_parallel<model> ddp(
        m, rank.group(),
        {.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024), .trace = dir.string()});
    auto const lo = static_cast<std::size_t>(rank.rank()) * 4;
    for (int k = 0; k < 4; ++k)
      ddp.step(dpl::slice_batch(data.all(), lo, lo + 4),
               [](model& r, test::samples<float> s, dpl::step_context& ctx) { r.forward_backward(s, &ctx); });
    if (rank.rank() == 0) buckets = ddp.reducer().buckets().size();
  });
  REQUIRE(buckets > 1);
  auto const files = traces_in(dir);
  REQUIRE(files.size() == 2);
  std::set<int> ranks;
  for (auto const& f : files) {
    auto const ev = read_trace(f);
    REQUIRE(!ev.empty());
    int const rank = ev[0].pid;
    ranks.insert(rank);
    check_trace(ev, rank, 4, 1);
    std::size_t ready = 0, bucket_spans = 0;
    for (auto const& e : ev) {
      if (e.name == "bucket") {
        ++bucket_spans;
        CHECK(e.cat == "comm");
        CHECK(e.tid == 1000);
      }
    }
    std::ifstream in(f);
    for (std::string line; std::getline(in, line);)
      if (line.find("\"name\":\"grad ready\"") != std::string::npos && line.find("\"ph\":\"i\"") != std::string::npos) ++ready;
    CHECK(ready == 4 * model().w.size());  // every parameter, every step
    CHECK(bucket_spans == 4 * buckets);     // every bucket, every step
  }
  CHECK(ranks == std::set<int>{0, 1});
  if (keep == nullptr) fs::remove_all(dir);
}

TEST_CASE("trace: off without options::trace and DPARALLEL_TRACE, and flush_trace writes the file so far", "[trace]") {
  model m;
  dpl::data_parallel<model> off(m, dpl::host::devices(1));
  if (std::getenv("DPARALLEL_TRACE") == nullptr) CHECK(off.flush_trace().empty());
  fs::path const dir = fs::temp_directory_path() / "dparallel_test_trace_flush";
  fs::remove_all(dir);
  model n;
  dpl::data_parallel<model> on(n, dpl::host::devices(1), {.trace = dir.string()});
  auto const data = test::dataset<float>::make(4, model().dim, 6, true);
  on.step(data.all(), [](model& r, test::samples<float> s) { r.forward_backward(s); });
  std::string const path = on.flush_trace();
  REQUIRE(!path.empty());
  check_trace(read_trace(path), 0, 1, 1);
  on.step(data.all(), [](model& r, test::samples<float> s) { r.forward_backward(s); });
  check_trace(read_trace(on.flush_trace()), 0, 2, 1);
  fs::remove_all(dir);
}

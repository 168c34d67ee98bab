// The shared-memory communicator between real processes (fork): every collective (the *_coalesced
// ones over lists of tensors too) gives the bits of the thread-rank host communicator (2, 3 and 4 processes; empty, one-element, odd and multi-chunk
// sizes; the one-meeting and the chunked paths); DDP over N processes, bootstrapped through pipes
// or launched torchrun-style (RANK, WORLD_SIZE, ... set in each child, the TCP rendezvous), trains
// bitwise the parameters of DDP over N thread ranks; and the faults: a process killed while it
// holds the segment, a rank that never maps it, a stale segment of the same name, mismatched
// calls, abort. After every scenario, /dev/shm holds no segment of the scenario's processes.
#include "engine_contracts.hpp"
#include "fork_ranks.hpp"
#include "models.hpp"
#include "test_zero_common.hpp"

#include <dparallel/comm/host.hpp>
#include <dparallel/comm/shm.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace dpl = dparallel;
using namespace std::chrono_literals;

namespace {

// --- collectives ----------------------------------------------------------------------------

/// FNV-1a of bytes, as text.
template <class T>
std::string digest(std::vector<T> const& v) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::byte x : std::as_bytes(std::span(v))) h = (h ^ static_cast<std::uint64_t>(x)) * 1099511628211ull;
  return std::to_string(h) + ",";
}

template <class T>
std::vector<T> numbers(int rank, std::size_t n, std::uint64_t seed) {
  test::rng g{seed * 104729 + static_cast<std::uint64_t>(rank)};
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(g.uniform() * 2 - 1);
  return v;
}

/// `v` cut into tensors of `piece` elements (the last one shorter).
template <class T>
std::vector<dpl::tensor_ref> cut_into(std::vector<T>& v, std::size_t piece) {
  return test::contracts::cut(v, piece);
}

/// Every kind of collective through `g`, over `sizes`; the digest of every output buffer.
template <class T>
std::string exercise(dpl::process_group const& g, std::vector<std::size_t> const& sizes, std::uint64_t& seed) {
  int const r = g.rank();
  int const n = g.size();
  auto const un = static_cast<std::size_t>(n);
  auto const ur = static_cast<std::size_t>(r);
  std::string out;
  for (std::size_t len : sizes) {
    for (auto op : {dpl::reduce_op::sum, dpl::reduce_op::avg}) {
      auto a = numbers<T>(r, len, ++seed);
      auto cut = a;  // the same input cut into tensors, reduced with all_reduce_coalesced
      g.all_reduce(dpl::view(a), op).wait();
      if (len != 0) {
        // Each rank cuts its array differently, and rank 1 passes it whole to a plain all_reduce:
        // the results must be all_reduce's bits.
        auto const parts = cut_into(cut, 1 + len / (3 + ur));
        if (r == 1) g.all_reduce(dpl::view(cut), op).wait();
        else g.all_reduce_coalesced(parts, op).wait();
        out += std::memcmp(cut.data(), a.data(), len * sizeof(T)) == 0 ? "=" : "!";
      }
      auto b = numbers<T>(r, len, ++seed);
      g.reduce(dpl::view(b), static_cast<int>(seed % un), op).wait();
      auto in = numbers<T>(r, len * un, ++seed);
      std::vector<T> o(len);
      g.reduce_scatter(dpl::view(o), dpl::view(in), op).wait();
      auto in2 = numbers<T>(r, len * un, ++seed);  // in place: out is in's block r
      g.reduce_scatter(dpl::tensor_view<T>(in2.data() + ur * len, len), dpl::view(in2), op).wait();
      if (len != 0) {  // `in` cut into tensors (differently by each rank; rank 1 plain): o's bits
        std::vector<T> o3(len);
        auto const parts = cut_into(in, 1 + len * un / (3 + ur));
        if (r == 1) g.reduce_scatter(dpl::view(o3), dpl::view(in), op).wait();
        else g.reduce_scatter_coalesced(dpl::view(o3), parts, op).wait();
        out += std::memcmp(o3.data(), o.data(), len * sizeof(T)) == 0 ? "=" : "!";
      }
      out += digest(a) + digest(b) + digest(o) + digest(in2);
    }
    auto c = numbers<T>(r, len, ++seed);
    g.broadcast(dpl::view(c), n - 1).wait();
    auto mine = numbers<T>(r, len, ++seed);
    std::vector<T> all(len * un);
    g.all_gather(dpl::view(all), dpl::view(mine)).wait();
    std::vector<T> all2(len * un, T(7));  // in place: in is out's block r
    std::copy(mine.begin(), mine.end(), all2.begin() + static_cast<std::ptrdiff_t>(ur * len));
    g.all_gather(dpl::view(all2), dpl::tensor_view<T>(all2.data() + ur * len, len)).wait();
    if (len != 0) {  // in place over a list (each rank's own cut; rank 1 plain): all's bits
      std::vector<T> all3(len * un, T(5));
      std::copy(mine.begin(), mine.end(), all3.begin() + static_cast<std::ptrdiff_t>(ur * len));
      auto const parts = cut_into(all3, 1 + len * un / (2 + ur));
      if (r == 1) g.all_gather(dpl::view(all3), dpl::tensor_view<T>(all3.data() + ur * len, len)).wait();
      else g.all_gather_coalesced(parts).wait();
      out += all3 == all ? "=" : "!";
    }
    out += digest(c) + digest(all) + digest(all2) + "|";
  }
  // Several in flight, waited for in reverse order.
  std::vector<std::vector<T>> many;
  std::vector<dpl::work> works;
  for (std::size_t k = 0; k < 5; ++k) many.push_back(numbers<T>(r, 300 + k * 1001, ++seed));
  for (auto& v : many) works.push_back(g.all_reduce(dpl::view(v)));
  for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
  for (auto const& v : many) out += digest(v);
  g.barrier().wait();
  return out;
}

std::vector<std::size_t> const float_sizes = {0, 1, 2, 5, 1000, 4099, 16411, 300007};

/// The digests of every collective in exercise(), F32 and F64.
std::string all_collectives(dpl::process_group const& g) {
  std::uint64_t seed = 0;
  return exercise<float>(g, float_sizes, seed) + exercise<double>(g, float_sizes, seed);
}

// --- DDP ------------------------------------------------------------------------------------

using model = test::chunked<float>;

/// Four DDP steps with small buckets (several collectives in flight); the final parameter hash.
std::string ddp_hash(dpl::process_group const& group) {
  int const rank = group.rank();
  int const world = group.size();
  model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(40 + rank));
  dpl::distributed_data_parallel<model> ddp(
      m, group, {.bucket_cap_mb = 16.0 / (1024 * 1024), .first_bucket_cap_mb = 8.0 / (1024 * 1024)});
  for (int step = 0; step < 4; ++step) {
    auto const data = test::dataset<float>::make(5 * static_cast<std::size_t>(world), m.dim,
                                                 static_cast<std::uint64_t>(step + 3), false);
    auto const first = static_cast<std::size_t>(rank) * 5;
    // Steps 0 and 1 mark gradients ready during backward (buckets copied and overlapped); steps 2
    // and 3 do not (buckets reduced after the step function, as lists of the gradients).
    bool const overlap = step < 2;
    ddp.step(dpl::slice_batch(data.all(), first, first + 5),
             [overlap](model& r, test::samples<float> s, dpl::step_context& ctx) {
               return r.forward_backward(s, overlap ? &ctx : nullptr);
             });
    ddp.module().sgd(0.1f);
  }
  return std::to_string(test::param_hash(m));
}

/// 20 steps of ZeRO-1 (zero) or DDP with the same update rule, tiny buckets (padded ones among
/// them) or default ones: the parameter hash after every step.
std::string zero_hashes(dpl::process_group const& group, bool zero, bool tiny) {
  std::string out;
  for (auto h : test::train_zero_or_ddp(group, zero, false, tiny).hashes) out += std::to_string(h) + ",";
  return out;
}

/// What each thread rank of a `world`-rank spawn reports for `f`.
std::vector<std::string> thread_reference(int world, std::function<std::string(dpl::process_group const&)> const& f) {
  std::vector<std::string> ref(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& rc) { ref[static_cast<std::size_t>(rc.rank())] = f(rc.group()); });
  return ref;
}

}  // namespace

// =================================================================================================

TEST_CASE("shm: every collective gives the thread-rank bits, on 2, 3 and 4 processes, both paths", "[shm]") {
  for (int n : {2, 3, 4}) {
    auto const ref = thread_reference(n, [](dpl::process_group const& g) { return all_collectives(g); });
    // Default options, then tiny slots and chunks: every size above 256 bytes takes the chunked
    // path, in many chunks.
    for (bool tiny : {false, true}) {
      dpl::shm::options const opts = tiny ? dpl::shm::options{.small_bytes = 256, .chunk_bytes = 16384}
                                          : dpl::shm::options{};
      std::vector<pid_t> pids;
      auto const got = run_ranks(
          n,
          [&](int rank, dpl::shm::bootstrap_fn const& share) {
            auto const g = dpl::shm::make_group(rank, n, share, 60s, opts);
            return all_collectives(g);
          },
          &pids);
      for (int r = 0; r < n; ++r) {
        INFO(n << " processes, rank " << r << ", tiny chunks " << tiny);
        CHECK(got[static_cast<std::size_t>(r)].exit_code == 0);
        CHECK(got[static_cast<std::size_t>(r)].text == ref[static_cast<std::size_t>(r)]);
      }
      require_no_segments_of(pids);
    }
  }
}

TEST_CASE("shm: integer sums wrap exactly and are the same on every rank", "[shm]") {
  int const n = 3;
  auto const got = run_ranks(n, [&](int rank, dpl::shm::bootstrap_fn const& share) {
    auto const g = dpl::shm::make_group(rank, n, share, 60s, {.small_bytes = 64, .chunk_bytes = 1024});
    std::string s;
    for (std::size_t len : {std::size_t{3}, std::size_t{1000}}) {
      std::vector<std::int32_t> i32(len);
      std::vector<std::uint8_t> u8(len);
      for (std::size_t i = 0; i < len; ++i) {
        // Computed unsigned (wrapping) and converted: near INT32_MAX, the signed sum would overflow.
        i32[i] = static_cast<std::int32_t>(static_cast<std::uint32_t>(i) * static_cast<std::uint32_t>(rank + 1) + 2147483000u);
        u8[i] = static_cast<std::uint8_t>(i * 3 + static_cast<std::size_t>(rank) * 100);
      }
      g.all_reduce(dpl::view(i32)).wait();
      g.all_reduce(dpl::view(u8)).wait();
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < len; ++i) {
        std::uint32_t w32 = 0;
        std::uint8_t w8 = 0;
        for (int k = 0; k < n; ++k) {
          w32 += static_cast<std::uint32_t>(i) * static_cast<std::uint32_t>(k + 1) + 2147483000u;
          w8 = static_cast<std::uint8_t>(w8 + i * 3 + static_cast<std::size_t>(k) * 100);
        }
        wrong += static_cast<std::uint32_t>(i32[i]) != w32;
        wrong += u8[i] != w8;
      }
      s += std::to_string(wrong) + ";";
    }
    return s;
  });
  for (auto const& r : got) {
    CHECK(r.exit_code == 0);
    CHECK(r.text == "0;0;");  // no wrong element, on the one-meeting and the chunked path
  }
}

TEST_CASE("shm: DDP over N processes trains the parameters of DDP over N thread ranks, bitwise", "[shm][ddp]") {
  for (int n : {2, 3}) {
    auto const ref = thread_reference(n, ddp_hash);
    std::vector<pid_t> pids;
    auto const got = run_ranks(
        n,
        [&](int rank, dpl::shm::bootstrap_fn const& share) { return ddp_hash(dpl::shm::make_group(rank, n, share, 60s)); },
        &pids);
    for (int r = 0; r < n; ++r) {
      INFO(n << " processes, rank " << r << ": " << got[static_cast<std::size_t>(r)].text);
      CHECK(got[static_cast<std::size_t>(r)].text == ref[0]);
    }
    require_no_segments_of(pids);
  }
}

TEST_CASE("shm: ZeRO-1 over N processes trains bitwise DDP's parameters over N thread ranks", "[shm][zero]") {
  // Reduce-scattered from the gradients and all-gathered into the parameters as lists.
  for (int n : {2, 3}) {
    for (bool tiny : {false, true}) {
      auto const ref = thread_reference(n, [&](dpl::process_group const& g) { return zero_hashes(g, false, tiny); });
      std::vector<pid_t> pids;
      auto const got = run_ranks(
          n,
          [&](int rank, dpl::shm::bootstrap_fn const& share) {
            return zero_hashes(dpl::shm::make_group(rank, n, share, 60s), true, tiny);
          },
          &pids);
      for (int r = 0; r < n; ++r) {
        INFO(n << " processes, tiny buckets " << tiny << ", rank " << r);
        CHECK(got[static_cast<std::size_t>(r)].text == ref[0]);
      }
      require_no_segments_of(pids);
    }
  }
}

TEST_CASE("shm: a torchrun-style launch (RANK, WORLD_SIZE, ... and the rendezvous) gives the same DDP", "[shm][ddp]") {
  int const n = 2;
  auto const ref = thread_reference(n, ddp_hash);
  int const port = free_port();
  std::vector<pid_t> pids;
  auto const got = run_ranks(
      n,
      [&](int rank, dpl::shm::bootstrap_fn const&) {
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        ::setenv("RANK", std::to_string(rank).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
        ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
        ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
        auto const g = dpl::shm::init_process_group({.timeout = 60s});
        return std::to_string(g.local_rank()) + "/" + std::to_string(g.local_world_size()) + " " + ddp_hash(g);
      },
      &pids);
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << ": " << got[static_cast<std::size_t>(r)].text);
    CHECK(got[static_cast<std::size_t>(r)].text == std::to_string(r) + "/2 " + ref[0]);
  }
  require_no_segments_of(pids);
}

TEST_CASE("shm: ranks on several nodes without MPI: an error that says to launch with MPI", "[shm]") {
  auto const env = [](std::string const& name) -> std::optional<std::string> {
    if (name == "RANK") return "0";
    if (name == "WORLD_SIZE") return "4";
    if (name == "LOCAL_RANK") return "0";
    if (name == "LOCAL_WORLD_SIZE") return "2";
    return std::nullopt;
  };
  CHECK_THROWS_WITH(dpl::shm::init_process_group({}, {}, env),
                    Catch::Contains("4 ranks but 2 on this node") && Catch::Contains("Launch a job on several nodes with MPI"));
}

// --- faults -----------------------------------------------------------------------------------

TEST_CASE("shm fault: a process killed while it holds the segment is named at once, no hang", "[shm][fault]") {
  int const n = 3;
  std::vector<pid_t> pids;
  auto const t0 = std::chrono::steady_clock::now();
  auto const got = run_ranks(
      n,
      [&](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
        auto const g = dpl::shm::make_group(rank, n, share, 60s);
        std::vector<float> v(100000, 1.0f);
        for (int k = 0; k < 3; ++k) g.all_reduce(dpl::view(v)).wait();
        if (rank == 1) ::raise(SIGKILL);
        g.all_reduce(dpl::view(v)).wait();
        return "finished without error";
      },
      &pids);
  auto const elapsed = std::chrono::steady_clock::now() - t0;
  CHECK(got[1].exit_code == 128 + SIGKILL);
  for (int r : {0, 2}) {
    INFO("rank " << r << ": " << got[static_cast<std::size_t>(r)].text);
    CHECK_THAT(got[static_cast<std::size_t>(r)].text,
               Catch::StartsWith("EXC comm_error 1:") && Catch::Contains("rank 1 (process " + std::to_string(pids[1])) &&
                   Catch::Contains("died or exited"));
  }
  CHECK(elapsed < 30s);  // the timeout is 60 s: the death was found, not waited out
  require_no_segments_of(pids);
}

TEST_CASE("shm fault: a rank that never maps the segment is named at the timeout; nothing is left", "[shm][fault]") {
  int const n = 3;
  std::vector<pid_t> pids;
  auto const got = run_ranks(
      n,
      [&](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
        if (rank == 1) {
          (void)share({});  // receives the name, never maps it
          std::this_thread::sleep_for(3s);
          return "stayed away";
        }
        auto const g = dpl::shm::make_group(rank, n, share, 1500ms);
        return "made a group without rank 1";
      },
      &pids);
  for (int r : {0, 2}) {
    INFO("rank " << r << ": " << got[static_cast<std::size_t>(r)].text);
    CHECK_THAT(got[static_cast<std::size_t>(r)].text,
               Catch::StartsWith("EXC timeout_error 1:") && Catch::Contains("rank 1 did not map shared-memory segment"));
  }
  require_no_segments_of(pids);
}

TEST_CASE("shm fault: a stale segment with the job's name is replaced; a live one is an error", "[shm][fault]") {
  std::string const job = "test-stale-" + std::to_string(::getpid());
  dpl::detail::shm_layout const layout{2, 256, 4096};
  // A job that crashed during its set-up: created the segment, never unlinked it.
  pid_t const crashed = ::fork();
  REQUIRE(crashed >= 0);
  if (crashed == 0) {
    auto seg = dpl::detail::shm_segment::create("/dparallel-" + job, layout);
    ::raise(SIGKILL);
  }
  int status = 0;
  ::waitpid(crashed, &status, 0);
  REQUIRE(shm_objects("dparallel-" + job).size() == 1);
  auto const got = run_ranks(2, [&](int rank, dpl::shm::bootstrap_fn const& share) {
    auto const g = dpl::shm::make_group(rank, 2, share, 60s, {.job_id = job});
    std::vector<double> v{1.5 + rank};
    g.all_reduce(dpl::view(v)).wait();
    return std::to_string(v[0]);
  });
  CHECK(got[0].text == std::to_string(4.0));
  CHECK(got[1].text == std::to_string(4.0));
  CHECK(shm_objects("dparallel-" + job).empty());

  // A segment of that name whose creator (this process) runs: rank 0 refuses, naming it.
  auto live = dpl::detail::shm_segment::create("/dparallel-" + job, layout);
  auto const refused = run_ranks(2, [&](int rank, dpl::shm::bootstrap_fn const& share) {
    auto const g = dpl::shm::make_group(rank, 2, share, 5s, {.job_id = job});
    return std::string("joined");
  });
  CHECK_THAT(refused[0].text, Catch::Contains("exists and its creator, process " + std::to_string(::getpid())) &&
                                  Catch::Contains("another shm::options::job_id"));
  // Rank 1 gets rank 0's cause through the bootstrap at once (not a timeout of its own).
  CHECK(refused[1].exit_code != 0);
  CHECK_THAT(refused[1].text, Catch::StartsWith("EXC comm_error 0:") &&
                                  Catch::Contains("rank 0 could not set up the shared-memory group") &&
                                  Catch::Contains("exists and its creator, process " + std::to_string(::getpid())));
  live.reset();
  CHECK(shm_objects("dparallel-" + job).empty());
}

TEST_CASE("shm fault: under a torchrun-style launch, rank 0's set-up failure reaches its peers through the rendezvous",
          "[shm][fault]") {
  std::string const job = "test-rdv-live-" + std::to_string(::getpid());
  auto live = dpl::detail::shm_segment::create("/dparallel-" + job, {2, 256, 4096});  // its creator runs
  int const port = free_port();
  auto const t0 = std::chrono::steady_clock::now();
  auto const got = run_ranks(2, [&](int rank, dpl::shm::bootstrap_fn const&) {
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    ::setenv("LOCAL_WORLD_SIZE", "2", 1);
    if (rank == 1) std::this_thread::sleep_for(500ms);  // connects after rank 0 has failed
    auto const g = dpl::shm::init_process_group({.timeout = 60s}, {.job_id = job});
    return std::string("joined");
  });
  auto const elapsed = std::chrono::steady_clock::now() - t0;
  CHECK_THAT(got[0].text, Catch::Contains("exists and its creator, process " + std::to_string(::getpid())));
  INFO("rank 1: " << got[1].text);
  CHECK(got[1].exit_code != 0);
  CHECK_THAT(got[1].text, Catch::Contains("rank 0 could not set up the shared-memory group") &&
                              Catch::Contains("exists and its creator, process " + std::to_string(::getpid())));
  CHECK(elapsed < 30s);  // the timeout is 60 s: told, not waited out
  live.reset();
  CHECK(shm_objects("dparallel-" + job).empty());
}

TEST_CASE("shm fault: a segment left by a rank 0 that died during set-up is removed by the next group", "[shm][fault]") {
  pid_t const crashed = ::fork();
  REQUIRE(crashed >= 0);
  if (crashed == 0) {  // rank 0 of a job that died before its peers mapped the segment
    auto seg = dpl::detail::shm_segment::create(dpl::detail::shm_segment_name({}), {2, 256, 4096});
    ::raise(SIGKILL);
  }
  int status = 0;
  ::waitpid(crashed, &status, 0);
  REQUIRE(shm_objects("dparallel-" + std::to_string(crashed) + "-").size() == 1);
  std::vector<pid_t> pids;
  auto const got = run_ranks(
      2, [&](int rank, dpl::shm::bootstrap_fn const& share) {
        auto const g = dpl::shm::make_group(rank, 2, share, 60s);
        return std::string("ok");
      },
      &pids);
  CHECK(got[0].text == "ok");
  CHECK(got[1].text == "ok");
  CHECK(shm_objects("dparallel-" + std::to_string(crashed) + "-").empty());
  require_no_segments_of(pids);
}

TEST_CASE("shm fault: mismatched calls and abort fail every rank, naming the rank at fault", "[shm][fault]") {
  int const n = 3;
  std::vector<pid_t> pids;
  auto const got = run_ranks(
      n,
      [&](int rank, dpl::shm::bootstrap_fn const& share) -> std::string {
        auto const g = dpl::shm::make_group(rank, n, share, 60s);
        std::vector<float> v(rank == 2 ? 999 : 1000, 1.0f);
        std::string s;
        try {
          g.all_reduce(dpl::view(v)).wait();
        } catch (dpl::comm_error const& e) {
          s = "mismatch " + std::to_string(e.rank()) + ": " + e.what() + "\n";
        }
        auto const h = dpl::shm::make_group(rank, n, share, 60s);
        if (rank == 1) h.abort("injected by rank 1");
        try {
          h.barrier().wait();
        } catch (dpl::comm_error const& e) {
          s += "abort " + std::to_string(e.rank()) + ": " + e.what();
        }
        return s;
      },
      &pids);
  for (int r = 0; r < n; ++r) {
    auto const& text = got[static_cast<std::size_t>(r)].text;
    INFO("rank " << r << ": " << text);
    CHECK_THAT(text, Catch::StartsWith("mismatch 2:") &&
                         Catch::Contains("rank 0 called all_reduce(1000 x F32, sum) but rank 2 called all_reduce(999 x F32, sum)") &&
                         Catch::Contains("abort 1:") && Catch::Contains("injected by rank 1"));
  }
  require_no_segments_of(pids);
}

// Group memory of the shared-memory communicator (process_group::allocate): the allocator of a
// rank's region (blocks, merging, exhaustion, which addresses it owns); memory that lies in the
// group's segment; all_reduce and reduce of buffers in it (every rank's, some ranks', none; a peer
// passing a list) give the bits of thread ranks, small, one-pass and chunked; allocation past the region falls back to
// ordinary memory; and DDP over processes whose gradients live in group memory, all-reduced in
// place with gradient_as_bucket_view, trains bitwise the parameters of DDP over thread ranks, as
// does DDP laying out a bind_gradients model's gradients there itself.
#include "bind_models.hpp"
#include "fork_ranks.hpp"
#include "models.hpp"

#include <dparallel/comm/shm.hpp>
#include <dparallel/comm/shm/detail/arena.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dpl = dparallel;
using namespace std::chrono_literals;

namespace {

// --- the allocator ----------------------------------------------------------------------------

std::string test_segment_name() { return "/dparallel-test-arena-" + std::to_string(::getpid()); }

// --- collectives ------------------------------------------------------------------------------

std::string digest(float const* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  auto const* b = reinterpret_cast<unsigned char const*>(p);
  for (std::size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return std::to_string(h) + ",";
}

/// A buffer of `n` floats: in the group's memory or in ordinary memory.
struct placed {
  std::shared_ptr<std::byte> memory;
  std::vector<float> own;
  float* data = nullptr;
  placed(dpl::process_group const& g, std::size_t n, bool in_group) {
    if (in_group) {
      memory = g.allocate(n * sizeof(float));
      data = reinterpret_cast<float*>(memory.get());
    } else {
      own.resize(n);
      data = own.data();
    }
  }
};

/// all_reduce (sum, avg) and reduce (to every root) of buffers that rank r keeps in group memory
/// when bit r of `in_group` is set, else in ordinary memory, which it passes to
/// all_reduce_coalesced cut in three when bit r of `listed` is set; the digests of the results.
std::string reductions(dpl::process_group const& g, unsigned in_group, unsigned listed = 0) {
  int const r = g.rank();
  bool const mine = ((in_group >> r) & 1u) != 0;
  bool const list = !mine && ((listed >> r) & 1u) != 0;
  std::string out;
  std::uint64_t seed = 0;
  for (std::size_t n : {std::size_t{70}, std::size_t{4099}, std::size_t{40013}}) {
    for (auto op : {dpl::reduce_op::sum, dpl::reduce_op::avg}) {
      for (int root = -1; root < g.size(); ++root) {  // -1: all_reduce
        placed b(g, n, mine);
        test::rng rng{++seed * 7919 + static_cast<std::uint64_t>(r)};
        for (std::size_t i = 0; i < n; ++i) b.data[i] = static_cast<float>(rng.uniform() * 2 - 1);
        dpl::tensor_view<float> const t(b.data, n);
        std::array<dpl::tensor_ref, 3> const parts{dpl::tensor_ref(t).subview(0, n / 5),
                                                   dpl::tensor_ref(t).subview(n / 5, n / 2 - n / 5),
                                                   dpl::tensor_ref(t).subview(n / 2, n - n / 2)};
        if (root < 0 && list) g.all_reduce_coalesced(parts, op).wait();
        else if (root < 0) g.all_reduce(t, op).wait();
        else g.reduce(t, root, op).wait();
        out += digest(b.data, n);
      }
    }
  }
  return out;
}

std::vector<std::string> thread_reference(int world, std::function<std::string(dpl::process_group const&)> const& f) {
  std::vector<std::string> ref(static_cast<std::size_t>(world));
  dpl::spawn(world, [&](dpl::rank_context& rc) { ref[static_cast<std::size_t>(rc.rank())] = f(rc.group()); });
  return ref;
}

/// Whether `p` lies in a mapping of a dparallel shared-memory segment (/proc/self/maps).
bool in_segment_mapping(void const* p) {
  std::ifstream maps("/proc/self/maps");
  auto const at = reinterpret_cast<std::uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    std::uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2) continue;
    if (at >= lo && at < hi) return line.find("/dparallel-") != std::string::npos;
  }
  return false;
}

// --- DDP --------------------------------------------------------------------------------------

/// Five DDP steps of `m` (gradient_as_bucket_view; buckets of about 8 KiB); the parameter hash
/// after each step.
template <class Model>
std::string ddp_run(Model& m, dpl::process_group const& group) {
  int const rank = group.rank();
  int const world = group.size();
  dpl::distributed_data_parallel<Model> ddp(
      m, group, {.bucket_cap_mb = 8192.0 / (1024 * 1024), .first_bucket_cap_mb = 4096.0 / (1024 * 1024),
                 .gradient_as_bucket_view = true});
  std::string out;
  for (int step = 0; step < 5; ++step) {
    auto const data = test::dataset<float>::make(4 * static_cast<std::size_t>(world), m.dim,
                                                 static_cast<std::uint64_t>(step + 5), false);
    auto const first = static_cast<std::size_t>(rank) * 4;
    ddp.step(dpl::slice_batch(data.all(), first, first + 4),
             [](Model& r, test::samples<float> s, dpl::step_context& ctx) { return r.forward_backward(s, &ctx); });
    ddp.module().sgd(0.05f);
    out += std::to_string(test::param_hash(m)) + ",";
  }
  if (!std::all_of(m.w.begin(), m.w.end(), [](float x) { return std::isfinite(x); })) out += "not finite";
  return out;
}

/// ddp_run of the flat model, its gradients in group memory where `in_group`.
std::string ddp_hashes(dpl::process_group const& group, bool in_group) {
  test::flat_model m({1200, 3, 2500, 801}, 11);
  if (in_group) m.place(group.allocate(m.g.size() * sizeof(float)));
  return ddp_run(m, group);
}

/// ddp_run of the same model with bind_gradients (its own gradients apart, with gaps): DDP lays
/// them out; the result says whether they then lie in a shared segment.
std::string ddp_bound_hashes(dpl::process_group const& group) {
  test::bindable_model m({1200, 3, 2500, 801}, 11);
  std::string const hashes = ddp_run(m, group);
  return hashes + (m.binds == 1 && m.laid_out ? "laid out," : "not laid out,") +
         (in_segment_mapping(m.gdata) ? "in the segment" : "elsewhere");
}

}  // namespace

// =================================================================================================

TEST_CASE("shm group memory: blocks are handed out, merged when freed, and known by address", "[shm][memory]") {
  dpl::detail::shm_layout const layout{2, 256, 1024, 64 * 1024};
  auto const name = test_segment_name();
  auto seg = dpl::detail::shm_segment::create(name, layout);
  seg->unlink();
  dpl::detail::shm_arena arena(*seg, layout.arena_at(1), layout.arena);

  std::byte* const a = arena.take(1000);  // 1024 bytes
  std::byte* const b = arena.take(1);     // 256
  std::byte* const c = arena.take(30000);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  REQUIRE(c != nullptr);
  CHECK(a == seg->at(layout.arena_at(1)));  // first fit, from the region's start
  CHECK(b == a + 1024);
  CHECK(c == b + 256);
  CHECK(std::all_of(c, c + 30000, [](std::byte x) { return x == std::byte{0}; }));
  // Known: inside one block; not known: straddling two blocks, outside the region, freed.
  CHECK(arena.offset_of(a, 1000) == layout.arena_at(1));
  CHECK(arena.offset_of(a + 24, 1000) == layout.arena_at(1) + 24);
  CHECK(arena.offset_of(a + 24, 1001) == 0);
  CHECK(arena.offset_of(seg->at(layout.arena_at(0)), 4) == 0);  // rank 0's region
  int on_stack = 0;
  CHECK(arena.offset_of(&on_stack, sizeof on_stack) == 0);
  // No room for more than what is left; freed neighbours merge back into one block.
  CHECK(arena.take(64 * 1024) == nullptr);
  std::memset(b, 0xff, 256);
  arena.give(b);
  CHECK(arena.offset_of(b, 4) == 0);
  std::byte* const b2 = arena.take(200);
  CHECK(b2 == b);
  CHECK(b2[0] == std::byte{0});  // zeroed again
  arena.give(a);
  arena.give(b2);
  std::byte* const after = arena.take(1024 + 256 + 1);  // too large for the 1280-byte hole before c
  CHECK(after == c + 30208);
  arena.give(after);
  std::byte* const ab = arena.take(1280);
  CHECK(ab == a);
  arena.give(ab);
  arena.give(c);
  std::byte* const whole = arena.take(64 * 1024);
  CHECK(whole == a);  // everything merged into the region again
}

TEST_CASE("shm group memory: all_reduce and reduce in place give the thread-rank bits, whoever is in it",
          "[shm][memory]") {
  for (int n : {2, 3}) {
    // Every rank's buffer in group memory (one pass), rank 0's or rank 1's only (chunks, the
    // others copying; rank n - 1 passing a list), none; tiny chunks and default ones.
    for (unsigned in_group : {~0u, 1u, 2u, 0u}) {
      unsigned const listed = in_group == ~0u ? 0u : 1u << (n - 1);
      auto const ref =
          thread_reference(n, [&](dpl::process_group const& g) { return reductions(g, in_group, listed); });
      // Default options (the two smaller sizes meet once or twice, the largest in chunks), every
      // size in chunks, every size in many chunks.
      for (int variant : {0, 1, 2}) {
        dpl::shm::options const opts = variant == 0   ? dpl::shm::options{}
                                       : variant == 1 ? dpl::shm::options{.small_bytes = 256}
                                                      : dpl::shm::options{.small_bytes = 256, .chunk_bytes = 4096};
        std::vector<pid_t> pids;
        auto const got = run_ranks(
            n,
            [&](int rank, dpl::shm::bootstrap_fn const& share) {
              auto const g = dpl::shm::make_group(rank, n, share, 60s, opts);
              return reductions(g, in_group, listed);
            },
            &pids);
        for (int r = 0; r < n; ++r) {
          INFO(n << " processes, in group memory (mask) " << in_group << ", options " << variant << ", rank " << r);
          CHECK(got[static_cast<std::size_t>(r)].exit_code == 0);
          CHECK(got[static_cast<std::size_t>(r)].text == ref[static_cast<std::size_t>(r)]);
        }
        require_no_segments_of(pids);
      }
    }
  }
}

TEST_CASE("shm group memory lies in the segment; past the region it is ordinary memory, and still reduces",
          "[shm][memory]") {
  int const n = 2;
  auto const got = run_ranks(n, [&](int rank, dpl::shm::bootstrap_fn const& share) {
    auto const g = dpl::shm::make_group(rank, n, share, 60s, {.small_bytes = 256, .arena_bytes = 64 * 1024});
    std::string s;
    auto const small = g.allocate(32 * 1024);
    auto const large = g.allocate(1 << 20);  // more than the region: ordinary memory
    s += in_segment_mapping(small.get()) ? "shared," : "private,";
    s += in_segment_mapping(large.get()) ? "shared," : "private,";
    auto* const f = reinterpret_cast<float*>(large.get());
    s += std::all_of(f, f + (1 << 18), [](float x) { return x == 0.0f; }) ? "zeroed," : "dirty,";
    for (std::size_t i = 0; i < (1 << 18); ++i) f[i] = static_cast<float>(i % 7) + static_cast<float>(rank);
    g.all_reduce(dpl::tensor_view<float>(f, 1 << 18)).wait();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < (1 << 18); ++i) wrong += f[i] != 2.0f * static_cast<float>(i % 7) + 1.0f;
    s += std::to_string(wrong);
    return s;
  });
  for (auto const& r : got) {
    CHECK(r.exit_code == 0);
    CHECK(r.text == "shared,private,zeroed,0");
  }
  // Thread ranks share their memory anyway: ordinary memory, zeroed.
  dpl::spawn(2, [&](dpl::rank_context& rc) {
    auto const m = rc.group().allocate(4096);
    bool const zeroed = std::all_of(m.get(), m.get() + 4096, [](std::byte x) { return x == std::byte{0}; });
    if (!zeroed) throw std::runtime_error("thread-rank group memory not zeroed");
  });
}

TEST_CASE("shm: DDP lays out a bind_gradients model's gradients in group memory, bitwise thread ranks",
          "[shm][memory][ddp]") {
  for (int n : {2, 3}) {
    auto const ref = thread_reference(n, [](dpl::process_group const& g) { return ddp_hashes(g, false); });
    std::vector<pid_t> pids;
    auto const got = run_ranks(
        n,
        [&](int rank, dpl::shm::bootstrap_fn const& share) {
          return ddp_bound_hashes(dpl::shm::make_group(rank, n, share, 60s, {.small_bytes = 256}));
        },
        &pids);
    for (int r = 0; r < n; ++r) {
      INFO(n << " processes, rank " << r);
      CHECK(got[static_cast<std::size_t>(r)].exit_code == 0);
      CHECK(got[static_cast<std::size_t>(r)].text == ref[0] + "laid out,in the segment");
    }
    require_no_segments_of(pids);
  }
  // Thread ranks: the block is ordinary memory (they reach each other's anyway), the same bits.
  auto const threads = thread_reference(2, [](dpl::process_group const& g) { return ddp_bound_hashes(g); });
  auto const ref = thread_reference(2, [](dpl::process_group const& g) { return ddp_hashes(g, false); });
  CHECK(threads[0] == ref[0] + "laid out,elsewhere");
  CHECK(threads[1] == ref[0] + "laid out,elsewhere");
}

TEST_CASE("shm: DDP with its gradients in group memory trains bitwise DDP over thread ranks", "[shm][memory][ddp]") {
  for (int n : {2, 3}) {
    auto const ref = thread_reference(n, [](dpl::process_group const& g) { return ddp_hashes(g, false); });
    CHECK(ref[0].find("not finite") == std::string::npos);
    for (unsigned in_group : {~0u, 1u}) {  // every rank's gradients in group memory; rank 0's only
      std::vector<pid_t> pids;
      auto const got = run_ranks(
          n,
          [&](int rank, dpl::shm::bootstrap_fn const& share) {
            auto const g = dpl::shm::make_group(rank, n, share, 60s, {.small_bytes = 256});
            return ddp_hashes(g, ((in_group >> rank) & 1u) != 0);
          },
          &pids);
      for (int r = 0; r < n; ++r) {
        INFO(n << " processes, in group memory (mask) " << in_group << ", rank " << r);
        CHECK(got[static_cast<std::size_t>(r)].exit_code == 0);
        CHECK(got[static_cast<std::size_t>(r)].text == ref[0]);
      }
      require_no_segments_of(pids);
    }
  }
}

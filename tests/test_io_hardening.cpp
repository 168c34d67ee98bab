// Hardening of the safetensors reader, the loaders and atomic writes: what the reference
// implementation accepts, escaped input in messages, bounded header memory, the header cap,
// unchanged models after a failed load, stale temporaries, file modes.
#include "io/child.hpp"
#include "scratch.hpp"

#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace dpl = dparallel;
namespace fs = std::filesystem;

namespace {

fs::path scratch(std::string const& name) { return test::scratch_dir("test_io_hardening", name); }

/// Two named f32 parameters of 4 elements.
struct pair_net {
  std::vector<float> a = std::vector<float>(4), b = std::vector<float>(4), ga = std::vector<float>(4),
                     gb = std::vector<float>(4);
  auto parameters() { return std::array{dpl::view(a), dpl::view(b)}; }
  auto gradients() { return std::array{dpl::view(ga), dpl::view(gb)}; }
  static auto parameter_names() { return std::array{"a", "b"}; }
  void fill(float base) {
    for (std::size_t i = 0; i < 4; ++i) {
      a[i] = base + static_cast<float>(i);
      b[i] = -base - static_cast<float>(i);
    }
  }
};

/// A file: the 8-byte length of `header` (or `length`), the header, then `data`.
void write_raw(fs::path const& p, std::string const& header, std::vector<char> const& data,
               std::uint64_t length = std::numeric_limits<std::uint64_t>::max()) {
  std::uint64_t n = length == std::numeric_limits<std::uint64_t>::max() ? header.size() : length;
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  for (int i = 0; i < 8; ++i, n >>= 8) out.put(static_cast<char>(n & 0xFF));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

std::vector<char> float_bytes(std::vector<float> const& v) {
  std::vector<char> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::string message_of(auto&& f) {
  try {
    f();
  } catch (std::exception const& e) {
    return e.what();
  }
  return "(no exception)";
}

bool has_raw_control(std::string const& s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) return true;
  return false;
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool sanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
constexpr bool sanitized = true;
#else
constexpr bool sanitized = false;
#endif
#else
constexpr bool sanitized = false;
#endif

/// This process's virtual memory size in bytes (Linux /proc).
std::uint64_t address_space() {
  std::ifstream statm("/proc/self/statm");
  std::uint64_t pages = 0;
  statm >> pages;
  return pages * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

}  // namespace

TEST_CASE("hardening: the header cap is the reference's 100,000,000 bytes", "[io][safetensors]") {
  auto const dir = scratch("cap");
  write_raw(dir / "x.safetensors", "{}", {}, 100'000'001);
  CHECK_THROWS_WITH(dpl::safetensors_reader(dir / "x.safetensors"),
                    Catch::Contains("says 100000001 bytes, more than the 100000000"));
  CHECK(dpl::max_safetensors_header == 100'000'000u);
}

TEST_CASE("hardening: what the reference reads is read: null metadata, leading whitespace, other dtypes",
          "[io][safetensors]") {
  auto const dir = scratch("interop");
  std::vector<float> const a{1, 2, 3, 4}, b{5, 6, 7, 8};
  std::vector<char> data = float_bytes(a);
  auto const bdata = float_bytes(b);
  data.insert(data.end(), bdata.begin(), bdata.end());
  std::string const tensors =
      R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2,2],"data_offsets":[16,32]})";
  write_raw(dir / "null_meta.safetensors", R"({"__metadata__": null, )" + tensors + "}", data);
  write_raw(dir / "space.safetensors", " \n\t{" + tensors + "}", data);
  for (char const* name : {"null_meta.safetensors", "space.safetensors"}) {
    INFO(name);
    dpl::safetensors_reader const r(dir / name);
    CHECK(r.read_vector<float>("a") == a);
    CHECK(r.read_vector<float>("b") == b);
  }

  // A BOOL and a U16 tensor beside the model's: a non-strict load reads the rest and says so.
  data.insert(data.end(), {1, 0, 1, 9, 9});
  write_raw(dir / "mixed.safetensors",
            "{" + tensors +
                R"(,"mask":{"dtype":"BOOL","shape":[3],"data_offsets":[32,35]},"q":{"dtype":"U16","shape":[1],"data_offsets":[35,37]}})",
            data);
  pair_net m;
  m.fill(100);
  auto const before_a = m.a;
  std::string const strict = message_of([&] { dpl::load_state_dict(dir / "mixed.safetensors", m); });
  CHECK_THAT(strict, Catch::Contains("of a dtype dparallel does not handle") && Catch::Contains("mask, q"));
  CHECK(m.a == before_a);
  auto const r = dpl::load_state_dict(dir / "mixed.safetensors", m, {.strict = false});
  CHECK(m.a == a);
  CHECK(m.b == b);
  CHECK(r.skipped == std::vector<std::string>{"mask", "q"});
  CHECK(r.unexpected.empty());
  dpl::safetensors_reader const file(dir / "mixed.safetensors");
  REQUIRE(file.unsupported().size() == 2);
  CHECK(file.unsupported()[0].dtype == "BOOL");
  // A dtype that is no safetensors dtype stays an error; so do duplicate names.
  write_raw(dir / "bad.safetensors", R"({"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", float_bytes({1}));
  CHECK_THROWS_WITH(dpl::safetensors_reader(dir / "bad.safetensors"), Catch::Contains("not a safetensors dtype"));
  write_raw(dir / "dup.safetensors",
            R"({"a":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]},"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
            float_bytes({1, 2}));
  CHECK_THROWS_WITH(dpl::safetensors_reader(dir / "dup.safetensors"), Catch::Contains("duplicate key \"a\""));
}

TEST_CASE("hardening: input quoted in messages has its control characters escaped", "[io][safetensors]") {
  auto const dir = scratch("escape");
  std::string const evil = "x\x1b[2J\a\nFAKE LOG LINE";
  std::string header = "{";
  dpl::detail::json::write_string(header, evil);
  header += R"(:{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  write_raw(dir / "evil.safetensors", header, float_bytes({1}));
  pair_net m;
  std::string const msg = message_of([&] { dpl::load_state_dict(dir / "evil.safetensors", m); });
  CHECK_THAT(msg, Catch::Contains("x\\x1b[2J\\x07\\nFAKE LOG LINE"));
  CHECK_FALSE(has_raw_control(msg));
  // In the reader's own messages too: a wrong dtype written with escapes.
  write_raw(dir / "evil2.safetensors", R"({"a":{"dtype":"F\u001b32","shape":[1],"data_offsets":[0,4]}})",
            float_bytes({1}));
  std::string const msg2 = message_of([&] { dpl::safetensors_reader r(dir / "evil2.safetensors"); });
  CHECK_THAT(msg2, Catch::Contains("F\\x1b32"));
  CHECK_FALSE(has_raw_control(msg2));
}

TEST_CASE("hardening: a shape element that is an array is named as one", "[io][safetensors]") {
  auto const dir = scratch("shape");
  write_raw(dir / "s.safetensors", R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", float_bytes({1, 2}));
  CHECK_THROWS_WITH(dpl::safetensors_reader(dir / "s.safetensors"),
                    Catch::Contains("to hold non-negative integers, found an array"));
}

TEST_CASE("hardening: a big header costs a small multiple of its size; no memory is a dparallel::error",
          "[io][safetensors][memory]") {
  if (sanitized) {
    WARN("skipped under a sanitizer: its runtime reserves address space, so RLIMIT_AS cannot bound the reader");
    return;
  }
  auto const dir = scratch("memory");
  // 24 MB of header: one tensor with an unknown key holding 12 million numbers ("0,").
  std::size_t const values = 12'000'000;
  std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":[)";
  header.reserve(header.size() + 2 * values + 8);
  for (std::size_t i = 0; i < values; ++i) header += i == 0 ? "0" : ",0";
  header += "]}}";
  write_raw(dir / "big.safetensors", header, float_bytes({3}));
  std::uint64_t const header_size = header.size();
  header = std::string();
  header.shrink_to_fit();
  // Each child limits its address space to what it uses now plus a budget, then reads the file.
  auto child_reads = [&](std::uint64_t budget) {
    return test::in_child([&] {
      rlimit lim{};
      lim.rlim_cur = lim.rlim_max = static_cast<rlim_t>(address_space() + budget);
      ::setrlimit(RLIMIT_AS, &lim);
      return test::outcome(
          [&] {
            dpl::safetensors_reader const r(dir / "big.safetensors");
            if (r.read_vector<float>("a") != std::vector<float>{3}) throw std::logic_error("wrong value");
          },
          "not enough memory");
    });
  };
  // Twice the header size plus 64 MiB of slack is enough (a tree of its 12 million values is not).
  CHECK(child_reads(2 * header_size + (64u << 20)) == 0);
  // Less than the header itself: the documented error, not std::bad_alloc.
  CHECK(child_reads(header_size / 2) == 1);
}

TEST_CASE("hardening: a file truncated during a load leaves the model unchanged", "[io][state_dict]") {
  auto const dir = scratch("truncated");
  fs::path const p = dir / "m.safetensors";
  pair_net src;
  src.fill(1);
  dpl::save_state_dict(p, src);
  pair_net m;
  m.fill(50);
  auto const a0 = m.a, b0 = m.b;
  dpl::safetensors_reader const file(p);  // opened (header validated), then the file shrinks
  fs::resize_file(p, fs::file_size(p) - 8);
  CHECK_THROWS_AS(dpl::detail::load_named(file, dpl::state_dict(m), {}, {}, "model"), dpl::error);
  CHECK(m.a == a0);
  CHECK(m.b == b0);

  // Rewritten in place with another header of the same size: an error, nothing loaded.
  dpl::save_state_dict(p, src, {{"k", "1"}});
  dpl::safetensors_reader const file2(p);
  pair_net other;
  other.fill(2);
  {
    auto const tmp = dir / "other.safetensors";
    dpl::save_state_dict(tmp, other, {{"k", "2"}});
    std::ifstream in(tmp, std::ios::binary);
    std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    std::fstream out(p, std::ios::binary | std::ios::in | std::ios::out);  // same inode, no truncation
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  CHECK_THROWS_WITH(dpl::detail::load_named(file2, dpl::state_dict(m), {}, {}, "model"),
                    Catch::Contains("changed while it was read"));
  CHECK(m.a == a0);
  CHECK(m.b == b0);
  // Rewritten in place with the same header and other data: the header and the size are as they
  // were, the file's modification time is not. (Past a clock tick: the times' granularity.)
  dpl::save_state_dict(p, src);
  dpl::safetensors_reader const file3(p);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  {
    auto const tmp = dir / "other.safetensors";
    dpl::save_state_dict(tmp, other);  // the same names, dtypes and shapes: the same header
    std::ifstream in(tmp, std::ios::binary);
    std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    REQUIRE(bytes.size() == fs::file_size(p));
    std::fstream out(p, std::ios::binary | std::ios::in | std::ios::out);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  CHECK_THROWS_WITH(dpl::detail::load_named(file3, dpl::state_dict(m), {}, {}, "model"),
                    Catch::Contains("changed while it was read") && Catch::Contains("written in place"));
  CHECK(m.a == a0);
  CHECK(m.b == b0);
  // A file replaced by a rename is another file: the open reader reads the one it opened.
  dpl::save_state_dict(p, src);
  dpl::safetensors_reader const file4(p);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  dpl::save_state_dict(p, other);
  dpl::detail::load_named(file4, dpl::state_dict(m), {}, {}, "model");
  pair_net want;
  want.fill(1);
  CHECK(m.a == want.a);
}

TEST_CASE("hardening: a save removes the temporaries a killed writer left, and only those", "[io][atomic]") {
  auto const dir = scratch("stale");
  fs::path const target = dir / "m.safetensors";
  pair_net m;
  dpl::save_state_dict(target, m);
  // A process that is gone: a child that exited and was reaped.
  pid_t const gone = ::fork();
  REQUIRE(gone >= 0);
  if (gone == 0) ::_exit(0);
  REQUIRE(::waitpid(gone, nullptr, 0) == gone);
  std::string const prefix = dpl::detail::temporary_prefix(target);
  std::string const dead = prefix + std::to_string(gone) + "-0";
  std::string const live = prefix + std::to_string(::getppid()) + "-0";  // a process that exists
  std::string const other_target = dpl::detail::temporary_prefix(dir / "n.safetensors") + std::to_string(gone) + "-1";
  std::string const other_host = ".m.safetensors.tmp-elsewhere.example-" + std::to_string(gone) + "-0";
  for (auto const& n : {dead, live, other_target, other_host}) std::ofstream(dir / n) << std::string(1000, 'x');
  dpl::save_state_dict(target, m);
  std::set<std::string> names;
  for (auto const& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  CHECK(names == std::set<std::string>{"m.safetensors", live, other_target, other_host});
}

TEST_CASE("hardening: a save keeps the file's mode; a new file follows the umask", "[io][atomic]") {
  auto const dir = scratch("mode");
  fs::path const target = dir / "m.safetensors";
  pair_net m;
  mode_t const old_mask = ::umask(027);
  dpl::save_state_dict(target, m);
  struct ::stat st {};
  REQUIRE(::stat(target.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0640);
  ::umask(022);
  REQUIRE(::chmod(target.c_str(), 0600) == 0);
  dpl::save_state_dict(target, m);
  REQUIRE(::stat(target.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(::chmod(target.c_str(), 0664) == 0);
  dpl::save_state_dict(target, m);
  REQUIRE(::stat(target.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0664);
  CHECK(st.st_uid == ::geteuid());
  ::umask(old_mask);
}

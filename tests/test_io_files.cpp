// The safetensors files themselves: malformed files (hand-made) are clear errors, mutated files
// (fuzzed) load or throw dparallel::error, and a save that fails leaves the previous file and no
// temporary one.
#include "io/child.hpp"
#include "io/named_net.hpp"
#include "models.hpp"
#include "scratch.hpp"

#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/resource.h>

namespace dpl = dparallel;
namespace fs = std::filesystem;

namespace {

using test::bytes_of;
using test::listing;
using test::named_net;
using test::tensor_bytes;
using test::write_bytes;

fs::path scratch(std::string const& name) { return test::scratch_dir("test_io_files", name); }

/// A safetensors file from raw parts: the length field (default: the header's size), the header
/// text and the data section.
std::vector<char> raw_file(std::string const& header, std::size_t data_bytes,
                           std::uint64_t length = std::numeric_limits<std::uint64_t>::max(), bool use_length = false) {
  std::uint64_t n = use_length ? length : header.size();
  std::vector<char> out;
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<char>(n & 0xFF));
    n >>= 8;
  }
  out.insert(out.end(), header.begin(), header.end());
  for (std::size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<char>(i * 7));
  return out;
}

/// Opens a file and reads every tensor in it: what any consumer of a file does.
void read_everything(fs::path const& p) {
  dpl::safetensors_reader const file(p);
  for (auto const& t : file.tensors()) {
    std::vector<unsigned char> storage(static_cast<std::size_t>(t.size_bytes()) + 1);
    file.read(t, dpl::tensor_ref(storage.data(), static_cast<std::size_t>(t.elements()), t.type));
  }
}

}  // namespace

TEST_CASE("malformed files are clear errors", "[io][safetensors]") {
  auto const dir = scratch("malformed");
  std::string const ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct bad_case {
    char const* what;
    std::vector<char> bytes;
    char const* message;
  };
  std::vector<bad_case> const cases = {
      {"empty file", {}, "fewer than the 8-byte header length"},
      {"5 bytes", {1, 0, 0, 0, 0}, "fewer than the 8-byte header length"},
      {"header length beyond the file", raw_file(ok, 8, 1000, true), "follow it (the file is truncated?)"},
      {"header length above the cap", raw_file(ok, 8, 1ull << 40, true), "more than the 100000000"},
      {"header length 2^64-1", raw_file(ok, 8, std::numeric_limits<std::uint64_t>::max(), true), "more than the"},
      {"truncated data", raw_file(ok, 5), "outside the data section of 5 bytes"},
      {"not an object", raw_file("[1,2]", 0), "start with '{'"},
      {"invalid JSON", raw_file(R"({"a":{"dtype":"F32",)", 8), "invalid JSON"},
      {"trailing garbage", raw_file(ok + "x", 8), "unexpected text after the end"},
      {"unknown dtype", raw_file(R"({"a":{"dtype":"X16","shape":[2],"data_offsets":[0,4]}})", 4), "'X16', which is not a safetensors dtype"},
      {"offsets past the end", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 8),
       "outside the data section"},
      {"offsets reversed", raw_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
       "end before they begin"},
      {"size disagrees with shape", raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "(12 bytes) but data_offsets [0, 8] (8 bytes)"},
      {"overlap",
       raw_file(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           8),
       "overlaps tensor 'a'"},
      {"hole",
       raw_file(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
           12),
       "bytes 4 to 8 of the data section belong to no tensor"},
      {"uncovered tail", raw_file(ok, 12), "the data section has 12 bytes but its tensors cover 8"},
      {"duplicate name",
       raw_file(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           8),
       "duplicate key \"a\""},
      {"negative dimension", raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
       "non-negative integers, found '-2'"},
      {"fractional dimension", raw_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
       "non-negative integers, found '2.0'"},
      {"shape overflow",
       raw_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "more elements than 2^64"},
      {"offset overflow", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}})", 8),
       "two non-negative integers"},
      {"missing offsets", raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "no \"data_offsets\""},
      {"metadata not strings", raw_file(R"({"__metadata__":{"k":1}})", 0), "to be a string"},
      {"invalid UTF-8", raw_file("{\"a\xC0\xAF\":{}}", 0), "not valid UTF-8"},
      {"lone surrogate", raw_file(R"({"\udc00":{}})", 0), "lone low surrogate"},
      // The header's object, the tensor's and 126 arrays: 128 containers, one more than the
      // reference reader (serde_json) takes.
      {"deep nesting",
       raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":)" + std::string(126, '[') +
                    std::string(126, ']') + "}}",
                8),
       "nesting deeper than 127"},
  };
  for (auto const& c : cases) {
    INFO(c.what);
    fs::path const p = dir / "bad.safetensors";
    write_bytes(p, c.bytes);
    CHECK_THROWS_AS(read_everything(p), dpl::error);
    CHECK_THROWS_WITH(read_everything(p), Catch::Contains(c.message) && Catch::Contains("bad.safetensors"));
  }
  // The well-formed base case reads, with unknown keys ignored and trailing spaces allowed.
  write_bytes(dir / "good.safetensors",
              raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":[1,{"b":null}]}}   )", 8));
  CHECK_NOTHROW(read_everything(dir / "good.safetensors"));
  // An unknown key holding 125 nested arrays (127 containers with the header's and the tensor's
  // objects, the most the reference reader takes) reads too.
  write_bytes(dir / "deep.safetensors",
              raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":)" + std::string(125, '[') + "1" +
                           std::string(125, ']') + "}}",
                       8));
  CHECK_NOTHROW(read_everything(dir / "deep.safetensors"));
  CHECK_THROWS_WITH(dpl::safetensors_reader(dir / "absent.safetensors"), Catch::Contains("could not open"));
}

TEST_CASE("fuzz: every mutated file loads or throws dparallel::error", "[io][safetensors][fuzz]") {
  auto const dir = scratch("fuzz");
  named_net src;
  src.fill(10);
  dpl::save_state_dict(dir / "state.safetensors", src, {{"k", "v"}});
  std::vector<float> mom(12);
  dpl::checkpoint ck(src);
  ck.add("momentum.0", dpl::view(mom));
  ck.progress() = {.epoch = 2, .step = 30, .sampler = {2, 8}, .seed = 7, .extra = {{"lr", "0.1"}}};
  ck.save(dir / "ckpt.safetensors");
  std::vector<std::vector<char>> const bases = {bytes_of(dir / "state.safetensors"),
                                                bytes_of(dir / "ckpt.safetensors")};

  test::rng g{20240607};
  std::string const json_chars = "{}[]\":,0123456789-.eE \\ufFI";
  int loaded = 0, rejected = 0, other = 0;
  std::string first_other;
  fs::path const p = dir / "mutant.safetensors";
  for (int i = 0; i < 4000; ++i) {
    std::size_t const which = static_cast<std::size_t>(i) % bases.size();
    std::vector<char> f = bases[which];
    std::uint64_t header = 0;
    for (int k = 7; k >= 0; --k) header = (header << 8) | static_cast<unsigned char>(f[static_cast<std::size_t>(k)]);
    std::size_t const header_end = static_cast<std::size_t>(8 + header);
    auto pick = [&](std::size_t n) { return static_cast<std::size_t>(g.next() % n); };
    switch (g.next() % 6) {
      case 0:  // bit flips anywhere, or only in the data section (values change; the file stays valid)
        if (g.next() % 2 != 0)
          for (std::size_t k = 1 + pick(8); k-- > 0;) f[pick(f.size())] ^= static_cast<char>(1u << pick(8));
        else
          for (std::size_t k = 1 + pick(8); k-- > 0;)
            f[header_end + pick(f.size() - header_end)] ^= static_cast<char>(1u << pick(8));
        break;
      case 1:  // bit flips in the length field and header
        for (std::size_t k = 1 + pick(4); k-- > 0;) f[pick(header_end)] ^= static_cast<char>(1u << pick(8));
        break;
      case 2:  // truncation
        f.resize(pick(f.size()));
        break;
      case 3:  // JSON-ish bytes written over the header
        for (std::size_t k = 1 + pick(6); k-- > 0;) f[8 + pick(header_end - 8)] = json_chars[pick(json_chars.size())];
        break;
      case 4: {  // a new length field, near the old one or anywhere
        std::uint64_t n = g.next() % 2 != 0 ? header + pick(17) - 8 : g.next() >> pick(64);
        for (int k = 0; k < 8; ++k, n >>= 8) f[static_cast<std::size_t>(k)] = static_cast<char>(n & 0xFF);
        break;
      }
      default: {  // a run of header bytes deleted or duplicated, the length field kept
        std::size_t const at = 8 + pick(header_end - 8), len = 1 + pick(12);
        std::size_t const end = std::min(at + len, f.size());
        if (g.next() % 2 != 0)
          f.erase(f.begin() + static_cast<std::ptrdiff_t>(at), f.begin() + static_cast<std::ptrdiff_t>(end));
        else {
          std::vector<char> const run(f.begin() + static_cast<std::ptrdiff_t>(at),
                                      f.begin() + static_cast<std::ptrdiff_t>(end));
          f.insert(f.begin() + static_cast<std::ptrdiff_t>(at), run.begin(), run.end());
        }
      }
    }
    write_bytes(p, f);
    try {
      read_everything(p);
      named_net target;
      if (which == 0) {
        dpl::load_state_dict(p, target, {.strict = false});
      } else {
        std::vector<float> m2(12);
        dpl::checkpoint c(target);
        c.add("momentum.0", dpl::view(m2));
        c.load(p, {.strict = false});
      }
      ++loaded;
    } catch (dpl::error const&) {
      ++rejected;
    } catch (std::exception const& e) {
      if (other++ == 0) first_other = "case " + std::to_string(i) + ": " + e.what();
    } catch (...) {
      if (other++ == 0) first_other = "case " + std::to_string(i) + ": a non-standard exception";
    }
  }
  INFO("loaded " << loaded << ", rejected " << rejected << "; first other exception: " << first_other);
  CHECK(other == 0);
  CHECK(loaded + rejected == 4000);
  CHECK(loaded > 300);    // the mutations reach the success path (flipped data bits) ...
  CHECK(rejected > 1000);  // ... and the validation
}

TEST_CASE("a failed save leaves the previous file and no temporary file", "[io][atomic]") {
  auto const dir = scratch("atomic");
  fs::path const target = dir / "model.safetensors";
  named_net a;
  a.fill(11);
  dpl::save_state_dict(target, a);
  auto const before = bytes_of(target);
  REQUIRE(listing(dir) == std::set<std::string>{"model.safetensors"});

  SECTION("the writer throws half-way") {
    CHECK_THROWS_WITH(dpl::detail::write_file_atomically(target,
                                                         [](dpl::detail::file_sink& out) {
                                                           std::vector<char> junk(100000, 'x');
                                                           out.write(junk.data(), junk.size());
                                                           throw std::runtime_error("injected failure");
                                                         }),
                      "injected failure");
  }
  SECTION("the disk fills up (RLIMIT_FSIZE) during a real save") {
    test::linreg<float> big(200000, 1);  // 800 KB of parameters
    int const code = test::in_child([&] {
      ::signal(SIGXFSZ, SIG_IGN);
      rlimit lim{};
      lim.rlim_cur = lim.rlim_max = 64 * 1024;
      ::setrlimit(RLIMIT_FSIZE, &lim);
      return test::outcome([&] { dpl::save_state_dict(target, big); }, "could not write");
    });
    CHECK(code == 1);  // the documented error
  }
  SECTION("the target is a directory, so the rename fails") {
    fs::create_directory(dir / "taken");
    fs::path const d = dir / "taken";
    std::ofstream(d / "inside") << "x";
    CHECK_THROWS_WITH(dpl::save_state_dict(d, a), Catch::Contains("could not rename"));
    fs::remove_all(d);
  }
  SECTION("the directory does not exist") {
    CHECK_THROWS_WITH(dpl::save_state_dict(dir / "absent" / "m.safetensors", a),
                      Catch::Contains("could not create a temporary file") && Catch::Contains("absent"));
  }
  CHECK(bytes_of(target) == before);
  CHECK(listing(dir) == std::set<std::string>{"model.safetensors"});

  // And a successful save replaces the file.
  named_net b;
  b.fill(12);
  dpl::save_state_dict(target, b);
  named_net back;
  dpl::load_state_dict(target, back);
  CHECK(tensor_bytes(back) == tensor_bytes(b));
  CHECK(listing(dir) == std::set<std::string>{"model.safetensors"});
}

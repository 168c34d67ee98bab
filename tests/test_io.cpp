// State dicts in safetensors: round trips, names, wrappers, strict loading, malformed files
// (hand-made and fuzzed), atomic writes.
#include "io/child.hpp"
#include "models.hpp"
#include "scratch.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace dpl = dparallel;
namespace fs = std::filesystem;

namespace {

/// A model with named, shaped tensors of every host dtype: f32 and f64 parameters; i64, u8,
/// f16 (raw bits) and i32 buffers.
struct named_net {
  std::vector<float> w = std::vector<float>(12), b = std::vector<float>(3);
  std::vector<double> scale = std::vector<double>(2);
  std::vector<float> gw = std::vector<float>(12), gb = std::vector<float>(3);
  std::vector<double> gscale = std::vector<double>(2);
  std::vector<std::int64_t> steps = std::vector<std::int64_t>(1);
  std::vector<std::uint8_t> mask = std::vector<std::uint8_t>(5);
  std::vector<std::uint16_t> half = std::vector<std::uint16_t>(4);
  std::vector<std::int32_t> ids = std::vector<std::int32_t>(3);

  std::vector<dpl::tensor_ref> parameters() { return {dpl::view(w), dpl::view(b), dpl::view(scale)}; }
  std::vector<dpl::tensor_ref> gradients() { return {dpl::view(gw), dpl::view(gb), dpl::view(gscale)}; }
  std::vector<dpl::tensor_ref> buffers() {
    return {dpl::view(steps), dpl::view(mask), dpl::tensor_ref(half.data(), half.size(), dpl::dtype::f16),
            dpl::view(ids)};
  }
  static auto parameter_names() { return std::array{"encoder.fc.weight", "encoder.fc.bias", "scale"}; }
  static auto buffer_names() { return std::array{"steps", "mask", "half", "ids"}; }
  static auto parameter_shapes() { return std::vector<std::vector<int>>{{3, 4}, {3}, {2}}; }

  /// Distinct contents per seed, with bit patterns a value copy could lose (-0, NaN payloads, inf).
  void fill(std::uint64_t seed) {
    test::rng g{seed};
    for (auto& v : w) v = static_cast<float>(g.uniform() * 4 - 2);
    for (auto& v : b) v = static_cast<float>(g.uniform());
    scale = {g.uniform(), -0.0};
    std::uint32_t nan_bits = 0x7FC01234u + static_cast<std::uint32_t>(seed);
    std::memcpy(&w[5], &nan_bits, 4);
    w[6] = -std::numeric_limits<float>::infinity();
    b[1] = -0.0f;
    steps[0] = static_cast<std::int64_t>(g.next() >> 1);
    for (auto& v : mask) v = static_cast<std::uint8_t>(g.next());
    for (auto& v : half) v = static_cast<std::uint16_t>(g.next());
    for (auto& v : ids) v = static_cast<std::int32_t>(g.next());
  }
};

/// The same kind of model adapted through model_traits (names from outside the type).
struct foreign_net {
  std::vector<float> a = std::vector<float>(2), c = std::vector<float>(3), ga = std::vector<float>(2),
                     gc = std::vector<float>(3);
};

/// A model that itself names a tensor "module.<something>".
struct module_named_net {
  std::vector<float> a = std::vector<float>(2), c = std::vector<float>(1), ga = std::vector<float>(2),
                     gc = std::vector<float>(1);
  auto parameters() { return std::array{dpl::view(a), dpl::view(c)}; }
  auto gradients() { return std::array{dpl::view(ga), dpl::view(gc)}; }
  static auto parameter_names() { return std::array{"module.weight", "bias"}; }
};

/// A model whose name list does not match its parameters.
struct miscounted_net {
  std::vector<float> a = std::vector<float>(2), ga = std::vector<float>(2);
  auto parameters() { return std::array{dpl::view(a)}; }
  auto gradients() { return std::array{dpl::view(ga)}; }
  static auto parameter_names() { return std::array{"a", "b"}; }
};

/// A model whose parameters and buffers share a name.
struct clashing_net {
  std::vector<float> a = std::vector<float>(2), ga = std::vector<float>(2), s = std::vector<float>(1);
  auto parameters() { return std::array{dpl::view(a)}; }
  auto gradients() { return std::array{dpl::view(ga)}; }
  auto buffers() { return std::array{dpl::view(s)}; }
  static auto parameter_names() { return std::array{"x"}; }
  static auto buffer_names() { return std::array{"x"}; }
};

}  // namespace

template <>
struct dparallel::model_traits<foreign_net> {
  static auto parameters(foreign_net& m) { return std::array{dpl::view(m.a), dpl::view(m.c)}; }
  static auto gradients(foreign_net& m) { return std::array{dpl::view(m.ga), dpl::view(m.gc)}; }
  static std::vector<std::string> parameter_names(foreign_net&) { return {"layer.a", "layer.c"}; }
  static std::vector<std::vector<std::size_t>> parameter_shapes(foreign_net&) { return {{1, 2}, {3, 1}}; }
};

namespace {

fs::path scratch(std::string const& name) { return test::scratch_dir("test_io", name); }

std::vector<char> bytes_of(fs::path const& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(fs::path const& p, std::vector<char> const& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::set<std::string> listing(fs::path const& dir) {
  std::set<std::string> out;
  for (auto const& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

/// The bytes of every tensor of a model's state dict, in order.
template <class M>
std::vector<std::vector<char>> tensor_bytes(M& m) {
  std::vector<std::vector<char>> out;
  for (auto const& t : dpl::state_dict(m)) {
    auto const* p = static_cast<char const*>(t.data.data());
    out.emplace_back(p, p + t.data.size_bytes());
  }
  return out;
}

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

TEST_CASE("state dict round trip is bitwise, with names, dtypes and shapes", "[io][state_dict]") {
  auto const dir = scratch("round_trip");
  named_net a;
  a.fill(1);
  dpl::save_state_dict(dir / "net.safetensors", a, {{"note", "héllo \"quoted\"\n"}});

  dpl::safetensors_reader const file(dir / "net.safetensors");
  std::vector<std::string> names;
  std::vector<dpl::dtype> types;
  std::vector<std::vector<std::uint64_t>> shapes;
  for (auto const& t : file.tensors()) {
    names.push_back(t.name);
    types.push_back(t.type);
    shapes.push_back(t.shape);
  }
  CHECK(names ==
        std::vector<std::string>{"encoder.fc.weight", "encoder.fc.bias", "scale", "steps", "mask", "half", "ids"});
  CHECK(types == std::vector<dpl::dtype>{dpl::dtype::f32, dpl::dtype::f32, dpl::dtype::f64, dpl::dtype::i64,
                                         dpl::dtype::u8, dpl::dtype::f16, dpl::dtype::i32});
  CHECK(shapes == std::vector<std::vector<std::uint64_t>>{{3, 4}, {3}, {2}, {1}, {5}, {4}, {3}});
  CHECK(file.metadata() == dpl::safetensors_metadata{{"format", "pt"}, {"note", "héllo \"quoted\"\n"}});
  CHECK(file.data_offset() % 8 == 0);  // the header is padded so the data is 8-byte aligned
  CHECK(file.read_vector<double>("scale") == a.scale);

  named_net b;
  b.fill(2);
  REQUIRE(tensor_bytes(b) != tensor_bytes(a));
  auto const r = dpl::load_state_dict(dir / "net.safetensors", b);
  CHECK(r.missing.empty());
  CHECK(r.unexpected.empty());
  CHECK(tensor_bytes(b) == tensor_bytes(a));  // NaN payload, -0 and inf included
}

TEST_CASE("without names a model's tensors are param.N and buffer.N, shaped [size]", "[io][state_dict]") {
  auto const dir = scratch("default_names");
  test::linreg<float> m(5, 3);
  CHECK(dpl::parameter_names(m) == std::vector<std::string>{"param.0", "param.1"});
  CHECK(dpl::buffer_names(m) == std::vector<std::string>{"buffer.0"});
  dpl::save_state_dict(dir / "m.safetensors", m);
  dpl::safetensors_reader const file(dir / "m.safetensors");
  REQUIRE(file.tensors().size() == 3);
  CHECK(file.tensors()[0].name == "param.0");
  CHECK(file.tensors()[0].shape == std::vector<std::uint64_t>{5});
  CHECK(file.tensors()[1].name == "param.1");
  CHECK(file.tensors()[2].name == "buffer.0");
  CHECK(file.read_vector<float>("param.0") == m.w);
}

TEST_CASE("names and shapes come from model_traits for types the user cannot edit", "[io][state_dict]") {
  auto const dir = scratch("traits_names");
  foreign_net m;
  m.a = {1, 2};
  m.c = {3, 4, 5};
  dpl::save_state_dict(dir / "f.safetensors", m);
  dpl::safetensors_reader const file(dir / "f.safetensors");
  REQUIRE(file.tensors().size() == 2);
  CHECK(file.tensors()[0].name == "layer.a");
  CHECK(file.tensors()[0].shape == std::vector<std::uint64_t>{1, 2});
  CHECK(file.tensors()[1].name == "layer.c");
  CHECK(file.tensors()[1].shape == std::vector<std::uint64_t>{3, 1});
  foreign_net back;
  dpl::load_state_dict(dir / "f.safetensors", back);
  CHECK(back.c == m.c);
}

TEST_CASE("bad names are rejected before anything is written", "[io][state_dict]") {
  auto const dir = scratch("bad_names");
  miscounted_net mc;
  CHECK_THROWS_WITH(dpl::save_state_dict(dir / "x.safetensors", mc),
                    Catch::Contains("2 parameter names for 1 parameters"));
  clashing_net cl;
  CHECK_THROWS_WITH(dpl::save_state_dict(dir / "x.safetensors", cl), Catch::Contains("'x' twice"));
  std::vector<float> v(3);
  CHECK_THROWS_WITH(dpl::save_safetensors(dir / "x.safetensors", {{"a", dpl::view(v)}, {"a", dpl::view(v)}}),
                    Catch::Contains("unique tensor names"));
  CHECK_THROWS_WITH(dpl::save_safetensors(dir / "x.safetensors", {{"__metadata__", dpl::view(v)}}),
                    Catch::Contains("reserved"));
  CHECK_THROWS_WITH(dpl::save_safetensors(dir / "x.safetensors", {{"a", dpl::view(v), {{2, 2}}}}),
                    Catch::Contains("does not hold its 3 elements"));
  dpl::tensor_ref on_gpu(v.data(), v.size(), dpl::dtype::f32, dpl::device{dpl::device_kind::cuda, 0});
  CHECK_THROWS_WITH(dpl::save_safetensors(dir / "x.safetensors", {{"a", on_gpu}}), Catch::Contains("cuda:0"));
  CHECK_THROWS_WITH(dpl::save_safetensors(dir / "x.safetensors", {{"bad\xff", dpl::view(v)}}),
                    Catch::Contains("UTF-8"));
  CHECK(listing(dir).empty());
}

TEST_CASE("a DP wrapper saves its module under plain names and loads either form", "[io][state_dict][dp]") {
  auto const dir = scratch("dp_wrapper");
  named_net m;
  m.fill(3);
  dpl::data_parallel<named_net> dp(m, dpl::host::devices(2));
  dpl::save_state_dict(dir / "wrapped.safetensors", dp);
  dpl::save_state_dict(dir / "plain.safetensors", m);
  // Same bytes as saving the model itself: no "module." anywhere.
  CHECK(bytes_of(dir / "wrapped.safetensors") == bytes_of(dir / "plain.safetensors"));

  named_net other;
  other.fill(4);
  dpl::data_parallel<named_net> dp2(other, dpl::host::devices(3));
  dpl::load_state_dict(dir / "wrapped.safetensors", dp2);
  CHECK(tensor_bytes(dp2.module()) == tensor_bytes(m));

  // A file from a wrapped PyTorch model: every name starts with "module.".
  auto prefixed = dpl::state_dict(m);
  for (auto& t : prefixed) t.name = "module." + t.name;
  dpl::save_safetensors(dir / "prefixed.safetensors", prefixed);
  named_net third;
  third.fill(5);
  dpl::load_state_dict(dir / "prefixed.safetensors", third);
  CHECK(tensor_bytes(third) == tensor_bytes(m));

  // A model whose own names start with "module." loads its own files and wrapped ones.
  module_named_net own;
  own.a = {1, 2};
  own.c = {3};
  dpl::save_state_dict(dir / "own.safetensors", own);
  auto own_prefixed = dpl::state_dict(own);
  for (auto& t : own_prefixed) t.name = "module." + t.name;
  dpl::save_safetensors(dir / "own_prefixed.safetensors", own_prefixed);
  for (char const* f : {"own.safetensors", "own_prefixed.safetensors"}) {
    INFO(f);
    module_named_net back;
    dpl::load_state_dict(dir / f, back);
    CHECK(back.a == own.a);
    CHECK(back.c == own.c);
  }

  // Both spellings of one name in a file is ambiguous.
  auto both = dpl::state_dict(m);
  both.push_back({"module.scale", dpl::view(m.scale)});
  dpl::save_safetensors(dir / "both.safetensors", both);
  CHECK_THROWS_WITH(dpl::load_state_dict(dir / "both.safetensors", third), Catch::Contains("'scale' twice"));
}

TEST_CASE("DDP: rank 0 saves plain names, every rank loads", "[io][state_dict][ddp]") {
  auto const dir = scratch("ddp_wrapper");
  using model = test::chunked<float>;
  std::vector<float> saved_stats;
  dpl::spawn(3, [&](dpl::rank_context& rank) {
    model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(20 + rank.rank()));
    m.stats[0] = 42;
    dpl::distributed_data_parallel<model> ddp(m, rank.group());  // broadcasts rank 0's parameters
    if (rank.rank() == 0) dpl::save_state_dict(dir / "ddp.safetensors", ddp);
  });
  model const want({3, 5, 1, 8, 2, 4}, 20);
  dpl::safetensors_reader const file(dir / "ddp.safetensors");
  for (auto const& t : file.tensors()) CHECK(t.name.rfind("module.", 0) == std::string::npos);
  CHECK(file.tensors().size() == 7);

  std::vector<std::vector<double>> params(3);
  std::vector<float> stats(3);
  dpl::spawn(3, [&](dpl::rank_context& rank) {
    model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(90 + rank.rank()));  // different on every rank
    dpl::distributed_data_parallel<model> ddp(m, rank.group());
    dpl::load_state_dict(dir / "ddp.safetensors", ddp);
    params[static_cast<std::size_t>(rank.rank())] = test::flat(ddp.module(), false);
    stats[static_cast<std::size_t>(rank.rank())] = ddp.module().stats[0];
  });
  model copy = want;
  for (auto const& p : params) CHECK(p == test::flat(copy, false));
  CHECK(stats == std::vector<float>{42, 42, 42});
}

TEST_CASE("strict loading lists missing, unexpected and mismatched names and changes nothing", "[io][state_dict]") {
  auto const dir = scratch("strict");
  named_net src;
  src.fill(6);
  std::vector<float> wrong_bias(4), wrong_scale(2), extra(1);
  // fc.weight matches; fc.bias has 4 elements; scale is F32 instead of F64; "extra" is unknown;
  // steps, mask, half and ids are missing.
  dpl::save_safetensors(dir / "bad.safetensors", {{"encoder.fc.weight", dpl::view(src.w), {{3, 4}}},
                                                  {"encoder.fc.bias", dpl::view(wrong_bias)},
                                                  {"scale", dpl::view(wrong_scale)},
                                                  {"extra", dpl::view(extra)}});
  named_net m;
  m.fill(7);
  auto const before = tensor_bytes(m);
  for (bool strict : {true, false}) {
    INFO("strict = " << strict);
    try {
      dpl::load_state_dict(dir / "bad.safetensors", m, {.strict = strict});
      FAIL("expected an error");
    } catch (dpl::error const& e) {
      std::string const what = e.what();
      INFO(what);
      CHECK(what.find("bad.safetensors") != std::string::npos);
      CHECK(what.find("'encoder.fc.bias' (the file has F32 [4], the model F32 [3])") != std::string::npos);
      CHECK(what.find("'scale' (the file has F32 [2], the model F64 [2])") != std::string::npos);
      CHECK(what.find("'encoder.fc.weight'") == std::string::npos);
      bool const lists_names =
          what.find("missing in the file: steps, mask, half, ids") != std::string::npos &&
          what.find("unexpected in the file (the model has no such tensor): extra") != std::string::npos;
      CHECK(lists_names == strict);
    }
    CHECK(tensor_bytes(m) == before);  // checked before anything was read
  }

  // A 2-D weight saved as 1-D: the model states its shape, so it is a mismatch.
  dpl::save_safetensors(dir / "flat.safetensors", {{"encoder.fc.weight", dpl::view(src.w)}});
  CHECK_THROWS_WITH(dpl::load_state_dict(dir / "flat.safetensors", m, {.strict = false}),
                    Catch::Contains("'encoder.fc.weight' (the file has F32 [12], the model F32 [3, 4])"));
}

TEST_CASE("non-strict loading loads what matches and reports the rest", "[io][state_dict]") {
  auto const dir = scratch("non_strict");
  named_net src;
  src.fill(8);
  std::vector<float> extra(2);
  dpl::save_safetensors(dir / "part.safetensors", {{"encoder.fc.weight", dpl::view(src.w), {{3, 4}}},
                                                   {"scale", dpl::view(src.scale)},
                                                   {"module.steps", dpl::view(src.steps)},
                                                   {"head.weight", dpl::view(extra)}});
  named_net m;
  m.fill(9);
  auto const old_bias = m.b;
  auto const old_mask = m.mask;
  CHECK_THROWS_WITH(dpl::load_state_dict(dir / "part.safetensors", m),
                    Catch::Contains("missing in the file: encoder.fc.bias, mask, half, ids"));
  auto const r = dpl::load_state_dict(dir / "part.safetensors", m, {.strict = false});
  CHECK(r.missing == std::vector<std::string>{"encoder.fc.bias", "mask", "half", "ids"});
  CHECK(r.unexpected == std::vector<std::string>{"head.weight"});
  CHECK(std::memcmp(m.w.data(), src.w.data(), m.w.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(m.scale.data(), src.scale.data(), m.scale.size() * sizeof(double)) == 0);
  CHECK(m.steps == src.steps);
  CHECK(std::memcmp(m.b.data(), old_bias.data(), m.b.size() * sizeof(float)) == 0);
  CHECK(m.mask == old_mask);
}

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
      {"deep nesting",
       raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":)" + std::string(100, '[') +
                    std::string(100, ']') + "}}",
                8),
       "nesting deeper than 64"},
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

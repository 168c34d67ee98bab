// State dicts in safetensors: round trips, names and shapes (own, model_traits, defaults), bad
// names, DP and DDP wrappers, strict and non-strict loading. Malformed, fuzzed and interrupted
// files are test_io_files'.
#include "io/named_net.hpp"
#include "models.hpp"
#include "scratch.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

namespace dpl = dparallel;
namespace fs = std::filesystem;

namespace {

using test::bytes_of;
using test::listing;
using test::named_net;
using test::tensor_bytes;

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

// The C++ side of tests/io/check_safetensors.py (CTest io:python_stdlib_reader).
//   dparallel_io_fixture write DIR   writes DIR/state.safetensors (a state dict saved through a
//                                    DataParallel wrapper) and DIR/checkpoint.safetensors
//   dparallel_io_fixture read FILE   loads FILE (strictly) into the same model and prints one line
//                                    per tensor: its name and its bytes in hex
// Exit status: 0 success, 1 a dparallel::error (its message on stderr), 2 bad usage.
#include <dparallel/dparallel.hpp>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/state_dict.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace dpl = dparallel;

namespace {

/// Every host dtype, 2-D and scalar shapes, names with dots.
struct net {
  std::vector<float> w = std::vector<float>(12), b = std::vector<float>(3);
  std::vector<double> scale = std::vector<double>(2);
  std::vector<float> gw = std::vector<float>(12), gb = std::vector<float>(3);
  std::vector<double> gscale = std::vector<double>(2);
  std::vector<std::int64_t> steps = std::vector<std::int64_t>(1);
  std::vector<std::uint16_t> half = std::vector<std::uint16_t>(4), bhalf = std::vector<std::uint16_t>(3);
  std::vector<std::uint8_t> mask = std::vector<std::uint8_t>(5);
  std::vector<std::int32_t> ids = std::vector<std::int32_t>(3);

  std::vector<dpl::tensor_ref> parameters() { return {dpl::view(w), dpl::view(b), dpl::view(scale)}; }
  std::vector<dpl::tensor_ref> gradients() { return {dpl::view(gw), dpl::view(gb), dpl::view(gscale)}; }
  std::vector<dpl::tensor_ref> buffers() {
    return {dpl::view(steps), dpl::tensor_ref(half.data(), half.size(), dpl::dtype::f16),
            dpl::tensor_ref(bhalf.data(), bhalf.size(), dpl::dtype::bf16), dpl::view(mask), dpl::view(ids)};
  }
  static auto parameter_names() { return std::array{"encoder.fc.weight", "encoder.fc.bias", "scale"}; }
  static auto buffer_names() { return std::array{"steps", "half", "bhalf", "mask", "ids"}; }
  static auto parameter_shapes() { return std::vector<std::vector<int>>{{3, 4}, {3}, {2}}; }
  static auto buffer_shapes() { return std::vector<std::vector<int>>{{}, {2, 2}, {3}, {5}, {3}}; }
};

void write(std::filesystem::path const& dir) {
  net m;
  for (std::size_t i = 0; i < m.w.size(); ++i) m.w[i] = 0.25f * static_cast<float>(i) - 1.5f;
  m.b = {100, 101, 102};
  m.scale = {1.0 / 3.0, -2.5e300};
  m.steps = {1234567890123};
  m.half = {0x3C00, 0xC000, 0x3555, 0x7C00};  // 1, -2, 0.333251953125, inf
  m.bhalf = {0x3F80, 0xC040, 0x4049};         // 1, -3, 3.140625
  m.mask = {0, 1, 2, 254, 255};
  m.ids = {-7, 0, 2147483647};
  dpl::data_parallel<net> dp(m, dpl::host::devices(2));
  dpl::save_state_dict(dir / "state.safetensors", dp, {{"source", "dparallel"}});

  std::vector<float> m0(12), m1 = {-1, -2, -3};
  std::vector<double> m2 = {1e-300, 2.0};
  for (std::size_t i = 0; i < m0.size(); ++i) m0[i] = 0.5f * static_cast<float>(i);
  dpl::checkpoint ck(dp);
  ck.add("momentum.0", dpl::view(m0)).add("momentum.1", dpl::view(m1)).add("momentum.2", dpl::view(m2));
  ck.progress() = {
      .epoch = 3, .step = 17, .sampler = {3, 40}, .seed = 1234, .extra = {{"note", "\xC3\xBCnicode \xE2\x9C\x93"}}};
  ck.save(dir / "checkpoint.safetensors");
}

void read(std::filesystem::path const& file) {
  net m;
  dpl::load_state_dict(file, m);
  for (auto const& t : dpl::state_dict(m)) {
    std::printf("%s ", t.name.c_str());
    auto const* p = static_cast<unsigned char const*>(t.data.data());
    for (std::size_t i = 0; i < t.data.size_bytes(); ++i) std::printf("%02x", p[i]);
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[1]) != "write" && std::string(argv[1]) != "read")) {
    std::fprintf(stderr, "usage: %s write DIR | read FILE\n", argv[0]);
    return 2;
  }
  try {
    if (std::string(argv[1]) == "write") write(argv[2]);
    else read(argv[2]);
  } catch (dpl::error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}

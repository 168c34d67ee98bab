// Writes the seed corpus of the fuzz target (tests/fuzz/corpus): a state dict and a checkpoint of
// fuzz::model, and hand-made files for what the reader accepts beyond them (null metadata,
// whitespace before '{', a tensor of a dtype dparallel does not handle, unknown keys).
//   make_corpus <directory>
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/state_dict.hpp>

#include "fuzz_model.hpp"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {
void write_raw(std::filesystem::path const& p, std::string const& header, std::size_t data_bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out.put(static_cast<char>(n & 0xFF));
  out << header;
  for (std::size_t i = 0; i < data_bytes; ++i) out.put(static_cast<char>(i * 13));
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::filesystem::path const dir = argv[1];
  std::filesystem::create_directories(dir);
  fuzz::model m;
  m.fill(7);
  dparallel::save_state_dict(dir / "state.safetensors", m, {{"k", "v"}});
  std::vector<float> momentum(fuzz::model::size, 0.25f);
  dparallel::checkpoint ck(m);
  ck.add("momentum.0", dparallel::view(momentum));
  ck.progress() = {.epoch = 3, .step = 40, .sampler = {3, 5}, .seed = 9, .extra = {{"lr", "0.1"}}};
  ck.save(dir / "checkpoint.safetensors");
  write_raw(dir / "interop.safetensors",
            R"( {"__metadata__":null,"fc.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
            R"("flags":{"dtype":"BOOL","shape":[3],"data_offsets":[24,27],"extra":[1,{"a":null}]}})",
            27);
  return 0;
}

// Costs of the safe readers:
//   io_costs load [MB]        a state dict of MB (default 200) MB: load_state_dict (reads into a
//                             staging buffer, checks the file unchanged, copies) against reading
//                             each tensor straight into the model (what loads did before);
//                             interleaved rounds, best and median, and their ratio.
//   io_costs header FILE MB KIND   writes a safetensors file with a header of about MB MB:
//                             KIND "tensors" (many small tensors) or "values" (one unknown key
//                             holding an array of numbers, which the reader skips).
//   io_costs read FILE        opens FILE and reads its header: run it under /usr/bin/time -v for
//                             the peak memory of a header.
#include "bench_util.hpp"

#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

struct big_model {
  std::vector<std::vector<float>> tensors;
  std::vector<std::vector<float>> grads;
  std::vector<dparallel::tensor_ref> parameters() {
    std::vector<dparallel::tensor_ref> out;
    for (auto& t : tensors) out.emplace_back(dparallel::view(t));
    return out;
  }
  std::vector<dparallel::tensor_ref> gradients() {
    std::vector<dparallel::tensor_ref> out;
    for (auto& t : grads) out.emplace_back(dparallel::view(t));
    return out;
  }
};

int load_cost(std::size_t mb) {
  std::size_t const per = 1u << 20;  // 4 MiB tensors
  big_model m;
  for (std::size_t i = 0; i < mb / 4; ++i) {
    m.tensors.emplace_back(per, static_cast<float>(i));
    m.grads.emplace_back(1);
  }
  auto const path = std::filesystem::temp_directory_path() / "dparallel_io_costs.safetensors";
  dparallel::save_state_dict(path, m);
  std::vector<double> staged, direct;
  for (int round = 0; round < 7; ++round) {
    auto t0 = bench::clock::now();
    dparallel::load_state_dict(path, m);
    staged.push_back(bench::seconds_since(t0));
    t0 = bench::clock::now();
    {
      dparallel::safetensors_reader const file(path);
      auto const refs = m.parameters();
      for (std::size_t i = 0; i < refs.size(); ++i) file.read(file.tensors()[i], refs[i]);
    }
    direct.push_back(bench::seconds_since(t0));
  }
  std::filesystem::remove(path);
  auto ms = [](double s) { return s * 1e3; };
  std::printf("load of a %zu MB state dict (%s)\n", mb, bench::load_note().c_str());
  std::printf("  staged (load_state_dict): best %.1f ms, median %.1f ms\n", ms(*std::min_element(staged.begin(), staged.end())),
              ms(bench::median(staged)));
  std::printf("  direct reads:             best %.1f ms, median %.1f ms\n", ms(*std::min_element(direct.begin(), direct.end())),
              ms(bench::median(direct)));
  std::printf("  staged / direct: best %.2fx, median %.2fx\n",
              *std::min_element(staged.begin(), staged.end()) / *std::min_element(direct.begin(), direct.end()),
              bench::median(staged) / bench::median(direct));
  return 0;
}

int write_header(char const* file, std::size_t mb, std::string const& kind) {
  std::size_t const target = mb << 20;
  std::string h = "{";
  std::uint64_t data = 0;
  if (kind == "tensors") {
    for (std::size_t i = 0; h.size() < target; ++i) {
      if (i != 0) h += ',';
      h += "\"layers." + std::to_string(i) + ".w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" +
           std::to_string(data) + "," + std::to_string(data + 4) + "]}";
      data += 4;
    }
  } else {
    h += R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":[0)";
    while (h.size() < target) h += ",0";
    h += "]}";
    data = 4;
  }
  h += '}';
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  std::uint64_t n = h.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out.put(static_cast<char>(n & 0xFF));
  out << h;
  out << std::string(static_cast<std::size_t>(data), '\0');
  std::printf("%s: header of %zu bytes\n", file, h.size());
  return 0;
}

int read_header(char const* file) {
  auto const t0 = bench::clock::now();
  dparallel::safetensors_reader const r(file);
  std::printf("%s: %zu tensors, header read in %.2f s\n", file, r.tensors().size(), bench::seconds_since(t0));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string const mode = argc > 1 ? argv[1] : "";
  if (mode == "load") return load_cost(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 200);
  if (mode == "header" && argc == 5) return write_header(argv[2], std::strtoull(argv[3], nullptr, 10), argv[4]);
  if (mode == "read" && argc == 3) return read_header(argv[2]);
  std::fprintf(stderr, "usage: %s load [MB] | header FILE MB tensors|values | read FILE\n", argv[0]);
  return 2;
}

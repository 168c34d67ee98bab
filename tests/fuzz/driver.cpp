// A plain fuzz driver for LLVMFuzzerTestOneInput (tests/fuzz/read_fuzz.cpp), for compilers and
// builds without libFuzzer: runs every seed file once, then a fixed number of mutants of them made
// by a seeded generator, so a run is reproducible (the same seed and count give the same inputs).
//
//   read_fuzz_driver <seed> <iterations> <corpus file or directory>...
//
// Mutations: bit flips anywhere or in the header, bytes set to JSON punctuation, truncation, runs
// of bytes deleted or repeated, a new header length field, and tokens spliced into the header.
// Exit status 0 when every input kept the contract (the target aborts otherwise).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size);

namespace {

struct rng {
  std::uint64_t s;
  std::uint64_t next() {  // splitmix64
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(next() % n); }
};

using bytes = std::vector<std::uint8_t>;

bytes read_file(std::filesystem::path const& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::uint64_t header_end(bytes const& f) {
  if (f.size() < 8) return f.size();
  std::uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | f[static_cast<std::size_t>(k)];
  return n > f.size() - 8 ? f.size() : 8 + n;
}

void mutate(bytes& f, rng& g) {
  static constexpr std::string_view punctuation = "{}[]\":,0123456789-.eE \\ufFIUBnulltrue";
  static constexpr std::string_view tokens[] = {
      "null", "[]", "{}", "\"__metadata__\":null,", "\"dtype\":\"BOOL\",", "\"shape\":[[1]],",
      "\"data_offsets\":[0,18446744073709551615],", "1e999", "-0", "\"\\u0000\"", "\"\\ud800\"", "\x1b", ",\"x\":[[[[]]]]"};
  std::size_t const hend = static_cast<std::size_t>(header_end(f));
  switch (g.below(7)) {
    case 0:  // bit flips anywhere
      for (std::size_t k = 1 + g.below(8); k-- > 0 && !f.empty();) f[g.below(f.size())] ^= static_cast<std::uint8_t>(1u << g.below(8));
      break;
    case 1:  // bit flips in the length field and header
      for (std::size_t k = 1 + g.below(4); k-- > 0 && hend > 0;) f[g.below(hend)] ^= static_cast<std::uint8_t>(1u << g.below(8));
      break;
    case 2:  // truncation
      f.resize(g.below(f.size() + 1));
      break;
    case 3:  // JSON punctuation over header bytes
      for (std::size_t k = 1 + g.below(6); k-- > 0 && hend > 8;)
        f[8 + g.below(hend - 8)] = static_cast<std::uint8_t>(punctuation[g.below(punctuation.size())]);
      break;
    case 4: {  // a new length field, near the old one or anywhere
      if (f.size() < 8) break;
      std::uint64_t n = g.next() % 2 != 0 ? (hend - 8) + g.below(17) - 8 : g.next() >> g.below(64);
      for (int k = 0; k < 8; ++k, n >>= 8) f[static_cast<std::size_t>(k)] = static_cast<std::uint8_t>(n & 0xFF);
      break;
    }
    case 5: {  // a run deleted or repeated
      if (f.empty()) break;
      std::size_t const at = g.below(f.size()), end = std::min(f.size(), at + 1 + g.below(16));
      if (g.next() % 2 != 0) {
        f.erase(f.begin() + static_cast<std::ptrdiff_t>(at), f.begin() + static_cast<std::ptrdiff_t>(end));
      } else {
        bytes const run(f.begin() + static_cast<std::ptrdiff_t>(at), f.begin() + static_cast<std::ptrdiff_t>(end));
        f.insert(f.begin() + static_cast<std::ptrdiff_t>(at), run.begin(), run.end());
      }
      break;
    }
    default: {  // a token spliced into the header, the length field adjusted to keep the data aligned
      if (hend <= 9) break;
      std::string_view const t = tokens[g.below(std::size(tokens))];
      std::size_t const at = 9 + g.below(hend - 9);
      f.insert(f.begin() + static_cast<std::ptrdiff_t>(at), t.begin(), t.end());
      std::uint64_t n = (hend - 8) + t.size();
      for (int k = 0; k < 8; ++k, n >>= 8) f[static_cast<std::size_t>(k)] = static_cast<std::uint8_t>(n & 0xFF);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s <seed> <iterations> <corpus file or directory>...\n", argv[0]);
    return 2;
  }
  rng g{std::strtoull(argv[1], nullptr, 10)};
  long const iterations = std::strtol(argv[2], nullptr, 10);
  std::vector<bytes> corpus;
  for (int i = 3; i < argc; ++i) {
    std::filesystem::path const p = argv[i];
    if (std::filesystem::is_directory(p)) {
      std::vector<std::filesystem::path> files;
      for (auto const& e : std::filesystem::directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());  // a fixed order: the run depends on the seed only
      for (auto const& f : files) corpus.push_back(read_file(f));
    } else {
      corpus.push_back(read_file(p));
    }
  }
  if (corpus.empty()) {
    std::fprintf(stderr, "%s: no corpus files\n", argv[0]);
    return 2;
  }
  for (auto const& c : corpus) LLVMFuzzerTestOneInput(c.data(), c.size());
  for (long i = 0; i < iterations; ++i) {
    bytes f = corpus[g.below(corpus.size())];
    for (std::size_t k = 1 + g.below(3); k-- > 0;) mutate(f, g);
    LLVMFuzzerTestOneInput(f.data(), f.size());
  }
  std::printf("read_fuzz_driver: %zu seed files and %ld mutants kept the contract\n", corpus.size(), iterations);
  return 0;
}

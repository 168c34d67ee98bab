// Fuzz target for the readers of untrusted files: safetensors_reader (header and every tensor),
// load_state_dict and checkpoint::load, strict and not. The contract under test: any input either
// loads or throws dparallel::error; nothing else escapes (no other exception, crash, sanitizer
// report or hang), and a failed load leaves the model as it was.
//
// Two ways to run it:
//   * libFuzzer (clang): configure with -DDPARALLEL_LIBFUZZER=ON and run
//       build/<preset>/tests/read_fuzz_libfuzzer tests/fuzz/corpus
//   * the plain driver (tests/fuzz/driver.cpp, any compiler), which CTest runs as fuzz:readers
//     with a fixed seed and iteration count; the asan preset builds it with ASan + UBSan.
#include <dparallel/io/checkpoint.hpp>
#include <dparallel/io/safetensors.hpp>
#include <dparallel/io/state_dict.hpp>

#include "fuzz_model.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

[[noreturn]] void contract_broken(char const* what, char const* detail) {
  std::fprintf(stderr, "read_fuzz: %s: %s\n", what, detail);
  std::abort();
}

std::filesystem::path const& input_path() {
  static std::filesystem::path const p =
      std::filesystem::temp_directory_path() / ("dparallel_read_fuzz_" + std::to_string(::getpid()) + ".safetensors");
  return p;
}

// Runs `f`; a dparallel::error is an accepted outcome, anything else breaks the contract.
template <class F>
void guarded(char const* what, F&& f) {
  try {
    f();
  } catch (dparallel::error const&) {
  } catch (std::exception const& e) {
    contract_broken(what, e.what());
  } catch (...) {
    contract_broken(what, "a non-standard exception");
  }
}

void read_all(std::filesystem::path const& p) {
  dparallel::safetensors_reader const file(p);
  for (auto const& t : file.tensors()) {
    if (t.size_bytes() > (64u << 20)) continue;  // a valid header may describe a big tensor: skip it
    std::vector<unsigned char> storage(static_cast<std::size_t>(t.size_bytes()));
    file.read(t, dparallel::tensor_ref(storage.data(), static_cast<std::size_t>(t.elements()), t.type));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  auto const& p = input_path();
  {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<char const*>(data), static_cast<std::streamsize>(size));
  }
  guarded("safetensors_reader", [&] { read_all(p); });
  for (bool strict : {true, false}) {
    fuzz::model m;
    m.fill(1);
    fuzz::model const before = m;
    bool loaded = false;
    guarded("load_state_dict", [&] {
      dparallel::load_state_dict(p, m, {.strict = strict});
      loaded = true;
    });
    if (!loaded && !(m == before)) contract_broken("load_state_dict", "a failed load changed the model");

    fuzz::model c;
    c.fill(2);
    fuzz::model const c_before = c;
    std::vector<float> momentum(fuzz::model::size, 0.5f);
    dparallel::checkpoint ck(c);
    ck.add("momentum.0", dparallel::view(momentum));
    loaded = false;
    guarded("checkpoint::load", [&] {
      ck.load(p, {.strict = strict});
      loaded = true;
    });
    if (!loaded && !(c == c_before)) contract_broken("checkpoint::load", "a failed load changed the model");
  }
  return 0;
}

// blas_info (examples/blas_info.hpp): what the example and the benchmarks say of the OpenBLAS
// kernel, and when they warn. The decisions are checked on made-up CPUs (classify); detect() on
// this machine's.
#include "blas_info.hpp"

#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>
#include <utility>

namespace {

blas_info::report cpu(std::string kernel, bool avx2, bool avx512, bool amd, std::string forced = "") {
  blas_info::report r;
  r.kernel = std::move(kernel);
  r.avx2 = avx2;
  r.avx512 = avx512;
  r.amd = amd;
  r.forced = std::move(forced);
  return blas_info::classify(std::move(r));
}

bool has(std::string const& text, std::string const& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("blas_info: a generic kernel on an AVX-512 CPU is named, with the value that fits") {
  auto const r = cpu("Prescott", true, true, false);
  CHECK(r.generic);
  CHECK(r.suggested == "SkylakeX");
  CHECK(blas_info::summary(r) ==
        "blas: OpenBLAS kernel Prescott on a CPU with AVX-512 [generic: slower than this CPU allows]");
  std::string const w = blas_info::warning(r);
  CHECK(has(w, "generic Prescott kernels on a CPU with AVX-512"));
  CHECK(has(w, "OPENBLAS_CORETYPE=SkylakeX"));
  CHECK(blas_info::json_fields(r) == R"("blas_kernel":"Prescott","blas_kernel_generic":true,"blas_coretype_env":null)");
}

TEST_CASE("blas_info: on AVX2 the value is Haswell, Zen on AMD") {
  auto const intel = cpu("Core2", true, false, false);
  CHECK(intel.generic);
  CHECK(intel.suggested == "Haswell");
  CHECK(has(blas_info::warning(intel), "AVX2"));
  CHECK(has(blas_info::warning(intel), "OPENBLAS_CORETYPE=Haswell"));
  auto const amd = cpu("Prescott", true, false, true);
  CHECK(amd.generic);
  CHECK(amd.suggested == "Zen");
  CHECK(has(blas_info::warning(amd), "OPENBLAS_CORETYPE=Zen"));
}

TEST_CASE("blas_info: a kernel that uses AVX2 or wider is not generic, whatever its case") {
  for (char const* kernel : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids", "ZEN", "haswell"}) {
    INFO(kernel);
    auto const r = cpu(kernel, true, true, true);
    CHECK_FALSE(r.generic);
    CHECK(blas_info::warning(r).empty());
    CHECK_FALSE(has(blas_info::summary(r), "generic"));
  }
}

TEST_CASE("blas_info: a CPU without AVX2 gets no warning and no suggestion") {
  auto const r = cpu("Prescott", false, false, false);
  CHECK_FALSE(r.generic);
  CHECK(r.suggested.empty());
  CHECK(blas_info::warning(r).empty());
  CHECK(blas_info::summary(r) == "blas: OpenBLAS kernel Prescott");
}

TEST_CASE("blas_info: a value the environment set is reported and never overridden") {
  auto const r = cpu("Prescott", true, true, false, "Prescott");
  CHECK(r.generic);
  std::string const w = blas_info::warning(r);
  CHECK(has(w, "OPENBLAS_CORETYPE=Prescott is set by the environment"));
  CHECK(has(w, "left as is"));
  CHECK_FALSE(has(w, "SkylakeX"));
  CHECK(has(blas_info::summary(r), "(OPENBLAS_CORETYPE=Prescott set by the environment)"));
  CHECK(blas_info::json_fields(r) ==
        R"("blas_kernel":"Prescott","blas_kernel_generic":true,"blas_coretype_env":"Prescott")");
}

TEST_CASE("blas_info: the JSON fields escape quotes and backslashes and drop control characters") {
  auto const r = cpu("a\"b\\c\nd", false, false, false, "x\ty");
  CHECK(blas_info::json_fields(r) ==
        R"("blas_kernel":"a\"b\\cd","blas_kernel_generic":false,"blas_coretype_env":"xy")");
}

TEST_CASE("blas_info: detect reads this OpenBLAS and the environment") {
  char const* before = std::getenv("OPENBLAS_CORETYPE");
  std::string const saved = before != nullptr ? before : "";
  ::setenv("OPENBLAS_CORETYPE", "Checked", 1);  // read by detect() only: OpenBLAS chose its kernel at load
  auto const r = blas_info::detect();
  if (before != nullptr) ::setenv("OPENBLAS_CORETYPE", saved.c_str(), 1);
  else ::unsetenv("OPENBLAS_CORETYPE");
  std::string corename = openblas_get_corename();
  while (!corename.empty() && corename.back() == ' ') corename.pop_back();
  CHECK_FALSE(r.kernel.empty());
  CHECK(r.kernel == corename);
  CHECK(r.forced == "Checked");
  CHECK((!r.avx512 || r.avx2));  // every CPU with these AVX-512 subsets has AVX2 and FMA
  auto const again = blas_info::classify(r);
  CHECK(again.generic == r.generic);
  CHECK(again.suggested == r.suggested);
  CHECK(blas_info::summary(r).rfind("blas: OpenBLAS kernel " + r.kernel, 0) == 0);
}

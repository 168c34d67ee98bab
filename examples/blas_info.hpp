#pragma once
// What the example's and the benchmarks' GEMMs run on: the OpenBLAS kernel in use (its "core"),
// what this CPU could run, and a warning when OpenBLAS fell back to a generic kernel.
//
// OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels at start-up from the CPU it
// recognises; an older build that does not know a newer CPU falls back to a generic SSE kernel
// (Prescott, Core2, ...), two to four times slower on a CPU with AVX2 or AVX-512. The variable
// OPENBLAS_CORETYPE overrides the choice. Some machines set it on purpose (older builds compute
// wrong results on some processors), so nothing here sets it: scripts/bench does, for its own
// runs only, when the environment leaves it unset and an sgemm self-check passes (blas_check).
//
//   blas_info::report r = blas_info::detect();
//   std::printf("%s\n", blas_info::summary(r).c_str());   // "blas: OpenBLAS kernel Haswell ..."
//   if (auto w = blas_info::warning(r); !w.empty()) std::fprintf(stderr, "%s\n", w.c_str());
//   json += blas_info::json_fields(r);                     // "\"blas_kernel\":\"Haswell\",..."

#include <cblas.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <utility>

namespace blas_info {

/// The OpenBLAS kernel in use and what the CPU supports.
struct report {
  std::string kernel;         ///< openblas_get_corename(), e.g. "Haswell", "Prescott"
  std::string config;         ///< openblas_get_config(): version and build options
  bool avx2 = false;          ///< the CPU has AVX2 and FMA
  bool avx512 = false;        ///< the CPU has the AVX-512 subsets OpenBLAS's SkylakeX kernels use
  bool amd = false;           ///< the CPU is AMD's
  std::string forced;         ///< OPENBLAS_CORETYPE as the environment set it ("" when unset)
  bool generic = false;       ///< the kernel is below what the CPU supports (an SSE-only kernel on AVX2)
  std::string suggested;      ///< the OPENBLAS_CORETYPE value that fits the CPU ("" when none)
};

namespace detail {
inline std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}
/// Kernels that use AVX2 (and FMA) or wider: what a CPU with AVX2 should run.
inline bool avx2_class(std::string const& kernel) {
  std::string const k = lower(kernel);
  for (char const* name : {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"})
    if (k == name) return true;
  return false;
}
}  // namespace detail

/// Fills in what follows from the kernel and the CPU's features (`suggested`, `generic`): a CPU
/// with AVX-512 fits SkylakeX, one with AVX2 Haswell (Zen on AMD's); a kernel below AVX2 on a CPU
/// with AVX2 is generic. The kernel's name is compared without case.
inline report classify(report r) {
  r.suggested.clear();
  if (r.avx512) r.suggested = "SkylakeX";
  else if (r.avx2) r.suggested = r.amd ? "Zen" : "Haswell";
  r.generic = r.avx2 && !detail::avx2_class(r.kernel);
  return r;
}

/// Reads the kernel OpenBLAS chose and the CPU's features.
inline report detect() {
  report r;
  char const* core = openblas_get_corename();
  r.kernel = core != nullptr ? core : "unknown";
  char const* cfg = openblas_get_config();
  r.config = cfg != nullptr ? cfg : "";
  while (!r.kernel.empty() && std::isspace(static_cast<unsigned char>(r.kernel.back()))) r.kernel.pop_back();
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  r.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  r.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512cd");
  r.amd = __builtin_cpu_is("amd");
#endif
  if (char const* env = std::getenv("OPENBLAS_CORETYPE")) r.forced = env;
  return classify(std::move(r));
}

/// One line for a run's summary: the kernel, the CPU's class, whether the environment forced it.
inline std::string summary(report const& r) {
  std::string s = "blas: OpenBLAS kernel " + r.kernel;
  s += r.avx512 ? " on a CPU with AVX-512" : r.avx2 ? " on a CPU with AVX2" : "";
  if (!r.forced.empty()) s += " (OPENBLAS_CORETYPE=" + r.forced + " set by the environment)";
  if (r.generic) s += " [generic: slower than this CPU allows]";
  return s;
}

/// A warning when OpenBLAS runs a generic kernel on a CPU with AVX2 / AVX-512 ("" otherwise),
/// naming the OPENBLAS_CORETYPE value that fits.
inline std::string warning(report const& r) {
  if (!r.generic) return "";
  std::string w = "warning: OpenBLAS runs its generic " + r.kernel + " kernels on a CPU with " +
                  (r.avx512 ? "AVX-512" : "AVX2") + ": GEMMs run 2-4x slower than this CPU allows. ";
  if (!r.forced.empty())
    return w + "OPENBLAS_CORETYPE=" + r.forced + " is set by the environment (perhaps on purpose): left as is.";
  return w + "This OpenBLAS did not recognise the CPU; run with OPENBLAS_CORETYPE=" + r.suggested +
         " after checking its results (scripts/bench does both for its runs).";
}

/// JSON members (no braces, no trailing comma): blas_kernel, blas_kernel_generic, blas_coretype_env.
inline std::string json_fields(report const& r) {
  auto quoted = [](std::string const& v) {
    std::string q = "\"";
    for (char c : v) {
      if (c == '"' || c == '\\') q += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) q += c;
    }
    return q + "\"";
  };
  return "\"blas_kernel\":" + quoted(r.kernel) + ",\"blas_kernel_generic\":" + (r.generic ? "true" : "false") +
         ",\"blas_coretype_env\":" + (r.forced.empty() ? std::string("null") : quoted(r.forced));
}

}  // namespace blas_info

// blas_check: which OpenBLAS kernel this process runs, which one fits the CPU, and whether sgemm
// computes right with it. scripts/bench runs it before it sets OPENBLAS_CORETYPE for its runs:
//   blas_check                 prints key=value lines: kernel, generic (0/1), suggested, forced
//   blas_check --verify        also checks cblas_sgemm against a plain double-precision reference
//                              over several shapes, transpositions, alpha and beta; exit 1 on a
//                              mismatch (a kernel that computes wrong results on this CPU)

#include "blas_info.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

// C = alpha op(A) op(B) + beta C, row-major, against a double reference; true when every element
// is within a bound proportional to the magnitudes summed.
bool check_sgemm(int m, int n, int k, bool ta, bool tb, float alpha, float beta, unsigned seed) {
  auto next = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<int>(seed >> 9) % 2001 - 1000) / 1000.0f;
  };
  std::vector<float> a(static_cast<std::size_t>(m) * k), b(static_cast<std::size_t>(k) * n),
      c(static_cast<std::size_t>(m) * n);
  for (auto& v : a) v = next();
  for (auto& v : b) v = next();
  for (auto& v : c) v = next();
  std::vector<float> const c0 = c;
  int const lda = ta ? m : k, ldb = tb ? k : n;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a.data(),
              lda, b.data(), ldb, beta, c.data(), n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double sum = 0, mag = 0;
      for (int p = 0; p < k; ++p) {
        double const x = ta ? a[static_cast<std::size_t>(p) * m + i] : a[static_cast<std::size_t>(i) * k + p];
        double const y = tb ? b[static_cast<std::size_t>(j) * k + p] : b[static_cast<std::size_t>(p) * n + j];
        sum += x * y;
        mag += std::fabs(x * y);
      }
      std::size_t const at = static_cast<std::size_t>(i) * n + j;
      double const ref = alpha * sum + beta * c0[at];
      double const bound = 1e-5 * (std::fabs(alpha) * mag + std::fabs(beta * c0[at])) + 1e-6;
      if (!(std::fabs(c[at] - ref) <= bound)) {
        std::fprintf(stderr, "blas_check: sgemm %dx%dx%d%s%s: C[%d,%d] = %.9g, expected %.9g\n", m, n, k,
                     ta ? " A^T" : "", tb ? " B^T" : "", i, j, static_cast<double>(c[at]), ref);
        return false;
      }
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bool const verify = argc > 1 && std::strcmp(argv[1], "--verify") == 0;
  if (argc > 2 || (argc == 2 && !verify)) {
    std::fprintf(stderr, "usage: blas_check [--verify]\n");
    return 2;
  }
  blas_info::report const r = blas_info::detect();
  std::printf("kernel=%s\ngeneric=%d\nsuggested=%s\nforced=%s\n", r.kernel.c_str(), r.generic ? 1 : 0,
              r.suggested.c_str(), r.forced.c_str());
  if (!verify) return 0;
  struct shape {
    int m, n, k;
  };
  bool ok = true;
  unsigned seed = 1;
  // The reference workload's shapes (batch 64 and 128, 784-512-10), odd sizes that exercise the
  // kernels' edges, and every transposition.
  for (shape s : {shape{64, 512, 784}, shape{128, 10, 512}, shape{512, 784, 64}, shape{37, 53, 61}, shape{1, 17, 5},
                  shape{96, 96, 96}}) {
    for (int t = 0; t < 4; ++t) {
      ok = ok && check_sgemm(s.m, s.n, s.k, (t & 1) != 0, (t & 2) != 0, t == 3 ? -0.5f : 1.0f, t >= 2 ? 0.75f : 0.0f,
                             seed++);
    }
  }
  std::printf("sgemm=%s\n", ok ? "ok" : "wrong");
  return ok ? 0 : 1;
}

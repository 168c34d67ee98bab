// compare_weights: compares the tensors of two safetensors files (state dicts or checkpoints, as
// train_mlp --save / --save-checkpoint write them), for the example's tests and for users who
// want to know whether two runs trained the same model.
//
//   compare_weights A.safetensors B.safetensors              bitwise: every value the same bits
//   compare_weights A.safetensors B.safetensors --rel-tol T  |a - b| <= T * max(|a|, |b|) per value
//
// Both files must hold the same tensor names with the same dtypes and shapes; the values are
// compared for F32 and F64 tensors, the bytes for the others. The __metadata__ is not compared.
// Prints one line per tensor (largest absolute and relative difference) and exits 0 when the
// files match, 1 when they differ, 2 for a bad command line or a file that cannot be read.
//
//   compare_weights --swap-dims IN.safetensors OUT.safetensors
//
// writes IN's tensors to OUT with the dimensions of each 2-D tensor swapped and the data left as it
// is: a file with the right names and sizes but wrong shapes, which the tests feed to --init.

#include <dparallel/io/safetensors.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace {

namespace dpl = dparallel;

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: compare_weights A.safetensors B.safetensors [--rel-tol T]\n"
               "       compare_weights --swap-dims IN.safetensors OUT.safetensors\n"
               "Compares the tensors of two safetensors files: the same names, dtypes and shapes, and values\n"
               "equal to the bit (default) or within a relative tolerance T: |a - b| <= T * max(|a|, |b|).\n"
               "Exit status: 0 equal, 1 different, 2 bad arguments or unreadable files.\n"
               "--swap-dims writes IN with each 2-D tensor's dimensions swapped, the data unchanged (a file of\n"
               "wrong shapes, for tests).\n");
}

/// How two tensors' values differ.
struct difference {
  std::uint64_t mismatches = 0;     // values outside the tolerance (bitwise: not identical)
  std::uint64_t first = 0;          // index of the first mismatch
  double first_a = 0, first_b = 0;  // its values
  double max_abs = 0, max_rel = 0;  // largest |a - b| and |a - b| / max(|a|, |b|)
};

template <class T>
difference compare_values(std::vector<T> const& a, std::vector<T> const& b, double rel_tol) {
  difference d;
  for (std::size_t i = 0; i < a.size(); ++i) {
    auto const x = static_cast<double>(a[i]);
    auto const y = static_cast<double>(b[i]);
    double const abs = std::fabs(x - y);
    double const scale = std::max(std::fabs(x), std::fabs(y));
    double const rel = abs == 0 ? 0.0 : abs / scale;
    bool const same = rel_tol == 0 ? std::memcmp(&a[i], &b[i], sizeof(T)) == 0 : abs <= rel_tol * scale;
    if (!(abs <= d.max_abs)) d.max_abs = abs;  // NaN sticks
    if (!(rel <= d.max_rel)) d.max_rel = rel;
    if (!same && d.mismatches++ == 0) {
      d.first = i;
      d.first_a = x;
      d.first_b = y;
    }
  }
  return d;
}

/// Tensor `t`'s bytes, whatever its dtype.
std::vector<unsigned char> read_bytes(dpl::safetensors_reader const& file, dpl::tensor_info const& t) {
  std::vector<unsigned char> out(static_cast<std::size_t>(t.size_bytes()));
  file.read(t, dpl::tensor_ref(out.data(), static_cast<std::size_t>(t.elements()), t.type));
  return out;
}

/// Compares two files; prints a line per tensor and returns whether they match.
bool compare(std::string const& path_a, std::string const& path_b, double rel_tol) {
  dpl::safetensors_reader const a(path_a), b(path_b);
  bool ok = true;
  for (auto const& t : a.tensors())
    if (b.find(t.name) == nullptr) {
      std::printf("compare_weights: '%s' is in %s only\n", t.name.c_str(), path_a.c_str());
      ok = false;
    }
  for (auto const& t : b.tensors())
    if (a.find(t.name) == nullptr) {
      std::printf("compare_weights: '%s' is in %s only\n", t.name.c_str(), path_b.c_str());
      ok = false;
    }
  std::vector<dpl::tensor_info> names = a.tensors();
  std::sort(names.begin(), names.end(), [](auto const& x, auto const& y) { return x.name < y.name; });
  for (auto const& ta : names) {
    dpl::tensor_info const* tb = b.find(ta.name);
    if (tb == nullptr) continue;
    if (ta.type != tb->type || ta.shape != tb->shape) {
      std::printf("compare_weights: '%s': %s %s in %s, %s %s in %s\n", ta.name.c_str(),
                  std::string(dpl::name_of(ta.type)).c_str(), dpl::detail::shape_string(ta.shape).c_str(),
                  path_a.c_str(), std::string(dpl::name_of(tb->type)).c_str(),
                  dpl::detail::shape_string(tb->shape).c_str(), path_b.c_str());
      ok = false;
      continue;
    }
    difference d;
    if (ta.type == dpl::dtype::f32)
      d = compare_values(a.read_vector<float>(ta.name), b.read_vector<float>(ta.name), rel_tol);
    else if (ta.type == dpl::dtype::f64)
      d = compare_values(a.read_vector<double>(ta.name), b.read_vector<double>(ta.name), rel_tol);
    else
      d = compare_values(read_bytes(a, ta), read_bytes(b, *tb), 0.0);
    std::printf("compare_weights: '%s' %s %s: max |a-b| %.3g, max relative %.3g", ta.name.c_str(),
                std::string(dpl::name_of(ta.type)).c_str(), dpl::detail::shape_string(ta.shape).c_str(), d.max_abs,
                d.max_rel);
    if (d.mismatches == 0) {
      std::printf(", %s\n", rel_tol == 0 ? "bitwise equal" : "within tolerance");
    } else {
      std::printf(", %llu value%s differ%s (first at %llu: %.9g and %.9g)\n",
                  static_cast<unsigned long long>(d.mismatches), d.mismatches == 1 ? "" : "s",
                  d.mismatches == 1 ? "s" : "", static_cast<unsigned long long>(d.first), d.first_a, d.first_b);
      ok = false;
    }
  }
  return ok;
}

/// Writes `in`'s tensors to `out` with each 2-D tensor's dimensions swapped.
void swap_dims(std::string const& in, std::string const& out) {
  dpl::safetensors_reader const file(in);
  std::vector<std::vector<unsigned char>> data;
  data.reserve(file.tensors().size());
  std::vector<dpl::named_tensor> tensors;
  for (auto const& t : file.tensors()) {
    data.push_back(read_bytes(file, t));
    auto shape = t.shape;
    if (shape.size() == 2) std::swap(shape[0], shape[1]);
    tensors.push_back({t.name, dpl::tensor_ref(data.back().data(), static_cast<std::size_t>(t.elements()), t.type),
                       shape});
  }
  dpl::save_safetensors(out, tensors, file.metadata());
}

double parse_tolerance(std::string_view text) {
  double v = 0;
  auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || !std::isfinite(v) || v < 0)
    throw usage_error("--rel-tol: expected a number >= 0, found '" + std::string(text) + "'");
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::vector<std::string_view> files;
    double rel_tol = 0;
    bool swap = false;
    for (int i = 1; i < argc; ++i) {
      std::string_view const arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        print_usage(stdout);
        return 0;
      } else if (arg == "--rel-tol") {
        if (i + 1 >= argc) throw usage_error("--rel-tol: expected a value after it");
        rel_tol = parse_tolerance(argv[++i]);
      } else if (arg == "--swap-dims") {
        swap = true;
      } else if (arg.starts_with("--")) {
        throw usage_error("unknown option '" + std::string(arg) + "'");
      } else {
        files.push_back(arg);
      }
    }
    if (files.size() != 2)
      throw usage_error("expected two files, found " + std::to_string(files.size()));
    if (swap) {
      swap_dims(std::string(files[0]), std::string(files[1]));
      return 0;
    }
    bool const same = compare(std::string(files[0]), std::string(files[1]), rel_tol);
    std::printf("compare_weights: %s and %s %s\n", std::string(files[0]).c_str(), std::string(files[1]).c_str(),
                same ? (rel_tol == 0 ? "are bitwise equal" : "are equal within the tolerance") : "differ");
    return same ? 0 : 1;
  } catch (usage_error const& e) {
    std::fprintf(stderr, "compare_weights: %s\n", e.what());
    print_usage(stderr);
    return 2;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "compare_weights: error: %s\n", e.what());
    return 2;
  }
}

#pragma once
// Small helpers shared by the benchmarks: command-line options, a table printer that also writes
// CSV, the machine's load, and timing. Benchmarks report ratios measured in one run; the load
// average is printed beside them because this machine is shared.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace bench {

using clock = std::chrono::steady_clock;

inline double seconds_since(clock::time_point t0) {
  return std::chrono::duration<double>(clock::now() - t0).count();
}

/// The first field of /proc/loadavg (runnable threads averaged over one minute), or -1.
inline double load_average() {
  std::ifstream f("/proc/loadavg");
  double one = -1;
  if (f) f >> one;
  return one;
}

/// "load 1.23 on 2 cores": printed beside every table.
inline std::string load_note() {
  char s[96];
  std::snprintf(s, sizeof s, "load average %.2f on %u hardware threads", load_average(),
                std::thread::hardware_concurrency());
  return s;
}

/// --name value options; every option has a default. Unknown options are an error (exit 2).
class args {
 public:
  args(int argc, char** argv, std::string usage) : usage_(std::move(usage)) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::printf("%s", usage_.c_str());
        std::exit(0);
      }
      if (a.rfind("--", 0) != 0 || i + 1 >= argc) fail("expected --option value, found '" + a + "'");
      pairs_.emplace_back(a.substr(2), argv[++i]);
    }
  }
  std::string str(std::string const& name, std::string def) {
    known_.push_back(name);
    for (auto const& [k, v] : pairs_)
      if (k == name) return v;
    return def;
  }
  double num(std::string const& name, double def) {
    std::string const s = str(name, "");
    if (s.empty()) return def;
    try {
      return std::stod(s);
    } catch (...) {
      fail("--" + name + ": expected a number, found '" + s + "'");
    }
  }
  /// A comma-separated list of numbers.
  std::vector<double> list(std::string const& name, std::vector<double> def) {
    std::string const s = str(name, "");
    if (s.empty()) return def;
    std::vector<double> out;
    std::stringstream in(s);
    for (std::string item; std::getline(in, item, ',');) {
      try {
        out.push_back(std::stod(item));
      } catch (...) {
        fail("--" + name + ": expected comma-separated numbers, found '" + s + "'");
      }
    }
    return out;
  }
  /// Call after every option was read: rejects the ones nobody asked for.
  void done() const {
    for (auto const& [k, v] : pairs_)
      if (std::find(known_.begin(), known_.end(), k) == known_.end()) fail("unknown option --" + k);
  }

 private:
  [[noreturn]] void fail(std::string const& why) const {
    std::fprintf(stderr, "error: %s\n%s", why.c_str(), usage_.c_str());
    std::exit(2);
  }
  std::string usage_;
  std::vector<std::pair<std::string, std::string>> pairs_;
  std::vector<std::string> known_;
};

/// A table: printed aligned on stdout, written as CSV (same columns) when a path is given.
class table {
 public:
  explicit table(std::vector<std::string> columns) : columns_(std::move(columns)) {}

  void add(std::vector<std::string> row) {
    if (row.size() != columns_.size()) throw std::logic_error("table: a row with the wrong number of cells");
    rows_.push_back(std::move(row));
  }

  void print() const {
    std::vector<std::size_t> w(columns_.size());
    for (std::size_t c = 0; c < columns_.size(); ++c) {
      w[c] = columns_[c].size();
      for (auto const& r : rows_) w[c] = std::max(w[c], r[c].size());
    }
    auto line = [&](std::vector<std::string> const& r) {
      for (std::size_t c = 0; c < r.size(); ++c) std::printf("%*s%s", static_cast<int>(w[c]), r[c].c_str(), c + 1 < r.size() ? "  " : "\n");
    };
    line(columns_);
    for (auto const& r : rows_) line(r);
    std::fflush(stdout);
  }

  void write_csv(std::string const& path) const {
    if (path.empty()) return;
    std::ofstream f(path);
    if (!f) throw std::runtime_error("cannot write " + path);
    auto line = [&](std::vector<std::string> const& r) {
      for (std::size_t c = 0; c < r.size(); ++c) f << r[c] << (c + 1 < r.size() ? "," : "\n");
    };
    line(columns_);
    for (auto const& r : rows_) line(r);
  }

 private:
  std::vector<std::string> columns_;
  std::vector<std::vector<std::string>> rows_;
};

/// printf into a std::string.
template <class... A>
std::string fmt(char const* f, A... a) {
  char s[128];
  std::snprintf(s, sizeof s, f, a...);
  return s;
}

/// 4096 -> "4 KiB", 67108864 -> "64 MiB".
inline std::string bytes_label(std::size_t b) {
  if (b >= (std::size_t{1} << 30) && b % (std::size_t{1} << 30) == 0) return fmt("%zu GiB", b >> 30);
  if (b >= (std::size_t{1} << 20) && b % (std::size_t{1} << 20) == 0) return fmt("%zu MiB", b >> 20);
  if (b >= (std::size_t{1} << 10) && b % (std::size_t{1} << 10) == 0) return fmt("%zu KiB", b >> 10);
  return fmt("%zu B", b);
}

/// The median of a few values (by copy).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n == 0 ? 0.0 : (n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

}  // namespace bench

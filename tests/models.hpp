#pragma once
// Test models: ordinary user types adapted to dparallel, with a one-device reference.
#include <dparallel/dparallel.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace test {

/// Deterministic generator for test data (splitmix64).
struct rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  int small_int(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<std::uint64_t>(hi - lo + 1)); }
};

/// A batch of n samples: x is n x dim, y is n.
template <class T>
struct samples {
  dparallel::tensor_view<const T> x;
  dparallel::tensor_view<const T> y;
};

template <class T>
struct dataset {
  std::size_t n = 0, dim = 0;
  std::vector<T> x, y;
  samples<T> all() const { return {dparallel::tensor_view<const T>(x.data(), x.size(), n), dparallel::view(y)}; }
  /// Random data; with `exact`, small integers so that every sum in the tests is exact.
  static dataset make(std::size_t n, std::size_t dim, std::uint64_t seed, bool exact) {
    dataset d{n, dim, std::vector<T>(n * dim), std::vector<T>(n)};
    rng g{seed};
    for (auto& v : d.x) v = exact ? static_cast<T>(g.small_int(-3, 3)) : static_cast<T>(g.uniform() * 2 - 1);
    for (auto& v : d.y) v = exact ? static_cast<T>(g.small_int(-4, 4)) : static_cast<T>(g.uniform() * 2 - 1);
    return d;
  }
};

/// Linear regression y ~ w.x + b with loss 0.5 (w.x + b - y)^2, and a non-trained buffer that
/// counts the samples this replica has seen (replicated, never reduced).
template <class T>
struct linreg {
  std::vector<T> w, b{0}, gw, gb{0}, seen{0};
  explicit linreg(std::size_t dim = 4, std::uint64_t seed = 1) : w(dim), gw(dim) {
    rng g{seed};
    for (auto& v : w) v = static_cast<T>(g.small_int(-2, 2));
    b[0] = 1;
  }
  auto parameters() { return std::array{dparallel::view(w), dparallel::view(b)}; }
  auto gradients() { return std::array{dparallel::view(gw), dparallel::view(gb)}; }
  auto buffers() { return std::array{dparallel::view(seen)}; }

  /// Fills gw, gb with the gradient of the mean loss over the shard; returns the mean loss.
  T forward_backward(samples<T> const& s) {
    std::size_t const n = s.x.rows(), dim = w.size();
    std::fill(gw.begin(), gw.end(), T(0));
    gb[0] = 0;
    T loss = 0;
    for (std::size_t i = 0; i < n; ++i) {
      T pred = b[0];
      for (std::size_t j = 0; j < dim; ++j) pred += w[j] * s.x[i * dim + j];
      T const r = pred - s.y[i];
      loss += T(0.5) * r * r;
      for (std::size_t j = 0; j < dim; ++j) gw[j] += r * s.x[i * dim + j];
      gb[0] += r;
    }
    T const inv = T(1) / static_cast<T>(n);
    for (auto& g : gw) g *= inv;
    gb[0] *= inv;
    seen[0] += static_cast<T>(n);
    return loss * inv;
  }
  /// Per-sample predictions (a vector output to gather).
  std::vector<T> predict(samples<T> const& s) const {
    std::vector<T> out(s.x.rows());
    for (std::size_t i = 0; i < out.size(); ++i) {
      T pred = b[0];
      for (std::size_t j = 0; j < w.size(); ++j) pred += w[j] * s.x[i * w.size() + j];
      out[i] = pred;
    }
    return out;
  }
  void sgd(T lr) {
    for (std::size_t j = 0; j < w.size(); ++j) w[j] -= lr * gw[j];
    b[0] -= lr * gb[0];
  }
};

/// All parameters and gradients flattened, for comparisons.
template <class M>
std::vector<double> flat(M& m, bool grads) {
  std::vector<double> out;
  for (auto const& t : grads ? dparallel::gradient_refs(m) : dparallel::parameter_refs(m)) {
    if (t.dtype() == dparallel::dtype::f32)
      for (float v : t.template as<float>()) out.push_back(v);
    else
      for (double v : t.template as<double>()) out.push_back(v);
  }
  return out;
}

/// ||a - b|| / ||b|| (0 when both are 0).
inline double rel_error(std::vector<double> const& a, std::vector<double> const& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

/// Bitwise equality of all parameters of two models.
template <class M>
bool same_bits(M& a, M& b) {
  auto pa = dparallel::parameter_refs(a), pb = dparallel::parameter_refs(b);
  if (pa.size() != pb.size()) return false;
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (pa[i].size_bytes() != pb[i].size_bytes() || std::memcmp(pa[i].data(), pb[i].data(), pa[i].size_bytes()) != 0)
      return false;
  return true;
}

}  // namespace test

namespace test {

/// Linear regression whose weights are split over several parameter tensors of different sizes
/// (so DDP has several gradients to bucket), with a buffer. With a step_context, backward marks
/// each gradient ready as soon as it is computed, last parameter first (as autograd would), and
/// calls `between(i)` after each mark (tests use it to observe overlap).
template <class T>
struct chunked {
  std::vector<std::vector<T>> w, g;
  std::vector<T> stats{0};
  std::size_t dim = 0;
  explicit chunked(std::vector<std::size_t> sizes = {3, 5, 1, 8, 2, 4}, std::uint64_t seed = 1) {
    rng r{seed};
    for (std::size_t s : sizes) {
      std::vector<T> v(s);
      for (auto& x : v) x = static_cast<T>(r.small_int(-2, 2));
      w.push_back(v);
      g.emplace_back(s, T(0));
      dim += s;
    }
  }
  std::vector<dparallel::tensor_view<T>> parameters() {
    std::vector<dparallel::tensor_view<T>> out;
    for (auto& v : w) out.push_back(dparallel::view(v));
    return out;
  }
  std::vector<dparallel::tensor_view<T>> gradients() {
    std::vector<dparallel::tensor_view<T>> out;
    for (auto& v : g) out.push_back(dparallel::view(v));
    return out;
  }
  auto buffers() { return std::array{dparallel::view(stats)}; }

  template <class Between = void (*)(std::size_t)>
  T forward_backward(samples<T> const& s, dparallel::step_context* ctx = nullptr,
                     Between between = [](std::size_t) {}) {
    std::size_t const n = s.x.rows();
    std::vector<T> r(n);
    T loss = 0;
    for (std::size_t i = 0; i < n; ++i) {
      T pred = 0;
      std::size_t col = 0;
      for (auto const& v : w)
        for (T x : v) pred += x * s.x[i * dim + col++];
      r[i] = pred - s.y[i];
      loss += T(0.5) * r[i] * r[i];
    }
    T const inv = T(1) / static_cast<T>(n);
    std::vector<std::size_t> start(w.size(), 0);
    for (std::size_t p = 1; p < w.size(); ++p) start[p] = start[p - 1] + w[p - 1].size();
    for (std::size_t p = w.size(); p-- > 0;) {
      for (std::size_t j = 0; j < g[p].size(); ++j) {
        T acc = 0;
        for (std::size_t i = 0; i < n; ++i) acc += r[i] * s.x[i * dim + start[p] + j];
        g[p][j] = acc * inv;
      }
      if (ctx != nullptr) {
        ctx->grad_ready(p);
        between(p);
      }
    }
    stats[0] += static_cast<T>(n);
    return loss * inv;
  }
  void sgd(T lr) {
    for (std::size_t p = 0; p < w.size(); ++p)
      for (std::size_t j = 0; j < w[p].size(); ++j) w[p][j] -= lr * g[p][j];
  }
};

/// FNV-1a over the bytes of every parameter: a per-rank fingerprint for "replicas identical".
template <class M>
std::uint64_t param_hash(M& m) {
  std::uint64_t h = 1469598103934665603ull;
  for (auto const& t : dparallel::parameter_refs(m)) {
    auto const* p = static_cast<unsigned char const*>(t.data());
    for (std::size_t i = 0; i < t.size_bytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

/// Linear regression whose parameters live in one flat buffer and whose gradients live in
/// another, in parameter order (the layout gradient_as_bucket_view wants). With `gap`, one unused
/// float separates consecutive gradients: no two gradients are adjacent. Backward marks each
/// gradient ready as soon as it is computed, last parameter first.
struct flat_model {
  std::vector<std::size_t> sizes;
  std::size_t dim = 0;
  bool gap = false;
  std::vector<float> w, g;
  std::vector<float> stats{0};
  std::shared_ptr<std::byte> placed;  // the gradients' memory when place() gave it, else null
  float* gdata = nullptr;             // the gradients' storage: g, or placed

  explicit flat_model(std::vector<std::size_t> s = {3, 5, 1, 8, 2, 4}, std::uint64_t seed = 1, bool with_gap = false)
      : sizes(std::move(s)), gap(with_gap) {
    for (std::size_t n : sizes) dim += n;
    w.resize(dim);
    rng r{seed};
    for (auto& x : w) x = static_cast<float>(r.small_int(-2, 2)) + static_cast<float>(r.uniform()) * 0.25f;
    relayout(with_gap);
  }
  flat_model(flat_model const& o)  // a copy keeps its gradients in memory of its own
      : sizes(o.sizes), dim(o.dim), gap(o.gap), w(o.w), g(o.gdata, o.gdata + o.g.size()), stats(o.stats),
        gdata(g.data()), overlapping(o.overlapping) {}
  flat_model& operator=(flat_model const&) = delete;
  /// Gives the gradients new storage, with or without gaps between them.
  void relayout(bool with_gap) {
    gap = with_gap;
    std::vector<float> fresh(dim + (gap ? sizes.size() : 0), 0.0f);
    g.swap(fresh);
    gdata = g.data();
    placed.reset();
  }
  /// Moves the gradients (values and layout) into `memory` (room for g.size() floats), e.g.
  /// process_group::allocate's.
  void place(std::shared_ptr<std::byte> memory) {
    auto* const to = reinterpret_cast<float*>(memory.get());
    std::copy(gdata, gdata + g.size(), to);
    placed = std::move(memory);
    gdata = to;
  }
  /// With `overlapping`, each gradient starts one element before the previous one ends (a bug a
  /// model could have: two gradients sharing memory).
  bool overlapping = false;
  [[nodiscard]] std::size_t start(std::size_t p, bool grads) const {
    std::size_t o = 0;
    for (std::size_t k = 0; k < p; ++k) o += sizes[k] + (grads && gap ? 1 : 0) - (grads && overlapping ? 1 : 0);
    return o;
  }
  std::vector<dparallel::tensor_view<float>> parameters() {
    std::vector<dparallel::tensor_view<float>> out;
    for (std::size_t p = 0; p < sizes.size(); ++p) out.emplace_back(w.data() + start(p, false), sizes[p]);
    return out;
  }
  std::vector<dparallel::tensor_view<float>> gradients() {
    std::vector<dparallel::tensor_view<float>> out;
    for (std::size_t p = 0; p < sizes.size(); ++p) out.emplace_back(gdata + start(p, true), sizes[p]);
    return out;
  }
  auto buffers() { return std::array{dparallel::view(stats)}; }

  /// Gradient of the mean loss 0.5 (w.x - y)^2 over the shard; marks parameters ready in reverse
  /// order when given a context, skipping `skip` (an unused parameter: its gradient is left as is).
  float forward_backward(samples<float> const& s, dparallel::step_context* ctx = nullptr,
                         std::size_t skip = static_cast<std::size_t>(-1)) {
    std::size_t const n = s.x.rows();
    std::vector<float> r(n);
    float loss = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float pred = 0;
      for (std::size_t j = 0; j < dim; ++j) pred += w[j] * s.x[i * dim + j];
      r[i] = pred - s.y[i];
      loss += 0.5f * r[i] * r[i];
    }
    float const inv = 1.0f / static_cast<float>(n);
    auto grads = gradients();
    for (std::size_t p = sizes.size(); p-- > 0;) {
      if (p == skip) continue;
      for (std::size_t j = 0; j < sizes[p]; ++j) {
        float acc = 0;
        for (std::size_t i = 0; i < n; ++i) acc += r[i] * s.x[i * dim + start(p, false) + j];
        grads[p][j] = acc * inv;
      }
      if (ctx != nullptr) ctx->grad_ready(p);
    }
    stats[0] += static_cast<float>(n);
    return loss * inv;
  }
  void sgd(float lr) {
    auto grads = gradients();
    for (std::size_t p = 0; p < sizes.size(); ++p)
      for (std::size_t j = 0; j < sizes[p]; ++j) w[start(p, false) + j] -= lr * grads[p][j];
  }
  /// Every gradient, in parameter order (without the gaps).
  [[nodiscard]] std::vector<float> flat_grads() {
    std::vector<float> out;
    for (auto const& v : gradients()) out.insert(out.end(), v.begin(), v.end());
    return out;
  }
};

}  // namespace test

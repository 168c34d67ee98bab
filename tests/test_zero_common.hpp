#pragma once
// ZeRO-1 against DDP: one training run of either on any process group, with an update rule
// applied to whole tensors under DDP (optim::optimizer) and to each rank's shard of the buckets
// under ZeRO-1 (zero_redundancy_optimizer): the test's own (Adam's arithmetic) or the library's. Shared by tests/test_zero.cpp (thread ranks)
// and tests/mpi/test_mpi_zero.cpp (MPI processes); so are train_overlap (zero_options::overlap_gather)
// and train_half_rank (16-bit parameters with F32 master shards, zero_options::master_weights).
#include "models.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/rule.hpp>
#include <dparallel/optim/zero_redundancy_optimizer.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace test {

/// Adam's update (bias-corrected moments, eps outside the square root, L2 weight decay) as an
/// update_rule: enough arithmetic that any element updated twice, skipped, or fed the wrong
/// gradient or state shows in the bits.
struct adam_like {
  static constexpr std::size_t slot_count = 2;
  static constexpr std::array<std::string_view, 2> slot_names{"exp_avg", "exp_avg_sq"};
  struct step_constants {
    float lr, bc1, bc2;
  };
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
  step_constants constants(std::uint64_t step, double lr) const {
    auto const t = static_cast<double>(step);
    return {static_cast<float>(lr), static_cast<float>(1 - std::pow(double(beta1), t)),
            static_cast<float>(1 - std::pow(double(beta2), t))};
  }
  void apply(step_constants const& c, std::span<float> p, std::span<float const> g, std::span<float* const> s) const {
    float* m = s[0];
    float* v = s[1];
    for (std::size_t i = 0; i < p.size(); ++i) {
      float const gi = g[i] + weight_decay * p[i];
      m[i] = beta1 * m[i] + (1 - beta1) * gi;
      v[i] = beta2 * v[i] + (1 - beta2) * gi * gi;
      p[i] -= c.lr * (m[i] / c.bc1) / (std::sqrt(v[i] / c.bc2) + eps);
    }
  }
};
static_assert(dparallel::optim::update_rule<adam_like>);

/// The parameter sizes of the test model: 23 elements (divisible by none of 2, 3, 4), a
/// one-element tensor (with tiny buckets, a bucket smaller than the world).
inline std::vector<std::size_t> zero_sizes() { return {3, 5, 1, 8, 2, 4}; }

/// Buckets of one or two elements (first cap 4 bytes, then 8).
inline dparallel::options zero_tiny_buckets() {
  return {.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024)};
}

/// What one rank saw: its parameters after training, their hash after every step, its state bytes.
struct zero_run {
  std::vector<double> params;
  std::vector<std::uint64_t> hashes;
  std::size_t state_bytes = 0;
  std::size_t expected_state_bytes = 0;  // ZeRO-1: slots * 4 * sum over buckets of ceil(elements / N)
  std::size_t valid_elements = 0;        // ZeRO-1: this rank's shard elements that are parameters
};

/// 20 steps (by default) of DDP with optim::optimizer (zero = false) or ZeRO-1 with
/// zero_redundancy_optimizer, both with `rule`, on `group`, each rank on its slice of a fresh
/// batch per step; `hook`: gradients marked ready during backward.
template <dparallel::optim::update_rule Rule = adam_like>
zero_run train_zero_or_ddp(dparallel::process_group const& group, bool zero, bool hook, bool tiny, Rule rule = {},
                           int steps = 20) {
  using model = chunked<float>;
  int const world = group.size(), rank = group.rank();
  model m(zero_sizes(), static_cast<std::uint64_t>(7 + rank));  // differs until broadcast
  dparallel::options const opts = tiny ? zero_tiny_buckets() : dparallel::options{};
  zero_run out;
  auto const fn = [hook](model& r, samples<float> s, dparallel::step_context& ctx) {
    return hook ? r.forward_backward(s, &ctx) : r.forward_backward(s);
  };
  auto const train = [&](auto& w, auto& opt) {
    for (int k = 0; k < steps; ++k) {
      auto const d = dataset<float>::make(4 * static_cast<std::size_t>(world), m.dim,
                                          static_cast<std::uint64_t>(k + 1), false);
      w.step(dparallel::slice_batch(d.all(), static_cast<std::size_t>(rank) * 4, static_cast<std::size_t>(rank + 1) * 4), fn);
      opt.step(w, 0.01);
      out.hashes.push_back(param_hash(m));
    }
    out.state_bytes = opt.state_bytes();
  };
  if (zero) {
    dparallel::parallel<model, dparallel::ddp_zero1> w(m, group, opts);
    dparallel::optim::zero_redundancy_optimizer opt(w, rule);
    train(w, opt);
    auto const& r = w.reducer();
    auto const n = static_cast<std::size_t>(world);
    for (std::size_t b = 0; b < r.buckets().size(); ++b) {
      out.expected_state_bytes +=
          dparallel::optim::active_slots(rule) * sizeof(float) * ((r.buckets()[b].elements + n - 1) / n);
      out.valid_elements += r.shard_valid(b);
    }
  } else {
    dparallel::distributed_data_parallel<model> w(m, group, opts);
    dparallel::optim::optimizer opt(w, rule);
    train(w, opt);
  }
  out.params = flat(m, false);
  return out;
}

/// 20 steps of ZeRO-1 with zero_options::overlap_gather on this rank: the step function calls
/// opt.need(i) for every parameter (in forward order) unless `skip_need`; the parameters after a
/// last wait_gathers(), and the gathers pending after each update.
struct overlap_run {
  std::vector<double> params;
  std::vector<std::size_t> pending;
};
inline overlap_run train_overlap(dparallel::process_group const& group, bool hook, bool tiny, bool skip_need = false) {
  int const world = group.size(), rank = group.rank();
  chunked<float> m(zero_sizes(), static_cast<std::uint64_t>(7 + rank));
  dparallel::parallel<chunked<float>, dparallel::ddp_zero1> w(m, group, tiny ? zero_tiny_buckets() : dparallel::options{});
  dparallel::optim::zero_redundancy_optimizer opt(w, adam_like{}, {.overlap_gather = true});
  overlap_run out;
  auto const fn = [&](chunked<float>& r, samples<float> s, dparallel::step_context& ctx) {
    if (!skip_need)
      for (std::size_t i = 0; i < zero_sizes().size(); ++i) opt.need(i);
    return hook ? r.forward_backward(s, &ctx) : r.forward_backward(s);
  };
  for (int k = 0; k < 20; ++k) {
    auto const d = dataset<float>::make(4 * static_cast<std::size_t>(world), m.dim, static_cast<std::uint64_t>(k + 1), false);
    w.step(dparallel::slice_batch(d.all(), static_cast<std::size_t>(rank) * 4, static_cast<std::size_t>(rank + 1) * 4), fn);
    opt.step(w, 0.01);
    out.pending.push_back(opt.pending_gathers());
  }
  opt.wait_gathers();
  out.params = flat(m, false);
  return out;
}

/// chunked's linear model with T parameters and G gradients: the forward and backward run
/// in F32 on the widened parameters, each gradient element is rounded to G once.
template <class T, class G = T>
struct half_chunked {
  std::vector<std::vector<T>> w;
  std::vector<std::vector<G>> g;
  std::size_t dim = 0;
  explicit half_chunked(std::vector<std::size_t> const& sizes, std::uint64_t seed) {
    rng r{seed};
    for (std::size_t s : sizes) {
      std::vector<T> v(s);
      for (auto& x : v) x = T(static_cast<float>(r.small_int(-2, 2)) * 0.375f);
      w.push_back(v);
      g.emplace_back(s, G(0.0f));
      dim += s;
    }
  }
  std::vector<dparallel::tensor_view<T>> parameters() {
    std::vector<dparallel::tensor_view<T>> out;
    for (auto& v : w) out.push_back(dparallel::view(v));
    return out;
  }
  std::vector<dparallel::tensor_view<G>> gradients() {
    std::vector<dparallel::tensor_view<G>> out;
    for (auto& v : g) out.push_back(dparallel::view(v));
    return out;
  }
  void forward_backward(samples<float> const& s, dparallel::step_context* ctx = nullptr) {
    std::size_t const n = s.x.rows();
    std::vector<float> r(n);
    for (std::size_t i = 0; i < n; ++i) {
      float pred = 0;
      std::size_t col = 0;
      for (auto const& v : w)
        for (T x : v) pred += static_cast<float>(x) * s.x[i * dim + col++];
      r[i] = pred - s.y[i];
    }
    std::size_t start = dim;
    for (std::size_t p = w.size(); p-- > 0;) {
      start -= w[p].size();
      for (std::size_t j = 0; j < g[p].size(); ++j) {
        float acc = 0;
        for (std::size_t i = 0; i < n; ++i) acc += r[i] * s.x[i * dim + start + j];
        g[p][j] = G(acc / static_cast<float>(n));
      }
      if (ctx != nullptr) ctx->grad_ready(p);
    }
  }
};

/// The bits of every parameter, in order.
template <class M>
std::vector<std::uint16_t> half_bits(M& m) {
  std::vector<std::uint16_t> out;
  for (auto const& v : m.w)
    for (auto x : v) out.push_back(x.bits);
  return out;
}

/// One rank's 16-bit run: its parameter hash after every step, its bits at the end, its state
/// bytes (and, for ZeRO-1, what 1/N of two slots and the master with padding comes to).
struct half_run {
  std::vector<std::uint64_t> hashes;
  std::vector<std::uint16_t> bits;
  std::size_t state_bytes = 0, expected_state_bytes = 0;
};

/// 20 steps of DDP with optim::optimizer or ZeRO-1, both with master weights and adam_like, over
/// half_chunked<T> on `group`, each rank on its slice of a fresh batch per step.
template <class T>
half_run train_half_rank(dparallel::process_group const& group, bool zero, bool hook, bool tiny, int steps = 20) {
  using model = half_chunked<T>;
  int const world = group.size();
  auto const me = static_cast<std::size_t>(group.rank());
  half_run out;
  dparallel::options const opts = tiny ? zero_tiny_buckets() : dparallel::options{};
  model m(zero_sizes(), 7 + me);  // differs until broadcast
  auto const fn = [hook](model& r, samples<float> s, dparallel::step_context& c) { r.forward_backward(s, hook ? &c : nullptr); };
  auto const train = [&](auto& w, auto& opt) {
    for (int k = 0; k < steps; ++k) {
      auto const d = dataset<float>::make(4 * static_cast<std::size_t>(world), m.dim, static_cast<std::uint64_t>(k + 1), false);
      w.step(dparallel::slice_batch(d.all(), me * 4, (me + 1) * 4), fn);
      opt.step(w, 0.01);
      out.hashes.push_back(param_hash(m));
    }
    out.state_bytes = opt.state_bytes();
  };
  if (zero) {
    dparallel::parallel<model, dparallel::ddp_zero1> w(m, group, opts);
    dparallel::optim::zero_redundancy_optimizer opt(w, adam_like{}, {.master_weights = true});
    train(w, opt);
    auto const& r = w.reducer();
    auto const n = static_cast<std::size_t>(world);
    for (std::size_t b = 0; b < r.buckets().size(); ++b)
      out.expected_state_bytes += 3 * sizeof(float) * ((r.buckets()[b].elements + n - 1) / n);
  } else {
    dparallel::distributed_data_parallel<model> w(m, group, opts);
    dparallel::optim::optimizer opt(w, adam_like{}, {.master_weights = true});
    train(w, opt);
  }
  out.bits = half_bits(m);
  return out;
}

}  // namespace test

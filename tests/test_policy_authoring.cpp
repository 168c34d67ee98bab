// Policies written from scratch against the public interface (policy_set, the policy concepts;
// docs/writing-policies.md), mixed into bundles, give the one-device results.
#include "models.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/policy/replica_set.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dpl = dparallel;
using model = test::chunked<float>;

namespace {

/// Scatter: split the batch evenly over every device but the last, which gets no shard (say,
/// the device that also runs the data loader).
struct spare_last_device {
  static std::vector<std::size_t> shard_sizes(std::size_t batch, std::size_t n, dpl::options const&) {
    std::size_t const used = n > 1 ? n - 1 : 1;
    std::vector<std::size_t> sizes(n, 0);
    for (std::size_t i = 0; i < used; ++i) sizes[i] = batch / used + (i < batch % used ? 1 : 0);
    return sizes;
  }
};
static_assert(dpl::scatter_policy<spare_last_device>);

/// Reduce (DataParallel, host memory): the master's gradient becomes sum_i weight(i) * g_i,
/// summed from the last active device to the first, on the master's stream once every step
/// function is done.
struct reverse_sum_to_master {
  template <dpl::policy_set Set>
  void on_construct(Set&) {}
  template <dpl::policy_set Set>
  void begin_step(Set&) {}
  template <dpl::policy_set Set>
  void grad_ready(Set&, int, std::size_t) {}
  template <dpl::policy_set Set>
  void finish(Set& s) {
    for (std::size_t i = 1; i < s.size(); ++i)
      if (s.active(i)) s.streams[0]->wait(s.compute_done[i]);
    s.streams[0]->enqueue([&s] {
      for (std::size_t p = 0; p < s.grads[0].size(); ++p) {
        auto const master = s.grads[0][p].template as<float>();
        std::vector<float> sum(master.size(), 0.0F);
        for (std::size_t i = s.size(); i-- > 0;) {
          if (!s.active(i)) continue;
          auto const g = s.grads[i][p].template as<float>();
          auto const w = static_cast<float>(s.weight(i));
          for (std::size_t k = 0; k < sum.size(); ++k) sum[k] += w * g[k];
        }
        for (std::size_t k = 0; k < sum.size(); ++k) master[k] = sum[k];
      }
    });
  }
};
static_assert(dpl::reduce_policy<reverse_sum_to_master>);

struct dp_spare_last : dpl::dp {
  using scatter = spare_last_device;
};
struct dp_reverse_sum : dpl::dp {
  using reduce = reverse_sum_to_master;
};
struct dp_both : dpl::dp {
  using scatter = spare_last_device;
  using reduce = reverse_sum_to_master;
};

/// Reduce (DDP, host memory, float gradients) written from the documented interface: this rank's
/// gradients weighed by join.scale, then averaged over the ranks by one all-reduce per parameter.
struct per_parameter_average {
  template <dpl::policy_set Set>
  void on_construct(Set&) {}
  template <dpl::policy_set Set>
  void begin_step(Set&) {}
  template <dpl::policy_set Set>
  void grad_ready(Set&, int, std::size_t) {}
  template <dpl::policy_set Set>
  void finish(Set& s) {
    s.streams[0]->enqueue([&s] {
      std::vector<dpl::work> pending;
      for (dpl::tensor_ref const& g : s.grads[0]) {
        if (s.join.scale != 1.0) dpl::host::scale(g, s.join.scale);
        pending.push_back(s.group.all_reduce(g, dpl::reduce_op::avg));
      }
      for (auto const& w : pending) w.wait();
    });
  }
};
static_assert(dpl::reduce_policy<per_parameter_average>);

struct ddp_per_parameter : dpl::ddp {
  using reduce = per_parameter_average;
};

/// Each rank's gradients after each of `steps` DDP steps, rank r stepping on batch[r] samples
/// under average_mode::samples.
template <class Semantics>
std::vector<std::vector<double>> sample_weighted(std::vector<std::size_t> const& batch, int steps) {
  std::vector<std::vector<double>> out(batch.size());
  dpl::spawn(static_cast<int>(batch.size()), [&](dpl::rank_context& rank) {
    auto const r = static_cast<std::size_t>(rank.rank());
    std::size_t first = 0, rows = 0;
    for (std::size_t q = 0; q < batch.size(); ++q) {
      if (q < r) first += batch[q];
      rows += batch[q];
    }
    model m({3, 5, 1, 8}, 7);
    dpl::options o;
    o.average = dpl::average_mode::samples;
    dpl::parallel<model, Semantics> ddp(m, rank.group(), o);
    for (int k = 0; k < steps; ++k) {
      auto const d = test::dataset<float>::make(rows, m.dim, 40 + static_cast<std::uint64_t>(k), false);
      ddp.step(dpl::slice_batch(d.all(), first, first + batch[r]),
               [](model& x, test::samples<float> s) { x.forward_backward(s); });
      auto const g = test::flat(m, true);
      out[r].insert(out[r].end(), g.begin(), g.end());
      m.sgd(0.05F);
    }
  });
  return out;
}

std::vector<double> one_device_gradient(test::dataset<float> const& d) {
  model m;
  m.forward_backward(d.all());
  return test::flat(m, true);
}

template <class Semantics>
std::vector<double> gradient(test::dataset<float> const& d, int devices, std::vector<std::size_t>* shards = nullptr) {
  model m;
  dpl::parallel<model, Semantics> p(m, dpl::host::devices(devices));
  p.step(d.all(), [](model& r, test::samples<float> s) { return r.forward_backward(s); });
  if (shards) *shards = p.last_shard_sizes();
  return test::flat(m, true);
}

}  // namespace

static_assert(dpl::policy_set<dpl::replica_set<model, dpl::host::backend>>);

TEST_CASE("policies written from scratch give the one-device gradient", "[host][policy][contract]") {
  // Exact data with 16 samples: with 1, 2 or 4 active devices every shard mean (1/16, 1/8, 1/4 of
  // sums of small integers) and every weight is exact, so the gradient is the one-device one to
  // the bit; 3 active devices (shards of 6, 5, 5) agree within rounding.
  auto const data = test::dataset<float>::make(16, model().dim, 31, true);
  auto const want = one_device_gradient(data);
  for (int n : {1, 2, 3, 4, 5}) {
    INFO("devices = " << n);
    std::vector<std::size_t> shards;
    auto const spare = gradient<dp_spare_last>(data, n, &shards);
    REQUIRE(shards.size() == static_cast<std::size_t>(n));
    if (n > 1) CHECK(shards.back() == 0);
    CHECK(test::rel_error(spare, want) <= 1e-6);
    CHECK(test::rel_error(gradient<dp_reverse_sum>(data, n), want) <= 1e-6);
    CHECK(test::rel_error(gradient<dp_both>(data, n), want) <= 1e-6);
    std::size_t const active = n > 1 ? static_cast<std::size_t>(n) - 1 : 1;
    if (active == 1 || active == 2 || active == 4) CHECK(spare == want);
  }
}

TEST_CASE("a from-scratch policy trains like the built-in one over steps", "[host][policy][contract]") {
  auto const data = test::dataset<float>::make(16, model().dim, 32, false);
  model a, b;
  dpl::parallel<model, dp_both> custom(a, dpl::host::devices(3));
  dpl::parallel<model, dpl::dp> builtin(b, dpl::host::devices(2));  // the same shards: 8 and 8
  for (int step = 0; step < 4; ++step) {
    custom.step(data.all(), [](model& r, test::samples<float> s) { return r.forward_backward(s); });
    builtin.step(data.all(), [](model& r, test::samples<float> s) { return r.forward_backward(s); });
    CHECK(custom.last_shard_sizes() == std::vector<std::size_t>{8, 8, 0});
    CHECK(test::flat(a, true) == test::flat(b, true));  // w0*g0 + w1*g1 in either order: one rounding each
    a.sgd(0.1F);
    b.sgd(0.1F);
  }
  CHECK(test::same_bits(a, b));
}

// join.scale is part of the interface (policy_set_join): a reducer written from the documentation
// that applies it averages sample-weighted exactly as dparallel::ddp does, bit for bit (both scale
// each gradient once, and the host engine sums in rank order either way).
TEST_CASE("a DDP reduce written from the interface weighs by join.scale as dparallel::ddp does",
          "[host][ddp][policy][join][contract]") {
  std::vector<std::size_t> const batch{4, 6, 3};  // join.scale = 3 * n_r / 13: never 1
  auto const custom = sample_weighted<ddp_per_parameter>(batch, 3);
  auto const builtin = sample_weighted<dpl::ddp>(batch, 3);
  for (std::size_t r = 0; r < batch.size(); ++r) {
    INFO("rank " << r);
    CHECK(custom[r] == builtin[r]);
    CHECK(custom[r] == custom[0]);
  }
}

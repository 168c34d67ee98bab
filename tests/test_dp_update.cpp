// DataParallel on host devices shares the work around the master among the devices' threads:
// the replicas' refresh (each device copies its stripes of every master tensor into the other
// replicas) and, through parallel::on_each_device, an optimizer's update of the master (each
// device its stripes). Checked here: every replica starts each step with the master's values
// bitwise, whichever devices run a shard, while the master's step function writes its buffers;
// on_each_device calls every device once, on that device's thread, and reports a failure as a
// step does; an optimizer stepped through a DP wrapper updates the master (and its state)
// bitwise as one thread does, for every rule, F32 and BF16 (master copies), over tensors large
// enough to be cut into many stripes.
#include <dparallel/dparallel.hpp>
#include <dparallel/optim/adam.hpp>
#include <dparallel/optim/optimizer.hpp>
#include <dparallel/optim/sgd.hpp>

#include <catch2/catch.hpp>

#include "models.hpp"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace dpl = dparallel;
namespace optim = dparallel::optim;

namespace {

/// Parameters of the given sizes (T: float or bf16) and one F32 buffer. A step fills every
/// gradient element from the shard's rows (a different value per element and shard).
template <class T>
struct wide {
  std::vector<std::vector<T>> w, g;
  std::vector<float> stats;

  wide(std::vector<std::size_t> const& sizes, std::size_t buffer, std::uint64_t seed) : stats(buffer) {
    test::rng r{seed};
    auto next = [&] { return static_cast<float>(r.uniform() * 2 - 1); };
    for (auto n : sizes) {
      w.emplace_back(n);
      g.emplace_back(n);
      for (auto& v : w.back()) v = T(next());
    }
    for (auto& v : stats) v = next();
  }
  std::vector<dpl::tensor_ref> parameters() {
    std::vector<dpl::tensor_ref> out;
    for (auto& v : w) out.push_back(dpl::view(v));
    return out;
  }
  std::vector<dpl::tensor_ref> gradients() {
    std::vector<dpl::tensor_ref> out;
    for (auto& v : g) out.push_back(dpl::view(v));
    return out;
  }
  std::vector<dpl::tensor_ref> buffers() { return {dpl::view(stats)}; }

  void fill_gradients(dpl::tensor_view<float const> rows) {
    float sum = 0;
    for (std::size_t r = 0; r < rows.size(); ++r) sum += rows[r];
    for (std::size_t k = 0; k < g.size(); ++k)
      for (std::size_t i = 0; i < g[k].size(); ++i)
        g[k][i] = T(sum * static_cast<float>(static_cast<int>((i * 31 + k * 7) % 13) - 6) * 1e-3f);
  }
};

std::vector<std::size_t> const big = {70001, 5, 150000, 17};  // 64 KiB stripes: several per device

/// Bytes of every tensor of `m` (parameters, then buffers), in order.
template <class M>
std::vector<unsigned char> snapshot(M& m) {
  std::vector<unsigned char> out;
  auto add = [&](dpl::tensor_ref t) {
    auto const* p = static_cast<unsigned char const*>(t.data());
    out.insert(out.end(), p, p + t.size() * dpl::size_of(t.dtype()));
  };
  for (auto t : dpl::parameters(m)) add(t);
  for (auto t : dpl::buffers(m)) add(t);
  return out;
}

std::vector<float> rows_of(std::size_t n, int t) {
  std::vector<float> x(n);
  for (std::size_t r = 0; r < n; ++r) x[r] = 0.25f * static_cast<float>(r + 1) + 0.125f * static_cast<float>(t);
  return x;
}

}  // namespace

TEST_CASE("every replica starts each step with the master's values, whichever devices run a shard",
          "[host][dp][contract]") {
  for (int n : {2, 3, 4}) {
    INFO(n << " devices");
    wide<float> m(big, 300000, 7);
    dpl::data_parallel<wide<float>> dp(m, dpl::host::devices(n));
    std::vector<char> matched(static_cast<std::size_t>(n)), ran(static_cast<std::size_t>(n));
    // Rows per step: 1 and 2 leave devices idle (their replicas keep older values until they run).
    for (int t = 0; t < 8; ++t) {
      std::size_t const rows = t % 4 == 1 ? 1 : t % 4 == 2 ? 2 : static_cast<std::size_t>(2 * n + t);
      for (auto& v : m.w[0]) v += 0.5f;  // the user changes the master between steps
      m.stats[static_cast<std::size_t>(t) * 1000] = static_cast<float>(t);
      auto const want = snapshot(m);
      std::fill(matched.begin(), matched.end(), 0);
      std::fill(ran.begin(), ran.end(), 0);
      auto const x = rows_of(rows, t);
      dp.step(dpl::tensor_view<float const>(x.data(), rows, rows),
              [&](wide<float>& r, dpl::tensor_view<float const> s, dpl::step_context& ctx) {
                auto const i = static_cast<std::size_t>(ctx.replica());
                ran[i] = 1;
                matched[i] = snapshot(r) == want ? 1 : 0;
                // The master's step updates its buffer (running statistics) while the other devices
                // copy from it: they must have finished reading it first.
                if (i == 0)
                  for (auto& v : r.stats) v = -1.0f;
                r.fill_gradients(s);
              });
      for (int i = 0; i < n; ++i) {
        INFO("step " << t << ", device " << i);
        CHECK(ran[static_cast<std::size_t>(i)] == (static_cast<std::size_t>(i) < rows ? 1 : 0));
        if (ran[static_cast<std::size_t>(i)] != 0) CHECK(matched[static_cast<std::size_t>(i)] == 1);
      }
      for (auto& v : m.stats) v = 0.5f;
    }
  }
}

TEST_CASE("on_each_device calls every device once, on its thread or the caller's, and reports failures as a step does",
          "[host][dp]") {
  wide<float> m({8, 3}, 4, 1);
  dpl::data_parallel<wide<float>> dp(m, dpl::host::devices(3));
  std::vector<std::thread::id> step_thread(3), call_thread(3);
  std::vector<int> calls(3, 0);
  std::vector<std::size_t> count(3, 0);
  auto const x = rows_of(6, 0);
  auto const step = [&] {
    dp.step(dpl::tensor_view<float const>(x.data(), 6, 6),
            [&](wide<float>& r, dpl::tensor_view<float const> s, dpl::step_context& ctx) {
              step_thread[static_cast<std::size_t>(ctx.replica())] = std::this_thread::get_id();
              r.fill_gradients(s);
            });
  };
  step();
  dp.on_each_device([&](std::size_t k, std::size_t n) {
    ++calls[k];
    count[k] = n;
    call_thread[k] = std::this_thread::get_id();
  });
  CHECK(calls == std::vector<int>{1, 1, 1});
  CHECK(count == std::vector<std::size_t>{3, 3, 3});
  // Device k's call runs on its thread, or (not started there when the caller was done with its
  // own) on the calling thread, as a step's work does.
  auto const here = std::this_thread::get_id();
  CHECK(call_thread[0] == here);
  CHECK(step_thread[0] == here);
  for (std::size_t k = 1; k < 3; ++k) {
    CHECK(step_thread[k] != here);
    CHECK((call_thread[k] == step_thread[k] || call_thread[k] == here));
  }

  std::vector<int> finished(3, 0);
  try {
    dp.on_each_device([&](std::size_t k, std::size_t) {
      if (k == 1) throw std::runtime_error("stripe update failed");
      finished[k] = 1;
    });
    FAIL("expected a device_error");
  } catch (dpl::device_error const& e) {
    CHECK(e.device() == 1);
    CHECK_THAT(e.what(), Catch::Matchers::Contains("stripe update failed"));
  }
  CHECK(finished == std::vector<int>{1, 0, 1});  // the others ran to completion before the throw
  step();  // the wrapper stays usable
  std::fill(calls.begin(), calls.end(), 0);
  dp.on_each_device([&](std::size_t k, std::size_t) { ++calls[k]; });
  CHECK(calls == std::vector<int>{1, 1, 1});
}

namespace {

/// `steps` DP steps over n devices with `rule` stepped through the wrapper, against the same rule
/// stepped on one thread over a copy of the model given the master's reduced gradients: the
/// parameters, the rule's state and the master copies after every step, bitwise.
template <class T, class Rule>
void update_matches_one_thread(Rule const& rule, int n, optim::optimizer_options o = {}) {
  wide<T> m(big, 16, 3);
  wide<T> ref = m;
  dpl::data_parallel<wide<T>> dp(m, dpl::host::devices(n));
  optim::optimizer opt(dp, rule, o);
  optim::optimizer one(ref, rule, o);
  for (int t = 1; t <= 4; ++t) {
    auto const x = rows_of(static_cast<std::size_t>(3 * n), t);
    dp.step(dpl::tensor_view<float const>(x.data(), x.size(), x.size()),
            [](wide<T>& r, dpl::tensor_view<float const> s) { r.fill_gradients(s); });
    ref.g = m.g;
    double const lr = 0.01 * t;
    opt.step(dp, lr);
    one.step(ref, lr);
    INFO("step " << t);
    CHECK(snapshot(m) == snapshot(ref));
    for (std::size_t i = 0; i < big.size(); ++i) {
      for (std::size_t k = 0; k < one.slots_kept(); ++k)
        CHECK(std::memcmp(opt.slot(i, k).data(), one.slot(i, k).data(), big[i] * sizeof(float)) == 0);
      if (one.has_master(i))
        CHECK(std::memcmp(opt.master(i).data(), one.master(i).data(), big[i] * sizeof(float)) == 0);
    }
  }
  CHECK(opt.steps() == 4);
  wide<T> start(big, 16, 3);
  CHECK(snapshot(m) != snapshot(start));
}

}  // namespace

TEST_CASE("an optimizer stepped through DataParallel updates the master on the devices as one thread does",
          "[host][dp][optim][contract]") {
  for (int n : {2, 3}) {
    INFO(n << " devices");
    update_matches_one_thread<float>(optim::sgd(), n);
    update_matches_one_thread<float>(optim::sgd({.momentum = 0.9, .weight_decay = 1e-3}), n);
    update_matches_one_thread<float>(optim::sgd({.momentum = 0.9, .nesterov = true}), n);
    update_matches_one_thread<float>(optim::adam({.weight_decay = 1e-2}), n);
    update_matches_one_thread<float>(optim::adamw(), n);
    update_matches_one_thread<dpl::bf16>(optim::adamw(), n, {.master_weights = true});
    update_matches_one_thread<dpl::bf16>(optim::sgd({.momentum = 0.8, .dampening = 0.1}), n, {.master_weights = true});
  }
}

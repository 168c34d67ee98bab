#pragma once
// DataParallel contracts, written once against a backend and instantiated per backend (the host
// backend in test_dp.cpp; the CUDA backend instantiates the same functions).
#include "models.hpp"

#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <vector>

namespace test {

template <class Backend>
std::vector<dparallel::device> devices(int n);

template <>
inline std::vector<dparallel::device> devices<dparallel::host::backend>(int n) {
  return dparallel::host::devices(n);
}

/// The one-device reference: the gradient of the mean loss over the whole batch.
template <class T>
linreg<T> reference_step(linreg<T> model, samples<T> const& batch) {
  model.forward_backward(batch);
  return model;
}

/// DP over n devices on a batch of b samples gives the one-device gradient; replicas run only
/// for non-empty chunks; the outputs are gathered in batch order.
template <class Backend, class T>
void check_same_gradients(int n, std::size_t b, bool exact, dparallel::options opts = {}) {
  INFO("devices = " << n << ", batch = " << b << ", exact = " << exact);
  auto const data = dataset<T>::make(b, 4, 1000 * static_cast<std::uint64_t>(n) + b, exact);
  linreg<T> master(4, 7);
  auto const ref = reference_step(master, data.all());

  dparallel::parallel<linreg<T>, dparallel::dp, Backend> wrapped(master, devices<Backend>(n), opts);
  // Written by the replicas' threads (one slot each), checked here: Catch2 asserts on one thread.
  std::vector<int> calls(static_cast<std::size_t>(n), 0);
  std::vector<std::size_t> seen_rows(static_cast<std::size_t>(n), 0), told_rows(static_cast<std::size_t>(n), 0);
  auto losses = wrapped.step(data.all(), [&](linreg<T>& m, samples<T> shard, dparallel::step_context& ctx) {
    auto const slot = static_cast<std::size_t>(ctx.replica());
    ++calls[slot];
    seen_rows[slot] = shard.x.rows();
    told_rows[slot] = ctx.shard_size();
    return m.forward_backward(shard);
  });
  CHECK(seen_rows == told_rows);
  auto const& sizes = wrapped.last_shard_sizes();
  std::size_t used = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CHECK(calls[i] == (sizes[i] != 0 ? 1 : 0));
    used += sizes[i] != 0;
  }
  CHECK(losses.size() == used);

  auto const got = flat(master, true);
  auto const want = flat(const_cast<linreg<T>&>(ref), true);
  if (exact) {
    CHECK(got == want);
  } else {
    CHECK(rel_error(got, want) <= 1e-6);
  }
  // Gathered per-sample outputs equal the one-device outputs, in batch order.
  auto preds = wrapped.step(data.all(), [](linreg<T>& m, samples<T> shard) {
    m.forward_backward(shard);
    return m.predict(shard);
  });
  CHECK(preds == master.predict(data.all()));
  // Replicas that ran hold the master's parameters (replicated before the step).
  for (std::size_t i = 0; i < sizes.size(); ++i)
    if (sizes[i] != 0) CHECK(same_bits(const_cast<linreg<T>&>(wrapped.replica(i)), master));
}

/// Training twice with the same seed gives bitwise-identical parameters.
template <class Backend, class T>
std::vector<double> train_steps(int n, int steps) {
  linreg<T> master(8, 3);
  dparallel::parallel<linreg<T>, dparallel::dp, Backend> wrapped(master, devices<Backend>(n));
  for (int s = 0; s < steps; ++s) {
    auto const data = dataset<T>::make(37 + static_cast<std::size_t>(s), 8, 99 + static_cast<std::uint64_t>(s), false);
    wrapped.step(data.all(), [](linreg<T>& m, samples<T> shard) { return m.forward_backward(shard); });
    wrapped.module().sgd(T(0.05));
  }
  return flat(master, false);
}

}  // namespace test

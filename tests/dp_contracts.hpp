#pragma once
// DataParallel contracts, written once against a backend and instantiated per backend: the host
// backend in test_dp.cpp, the CUDA backend in cuda/test_cuda.cu. A backend's test supplies
// model_of<Backend, T> (a linreg-like model whose memory lives on that backend) and
// read_back<Backend> (a tensor's bytes, copied to the host).
#include "models.hpp"

#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstring>
#include <vector>

namespace test {

template <class Backend>
std::vector<dparallel::device> devices(int n);

template <>
inline std::vector<dparallel::device> devices<dparallel::host::backend>(int n) {
  return dparallel::host::devices(n);
}

/// The model type the contracts use on `Backend` (interface of linreg<T>).
template <class Backend, class T>
struct model_of {
  using type = linreg<T>;
};

/// The bytes of `t`, on the host.
template <class Backend>
std::vector<std::byte> read_back(dparallel::tensor_ref t) {
  std::vector<std::byte> out(t.size_bytes());
  if (!out.empty()) std::memcpy(out.data(), t.data(), out.size());
  return out;
}

/// All parameters (or gradients) of `m` as doubles, read back from the backend.
template <class Backend, class M>
std::vector<double> flat_on(M& m, bool grads) {
  std::vector<double> out;
  for (auto const& t : grads ? dparallel::gradient_refs(m) : dparallel::parameter_refs(m)) {
    auto const bytes = read_back<Backend>(t);
    if (t.dtype() == dparallel::dtype::f32) {
      std::vector<float> v(t.size());
      std::memcpy(v.data(), bytes.data(), bytes.size());
      out.insert(out.end(), v.begin(), v.end());
    } else {
      std::vector<double> v(t.size());
      std::memcpy(v.data(), bytes.data(), bytes.size());
      out.insert(out.end(), v.begin(), v.end());
    }
  }
  return out;
}

/// Bitwise equality of every parameter of `a` and `b`, read back from the backend.
template <class Backend, class M>
bool same_bits_on(M& a, M& b) {
  auto pa = dparallel::parameter_refs(a), pb = dparallel::parameter_refs(b);
  if (pa.size() != pb.size()) return false;
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (read_back<Backend>(pa[i]) != read_back<Backend>(pb[i])) return false;
  return true;
}

/// The one-device reference: the gradient of the mean loss over the whole batch.
template <class M, class T>
M reference_step(M model, samples<T> const& batch) {
  model.forward_backward(batch);
  return model;
}

/// DP over n devices on a batch of b samples gives the one-device gradient; replicas run only
/// for non-empty chunks; the outputs are gathered in batch order.
template <class Backend, class T, class Semantics = dparallel::dp>
void check_same_gradients(int n, std::size_t b, bool exact, dparallel::options opts = {}) {
  using model = typename model_of<Backend, T>::type;
  INFO("devices = " << n << ", batch = " << b << ", exact = " << exact);
  auto const data = dataset<T>::make(b, 4, 1000 * static_cast<std::uint64_t>(n) + b, exact);
  model master(4, 7);
  model ref = reference_step(master, data.all());

  dparallel::parallel<model, Semantics, Backend> wrapped(master, devices<Backend>(n), opts);
  // Written by the replicas' threads (one slot each), checked here: Catch2 asserts on one thread.
  std::vector<int> calls(static_cast<std::size_t>(n), 0);
  std::vector<std::size_t> seen_rows(static_cast<std::size_t>(n), 0), told_rows(static_cast<std::size_t>(n), 0);
  auto losses = wrapped.step(data.all(), [&](model& m, samples<T> shard, dparallel::step_context& ctx) {
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

  auto const got = flat_on<Backend>(master, true);
  auto const want = flat_on<Backend>(ref, true);
  if (exact) {
    CHECK(got == want);
  } else {
    CHECK(rel_error(got, want) <= 1e-6);
  }
  // Gathered per-sample outputs equal the one-device outputs, in batch order.
  auto preds = wrapped.step(data.all(), [](model& m, samples<T> shard) {
    m.forward_backward(shard);
    return m.predict(shard);
  });
  CHECK(preds == master.predict(data.all()));
  // Replicas that ran hold the master's parameters (replicated before the step).
  for (std::size_t i = 0; i < sizes.size(); ++i)
    if (sizes[i] != 0) CHECK(same_bits_on<Backend>(wrapped.replica(i), master));
}

/// Training twice with the same seed gives bitwise-identical parameters.
template <class Backend, class T>
std::vector<double> train_steps(int n, int steps) {
  using model = typename model_of<Backend, T>::type;
  model master(8, 3);
  dparallel::parallel<model, dparallel::dp, Backend> wrapped(master, devices<Backend>(n));
  for (int s = 0; s < steps; ++s) {
    auto const data = dataset<T>::make(37 + static_cast<std::size_t>(s), 8, 99 + static_cast<std::uint64_t>(s), false);
    wrapped.step(data.all(), [](model& m, samples<T> shard) { return m.forward_backward(shard); });
    wrapped.module().sgd(T(0.05));
  }
  return flat_on<Backend>(master, false);
}

}  // namespace test

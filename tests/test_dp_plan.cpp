// DataParallel's copy and reduce plans (core/dp_plan.hpp), on the host:
// - the pure plans: per_device (the CUDA backend's layout) has each replica pull every tensor
//   whole, once, on its own stream, and each device sum one contiguous slice of every gradient;
//   stripes (the host backend's) cover every element of every replica exactly once;
// - the policies follow the backend's layout: a recording fake backend that declares per_device
//   sees, over 2, 3 and 4 devices, which stream issues which copy and which sums, and every copy
//   has the issuing stream's device as an endpoint; its gradients are the host backend's bits.
#include "models.hpp"

#include <dparallel/core/dp_plan.hpp>
#include <dparallel/dparallel.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <map>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

namespace dpl = dparallel;

namespace {

/// Tensors of the given sizes (f32, then one f64), backed by storage the caller keeps.
struct tensors {
  std::vector<std::vector<float>> f;
  std::vector<double> d;
  std::vector<dpl::tensor_ref> refs;
  explicit tensors(std::vector<std::size_t> const& sizes) : d(70000) {
    for (std::size_t n : sizes) f.emplace_back(n);
    for (auto& v : f) refs.emplace_back(dpl::view(v));
    refs.emplace_back(dpl::view(d));
  }
};

std::vector<dpl::detail::replica_copy> copies_of(dpl::dp_sharing how, std::size_t m, std::size_t k,
                                                  std::span<dpl::tensor_ref const> t) {
  std::vector<dpl::detail::replica_copy> out;
  dpl::detail::plan_replica_copies(how, m, k, t, [&](dpl::detail::replica_copy const& c) { out.push_back(c); });
  return out;
}

std::vector<dpl::detail::reduce_slice> slices_of(dpl::dp_sharing how, std::size_t m, std::size_t k,
                                                  std::span<dpl::tensor_ref const> t) {
  std::vector<dpl::detail::reduce_slice> out;
  dpl::detail::plan_reduce(how, m, k, t, [&](dpl::detail::reduce_slice const& r) { out.push_back(r); });
  return out;
}

}  // namespace

TEST_CASE("DP plan per_device: each replica pulls every tensor whole, once, on its own stream",
          "[dp][plan][contract]") {
  tensors const t({0, 1, 700, 40000, 300000});
  std::span<dpl::tensor_ref const> const refs(t.refs);
  for (std::size_t m = 2; m <= 4; ++m) {
    CAPTURE(m);
    CHECK(copies_of(dpl::dp_sharing::per_device, m, 0, refs).empty());  // the master copies nothing
    for (std::size_t k = 1; k < m; ++k) {
      auto const c = copies_of(dpl::dp_sharing::per_device, m, k, refs);
      REQUIRE(c.size() == refs.size() - 1);  // every non-empty tensor, once
      for (std::size_t i = 0; i < c.size(); ++i) {
        CHECK(c[i].on == k);
        CHECK(c[i].to == k);  // endpoints: the master's device and the issuing stream's
        CHECK(c[i].tensor == i + 1);
        CHECK(c[i].lo == 0);
        CHECK(c[i].hi == refs[c[i].tensor].size());
      }
      CHECK(dpl::detail::replica_copies_touch(dpl::dp_sharing::per_device, k, 0));  // the master waits
      for (std::size_t a = 1; a < m; ++a) CHECK_FALSE(dpl::detail::replica_copies_touch(dpl::dp_sharing::per_device, k, a));
    }
  }
}

TEST_CASE("DP plan per_device: each device sums one contiguous slice of every gradient, together all of it",
          "[dp][plan][contract]") {
  tensors const t({0, 1, 3, 700, 40000, 300000});
  std::span<dpl::tensor_ref const> const refs(t.refs);
  for (std::size_t m = 1; m <= 4; ++m) {
    CAPTURE(m);
    std::vector<std::size_t> covered(refs.size(), 0);
    for (std::size_t k = 0; k < m; ++k) {
      std::vector<std::size_t> per_tensor(refs.size(), 0);
      for (auto const& r : slices_of(dpl::dp_sharing::per_device, m, k, refs)) {
        CHECK(r.on == k);
        CHECK(r.lo == covered[r.tensor]);  // the slices follow each other in device order
        CHECK(r.hi > r.lo);
        covered[r.tensor] = r.hi;
        ++per_tensor[r.tensor];
      }
      for (std::size_t c : per_tensor) CHECK(c <= 1);
    }
    for (std::size_t p = 0; p < refs.size(); ++p) CHECK(covered[p] == refs[p].size());
  }
}

TEST_CASE("DP plan stripes: every element of every replica is copied once, and summed once",
          "[dp][plan][contract]") {
  tensors const t({0, 1, 700, 40000, 300000});
  std::span<dpl::tensor_ref const> const refs(t.refs);
  for (std::size_t m = 2; m <= 4; ++m) {
    CAPTURE(m);
    // count[to][tensor][element]
    std::vector<std::vector<std::vector<int>>> count(m);
    for (auto& per : count)
      for (auto const& r : refs) per.emplace_back(r.size(), 0);
    std::size_t big = 0;  // copies of the 300000-element tensor into replica 1
    for (std::size_t k = 0; k < m; ++k)
      for (auto const& c : copies_of(dpl::dp_sharing::stripes, m, k, refs)) {
        CHECK(c.on == k);
        CHECK(c.to != 0);
        for (std::size_t e = c.lo; e < c.hi; ++e) ++count[c.to][c.tensor][e];
        if (c.tensor == 4 && c.to == 1) ++big;
      }
    for (std::size_t a = 1; a < m; ++a)
      for (auto const& per : count[a])
        for (int n : per) CHECK(n == 1);
    // A large tensor is cut into stripes of 64 KiB or more: 16 copies or more into each replica where
    // per_device makes one (what a GPU must not do).
    CHECK(big >= 16);
    std::vector<std::vector<int>> summed;
    for (auto const& r : refs) summed.emplace_back(r.size(), 0);
    for (std::size_t k = 0; k < m; ++k)
      for (auto const& r : slices_of(dpl::dp_sharing::stripes, m, k, refs))
        for (std::size_t e = r.lo; e < r.hi; ++e) ++summed[r.tensor][e];
    for (auto const& per : summed)
      for (int n : per) CHECK(n == 1);
  }
}

namespace {

/// A host backend that declares the CUDA backend's layout and records what the policies ask of
/// it: which stream issues which copy and which sums.
struct recording_backend : dpl::host::backend {
  static constexpr dpl::dp_sharing dp_share = dpl::dp_sharing::per_device;
  struct copy_call {
    int stream;
    std::vector<std::pair<dpl::tensor_ref, dpl::tensor_ref>> copies;  // (dst, src)
  };
  struct sum_call {
    int stream;
    std::vector<dpl::tensor_ref> dst;
  };
  static inline std::mutex m;
  static inline std::vector<copy_call> copy_calls;
  static inline std::vector<sum_call> sum_calls;

  using dpl::host::backend::copy_all;
  using dpl::host::backend::weighted_sum;
  static event_type copy_all(stream_type& s, std::span<dpl::tensor_ref const> dst, std::span<dpl::tensor_ref const> src) {
    {
      std::lock_guard lock(m);
      copy_call c{s.device_index(), {}};
      for (std::size_t i = 0; i < dst.size(); ++i) c.copies.emplace_back(dst[i], src[i]);
      copy_calls.push_back(std::move(c));
    }
    return dpl::host::backend::copy_all(s, dst, src);
  }
  static event_type weighted_sum(stream_type& s, std::span<dpl::tensor_ref const> dst,
                                 std::span<dpl::tensor_ref const> srcs, std::span<double const> w) {
    {
      std::lock_guard lock(m);
      sum_calls.push_back({s.device_index(), {dst.begin(), dst.end()}});
    }
    return dpl::host::backend::weighted_sum(s, dst, srcs, w);
  }
};
static_assert(dpl::detail::dp_sharing_of<recording_backend>() == dpl::dp_sharing::per_device);
static_assert(dpl::detail::dp_sharing_of<dpl::host::backend>() == dpl::dp_sharing::stripes);

/// Where a pointer lies: (device, tensor index in parameters then buffers, element offset).
struct place {
  int device = -1;
  std::size_t tensor = 0, offset = 0;
};
template <class Wrapped>
place locate(Wrapped const& w, std::size_t devices, void const* p) {
  for (std::size_t d = 0; d < devices; ++d) {
    auto const& r = w.replica(d);
    std::vector<std::pair<float const*, std::size_t>> ts;
    for (auto const& v : r.w) ts.emplace_back(v.data(), v.size());
    ts.emplace_back(r.stats.data(), r.stats.size());
    for (std::size_t t = 0; t < ts.size(); ++t) {
      auto const* f = static_cast<float const*>(p);
      if (f >= ts[t].first && f < ts[t].first + ts[t].second)
        return {static_cast<int>(d), t, static_cast<std::size_t>(f - ts[t].first)};
    }
  }
  return {};
}

}  // namespace

TEST_CASE("DP on a per_device backend: each replica's stream pulls its tensors whole, one slice per device and "
          "gradient, the host backend's bits",
          "[dp][plan][contract]") {
  using model = test::chunked<float>;
  std::vector<std::size_t> const sizes{700, 3, 1, 40000, 129};
  for (int n = 2; n <= 4; ++n) {
    for (std::size_t batch : {std::size_t{10}, std::size_t{2}}) {  // 2: some replicas get no shard
      CAPTURE(n, batch);
      model host_master(sizes, 5), rec_master(sizes, 5);
      dpl::data_parallel<model> host(host_master, dpl::host::devices(n));
      dpl::parallel<model, dpl::dp, recording_backend> rec(rec_master, dpl::host::devices(n));
      std::size_t const active = std::min<std::size_t>(batch, static_cast<std::size_t>(n));
      auto fn = [](model& m, test::samples<float> s) { return m.forward_backward(s); };
      for (int step = 0; step < 2; ++step) {
        recording_backend::copy_calls.clear();
        recording_backend::sum_calls.clear();
        auto const data = test::dataset<float>::make(batch, host_master.dim, 40 + static_cast<std::uint64_t>(step), false);
        auto const a = host.step(data.all(), fn);
        auto const b = rec.step(data.all(), fn);
        CHECK(a == b);
        for (std::size_t p = 0; p < sizes.size(); ++p)
          CHECK(std::memcmp(host_master.g[p].data(), rec_master.g[p].data(), sizes[p] * sizeof(float)) == 0);
        // Copies: one call per replica that runs a shard, on its own stream, one copy per tensor
        // (parameters and the buffer), whole, from the master's same tensor into its own.
        REQUIRE(recording_backend::copy_calls.size() == active - 1);
        std::vector<int> streams;
        for (auto const& call : recording_backend::copy_calls) {
          streams.push_back(call.stream);
          REQUIRE(call.copies.size() == sizes.size() + 1);
          for (std::size_t t = 0; t < call.copies.size(); ++t) {
            auto const [dst, src] = call.copies[t];
            place const to = locate(rec, static_cast<std::size_t>(n), dst.data());
            place const from = locate(rec, static_cast<std::size_t>(n), src.data());
            CHECK(to.device == call.stream);  // an endpoint is the issuing stream's device
            CHECK(from.device == 0);
            CHECK((to.tensor == t && from.tensor == t && to.offset == 0 && from.offset == 0));
            CHECK(dst.size() == (t < sizes.size() ? sizes[t] : 1));
          }
        }
        std::sort(streams.begin(), streams.end());
        for (std::size_t i = 0; i < streams.size(); ++i) CHECK(streams[i] == static_cast<int>(i + 1));
        // Sums: one call per device that ran a shard, one contiguous slice of each gradient.
        REQUIRE(recording_backend::sum_calls.size() == active);
        std::map<int, std::size_t> by_stream;
        for (auto const& call : recording_backend::sum_calls) {
          ++by_stream[call.stream];
          std::size_t per_tensor_max = 0;
          std::map<float const*, std::size_t> slices;  // gradient start -> slices in this call
          for (auto const& d : call.dst)
            for (std::size_t p = 0; p < sizes.size(); ++p) {
              float const* g = rec_master.g[p].data();
              auto const* x = static_cast<float const*>(d.data());
              if (x >= g && x < g + sizes[p]) per_tensor_max = std::max(per_tensor_max, ++slices[g]);
            }
          CHECK(per_tensor_max == 1);
        }
        CHECK(by_stream.size() == active);
      }
    }
  }
}

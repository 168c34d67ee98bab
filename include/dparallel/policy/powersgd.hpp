#pragma once
// The PowerSGD communication hook (Vogels et al., 2019), in the form of PyTorch's
// batched_powerSGD_hook with PowerSGDState's options: each F32 bucket (host memory) of n elements
// is viewed as a side x side matrix M (side = ceil(sqrt(n)), zero-padded, row-major) and replaced
// by a rank-r approximation computed with one power-iteration step:
//   1. error feedback: M += the bucket's error of the previous compressed step;
//   2. Q (side x r): with warm start the previous step's Q, else (and the first time) a fresh
//      pseudo-random matrix drawn from `seed`, the bucket index and the step (the same on every
//      rank), orthogonalised;
//   3. P = M Q, all-reduced (sum); P orthogonalised (Gram-Schmidt, column by column);
//   4. Q = M^T P, all-reduced (avg);
//   5. M' = P Q^T becomes the bucket; with error feedback the error becomes M - M'.
// The first `start_iter` synchronised steps (counted from the hook's registration) all-reduce the
// bucket uncompressed (plain average). Error and Q are kept per bucket index: with error feedback
// or warm start, start_iter must be at least 1, so that compression starts after DDP re-planned
// its buckets (after the first step). Every product is computed in float in a fixed order, so the
// result is deterministic given the seed, and identical on every rank. The wire carries
// 2 * side * r floats per bucket instead of n.
//
//   ddp.reducer().register_comm_hook(dparallel::powersgd_state{.rank = 2, .start_iter = 10}, dparallel::powersgd);

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/comm_hook.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// What powersgd keeps for one bucket between steps.
struct powersgd_bucket {
  /// The bucket's error of the last compressed step (error feedback), padded to side * side.
  std::vector<float> error{};
  /// The last Q (side x rank, row-major), for warm start.
  std::vector<float> q{};
  /// P of the step in flight (side x rank, row-major).
  std::vector<float> p{};
  /// The bucket as a padded side x side matrix, for the step in flight.
  std::vector<float> m{};
};

/// The options and state of the powersgd hook (PyTorch's PowerSGDState).
struct powersgd_state {
  /// The approximation's rank r: at least 1, at most the side of the bucket's square matrix.
  std::size_t rank = 1;
  /// Synchronised steps all-reduced uncompressed before compression starts.
  std::size_t start_iter = 10;
  /// Carry each bucket's approximation error into its next compressed step.
  bool error_feedback = true;
  /// Start each power iteration from the previous step's Q (else from a fresh random Q).
  bool warm_start = true;
  /// Seeds the random Q matrices.
  std::uint64_t seed = 0;
  /// Synchronised steps seen so far (counted at bucket 0).
  std::size_t iter = 0;
  /// Per bucket index (a deque: a bucket's state stays where it is while later ones are added).
  std::deque<powersgd_bucket> buckets{};
};

namespace detail {

/// Orthonormalises the r columns of the side x r row-major matrix `a` in place (Gram-Schmidt,
/// column by column, in a fixed order); a zero column stays zero.
inline void orthogonalize_columns(std::vector<float>& a, std::size_t side, std::size_t r) {
  for (std::size_t j = 0; j < r; ++j) {
    float norm2 = 0;
    for (std::size_t i = 0; i < side; ++i) norm2 += a[i * r + j] * a[i * r + j];
    float const norm = std::sqrt(norm2);
    if (norm > 0)
      for (std::size_t i = 0; i < side; ++i) a[i * r + j] /= norm;
    for (std::size_t k = j + 1; k < r; ++k) {
      float dot = 0;
      for (std::size_t i = 0; i < side; ++i) dot += a[i * r + j] * a[i * r + k];
      for (std::size_t i = 0; i < side; ++i) a[i * r + k] -= dot * a[i * r + j];
    }
  }
}

/// A value in [-1, 1) from (seed, a, b, i): splitmix64.
inline float powersgd_random(std::uint64_t seed, std::uint64_t a, std::uint64_t b, std::uint64_t i) {
  std::uint64_t z = seed ^ (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xC2B2AE3D27D4EB4Full) ^ (i * 0x165667B19E3779F9ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0);
}

/// The powersgd hook; see the top of policy/powersgd.hpp.
struct powersgd_hook {
  /// Starts bucket `b`'s compressed (or, before start_iter, plain) average over `g`.
  bucket_future operator()(powersgd_state& st, process_group const& g, grad_bucket const& b) const {
    require(b.data.dtype() == dtype::f32 && (b.data.size() == 0 || b.data.device().kind == device_kind::host), [&] {
      return "powersgd: expected an F32 gradient bucket in host memory, found " + std::string(name_of(b.data.dtype())) +
             " on " + to_string(b.data.device()) + " (bucket " + std::to_string(b.index) + ")";
    });
    require(st.start_iter >= 1 || (!st.error_feedback && !st.warm_start),
            "powersgd: expected start_iter >= 1 with error feedback or warm start (DDP re-plans its buckets after "
            "the first step, and the state is kept per bucket), found 0");
    std::size_t const n = b.data.size();
    std::size_t side = 0;
    while (side * side < n) ++side;
    require(st.rank >= 1 && (n == 0 || st.rank <= side), [&] {
      return "powersgd: expected a rank between 1 and " + std::to_string(side) + " (bucket " + std::to_string(b.index) +
             ": " + std::to_string(n) + " elements, a " + std::to_string(side) + " x " + std::to_string(side) +
             " matrix), found " + std::to_string(st.rank);
    });
    if (b.index == 0 && st.buckets.size() > 0) ++st.iter;  // a new synchronised step
    if (st.buckets.size() <= b.index) st.buckets.resize(b.index + 1);
    if (st.iter < st.start_iter || n == 0) return bucket_future(g.all_reduce(b.data, reduce_op::avg), b.data);

    std::size_t const r = st.rank;
    auto& s = st.buckets[b.index];
    auto const* x = static_cast<float const*>(b.data.data());
    s.m.assign(side * side, 0.0f);
    for (std::size_t i = 0; i < n; ++i) s.m[i] = x[i];
    if (st.error_feedback) {
      if (s.error.size() != side * side) s.error.assign(side * side, 0.0f);
      for (std::size_t i = 0; i < side * side; ++i) s.m[i] += s.error[i];
    }
    if (!st.warm_start || s.q.size() != side * r) {
      s.q.resize(side * r);
      for (std::size_t i = 0; i < side * r; ++i) s.q[i] = powersgd_random(st.seed, b.index, st.iter, i);
      orthogonalize_columns(s.q, side, r);
    }
    s.p.assign(side * r, 0.0f);
    multiply(s.m, s.q, s.p, side, r, false);
    work const wp = g.all_reduce(tensor_ref(s.p.data(), s.p.size(), dtype::f32, host_memory), reduce_op::sum);
    tensor_ref const out = b.data;
    bool const feedback = st.error_feedback;
    return bucket_future(wp, [&s, g, out, n, side, r, feedback] {
      orthogonalize_columns(s.p, side, r);
      multiply(s.m, s.p, s.q, side, r, true);  // Q = M^T P
      g.all_reduce(tensor_ref(s.q.data(), s.q.size(), dtype::f32, host_memory), reduce_op::avg).wait();
      auto* y = static_cast<float*>(out.data());
      for (std::size_t i = 0; i < side; ++i) {
        for (std::size_t j = 0; j < side; ++j) {
          float v = 0;
          for (std::size_t k = 0; k < r; ++k) v += s.p[i * r + k] * s.q[j * r + k];
          std::size_t const at = i * side + j;
          if (feedback) s.error[at] = s.m[at] - v;
          if (at < n) y[at] = v;
        }
      }
      return out;
    });
  }

  /// out (side x r) = M a (transposed: M^T a), a side x r, M side x side, all row-major.
  static void multiply(std::vector<float> const& m, std::vector<float> const& a, std::vector<float>& out,
                       std::size_t side, std::size_t r, bool transposed) {
    for (auto& v : out) v = 0.0f;
    for (std::size_t i = 0; i < side; ++i) {
      for (std::size_t k = 0; k < side; ++k) {
        float const mik = m[i * side + k];  // M[i][k]
        if (!transposed) {
          for (std::size_t j = 0; j < r; ++j) out[i * r + j] += mik * a[k * r + j];
        } else {  // (M^T a)[k][j] += M[i][k] * a[i][j]
          for (std::size_t j = 0; j < r; ++j) out[k * r + j] += mik * a[i * r + j];
        }
      }
    }
  }
};

}  // namespace detail

/// The PowerSGD hook (state: powersgd_state).
inline constexpr detail::powersgd_hook powersgd{};

DPARALLEL_NAMESPACE_END

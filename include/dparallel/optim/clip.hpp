#pragma once
// Global-norm gradient clipping, torch.nn.utils.clip_grad_norm_'s semantics: the total norm of all
// gradients together (as if concatenated into one vector), of type 2 or infinity; when it exceeds
// max_norm every gradient is scaled by max_norm / (total_norm + 1e-6); the total norm is returned.
//
//   ddp.step(batch, step_fn);                                  // gradients reduced
//   double norm = dparallel::optim::clip_grad_norm(ddp, 1.0);  // clips module()'s gradients
//   opt.step(ddp, lr);
//
// Where the gradients are. One device, DP (module() holds the reduced gradients) and DDP (every
// rank holds the same reduced gradients, so every rank computes the same norm with no
// communication): clip_grad_norm(model_or_wrapper, max_norm). A rank that holds only a shard of
// the gradients (ZeRO-1): clip_grad_norm_sharded(shard, group, max_norm) computes its partial
// (sum of squares, or largest magnitude), exchanges one f64 per rank in ONE collective (an
// all_gather: the ranks combine the partials in rank order, so every rank gets the same bits),
// and scales its shard.
//
// Arithmetic. Squares are accumulated in f64 (each f32 square is exact in f64), element by element
// in order, tensor by tensor; a sharded norm adds the ranks' partials in rank order. The infinity
// norm is exact and the same however the gradients are split. The 2-norm of a sharded computation
// differs from the unsharded one only by the f64 rounding of a different summation order: relative
// difference below n * 2^-53 for n elements, invisible after the f32 rounding of the clip
// coefficient except on a rounding boundary (then the gradients differ by one f32 ulp).
//
// Differences from PyTorch: error_if_nonfinite is true by default (PyTorch's default is false):
// a NaN or infinite norm throws before any gradient changes, naming what was found (with false,
// the gradients are scaled by the NaN or zero coefficient, as PyTorch does); and the coefficient
// multiplies the gradients only when it is below 1 (PyTorch multiplies by the coefficient clamped
// to 1, which leaves the same bits).

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/optim/element.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

/// Options of clip_grad_norm.
struct clip_options {
  /// 2 (Euclidean) or std::numeric_limits<double>::infinity() (largest magnitude).
  double norm_type = 2.0;
  /// Throw when the total norm is NaN or infinite (nothing is scaled then).
  bool error_if_nonfinite = true;
};

namespace detail {

inline bool is_inf_norm(clip_options const& o, char const* who) {
  bool const inf = std::isinf(o.norm_type) && o.norm_type > 0;
  if (!inf && o.norm_type != 2.0)
    throw invalid_argument(std::string("dparallel: ") + who + ": expected norm_type 2 or infinity, found " +
                           shortest(o.norm_type));
  return inf;
}

inline void check_max_norm(double max_norm, char const* who) {
  if (!(max_norm >= 0) || std::isnan(max_norm))
    throw invalid_argument(std::string("dparallel: ") + who + ": expected max_norm >= 0, found " + shortest(max_norm));
}

/// The partial over `grads`: the f64 sum of squares (2-norm) or the largest magnitude (infinity),
/// element by element in order. NaN propagates.
inline double norm_partial(std::span<tensor_ref const> grads, bool inf, char const* who) {
  double acc = 0;
  auto add = [&](auto const& v) {
    for (auto x : v) {
      double const d = static_cast<double>(x);
      if (inf) acc = (std::isnan(d) || std::isnan(acc)) ? std::numeric_limits<double>::quiet_NaN()
                                                        : std::max(acc, std::fabs(d));
      else acc += d * d;
    }
  };
  for (auto const& g : grads) {
    if (g.device().kind != device_kind::host)
      throw invalid_argument(std::string("dparallel: ") + who + ": a gradient is in " + to_string(g.device()) +
                             " memory; clip_grad_norm handles host memory");
    if (g.dtype() == dtype::f32) add(g.as<float>());
    else if (g.dtype() == dtype::f64) add(g.as<double>());
    else
      throw invalid_argument(std::string("dparallel: ") + who + ": expected f32 or f64 gradients, found " +
                             std::string(name_of(g.dtype())));
  }
  return acc;
}

/// Checks the total, scales `grads` when it exceeds max_norm, returns it.
inline double finish_clip(std::span<tensor_ref const> grads, double total, double max_norm, clip_options const& o,
                          char const* who) {
  if (o.error_if_nonfinite && !std::isfinite(total))
    throw error(std::string("dparallel: ") + who + ": the total norm of the gradients is " + shortest(total) +
                " (not finite); no gradient was changed. Look for a NaN or infinite gradient, or pass "
                "{.error_if_nonfinite = false} to clip anyway");
  double const coef = max_norm / (total + 1e-6);
  if (!(coef >= 1)) {  // also a NaN coefficient, as PyTorch multiplies by it
    for (auto const& g : grads) {
      if (g.dtype() == dtype::f32) {
        auto const c = static_cast<float>(coef);
        for (float& x : g.as<float>()) x = mul(x, c);
      } else {
        for (double& x : g.as<double>()) x *= coef;
      }
    }
  }
  return total;
}

}  // namespace detail

/// Clips `grads` (host memory, f32 or f64) to a total norm of at most `max_norm`; returns the
/// total norm before clipping (see the top of optim/clip.hpp).
inline double clip_grad_norm(std::span<tensor_ref const> grads, double max_norm, clip_options const& o = {}) {
  char const* const who = "optim::clip_grad_norm";
  detail::check_max_norm(max_norm, who);
  bool const inf = detail::is_inf_norm(o, who);
  double const partial = detail::norm_partial(grads, inf, who);
  return detail::finish_clip(grads, inf ? partial : std::sqrt(partial), max_norm, o, who);
}

/// Clips the gradients of a model, or of a DP/DDP wrapper's module() (DP: the reduced gradients
/// on the master; DDP: this rank's reduced gradients, the same on every rank, so no collective).
template <class X>
  requires(!std::convertible_to<X&, std::span<tensor_ref const>>)
double clip_grad_norm(X& model_or_wrapper, double max_norm, clip_options const& o = {}) {
  static_assert(!detail::shards_gradients<X>,
                "dparallel: clip_grad_norm over a ddp_zero1 wrapper would clip this rank's own, unaveraged "
                "gradients: use clip_grad_norm_sharded with zero_redundancy_optimizer::gradient_shards()");
  auto const grads = gradient_refs(dparallel::detail::unwrap_model(model_or_wrapper));
  return clip_grad_norm(std::span<tensor_ref const>(grads), max_norm, o);
}

/// ZeRO-1: this rank holds `shard`, its part of the gradients (the ranks' shards together are every
/// gradient once). Computes the total norm over all ranks with one all_gather of one f64 per rank
/// (a collective: every rank of `group` must call it), combined in rank order, and scales this
/// rank's shard. Every rank returns the same bits and throws the same error.
inline double clip_grad_norm_sharded(std::span<tensor_ref const> shard, process_group const& group, double max_norm,
                                     clip_options const& o = {}) {
  char const* const who = "optim::clip_grad_norm_sharded";
  detail::check_max_norm(max_norm, who);
  bool const inf = detail::is_inf_norm(o, who);
  double partial = detail::norm_partial(shard, inf, who);
  std::vector<double> all(static_cast<std::size_t>(group.size()), 0.0);
  group.all_gather(tensor_ref(view(all)), tensor_ref(&partial, 1, dtype::f64, host_memory)).wait();
  double total = 0;
  for (double p : all) {
    if (inf) total = (std::isnan(p) || std::isnan(total)) ? std::numeric_limits<double>::quiet_NaN() : std::max(total, p);
    else total += p;
  }
  return detail::finish_clip(shard, inf ? total : std::sqrt(total), max_norm, o, who);
}

}  // namespace optim

DPARALLEL_NAMESPACE_END

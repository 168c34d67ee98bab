#pragma once
// Gradients laid out by DDP, as PyTorch's gradient_as_bucket_view makes `param.grad` views of
// its buckets. A model that accepts memory for its gradients,
//
//   void bind_gradients(dparallel::gradient_memory const& g);            // a member, or
//   static void model_traits<M>::bind_gradients(M&, gradient_memory const&);
//
// is given, by DDP with options::gradient_as_bucket_view, one block from the process group
// (process_group::allocate: on a shared-memory group, memory every rank's collectives reach in
// place) holding its gradients back to back in parameter order, with their values. From then on
// its gradients() must return those places. A model without bind_gradients keeps its own
// gradient memory, which the buckets then follow as it lies.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Memory for a model's gradients (see the top of this header). `places[i]` is where gradient i
/// lives from now on: its size, dtype and device, already holding its values. The places lie in
/// one block that `owner` keeps alive: the model keeps a copy of `owner` for as long as it uses
/// them (the block outlives the wrapper and the process group that made it).
struct gradient_memory {
  std::shared_ptr<std::byte> owner;  ///< the block; the model keeps a copy while it uses the places
  std::vector<tensor_ref> places;    ///< one per gradient, in parameter order, back to back
};

/// Whether DDP can lay out `M`'s gradients: `m.bind_gradients(g)`, or
/// `model_traits<M>::bind_gradients(m, g)`.
template <class M>
concept binds_gradients = requires(M& m, gradient_memory const& g) { m.bind_gradients(g); } ||
                          requires(M& m, gradient_memory const& g) { model_traits<M>::bind_gradients(m, g); };

namespace detail {

/// Where each gradient goes in one block: back to back in parameter order, each at a multiple of
/// its element size (so a change of dtype may leave a gap of a few bytes); `bytes` in all.
struct gradient_layout {
  std::vector<std::size_t> offsets;
  std::size_t bytes = 0;
};

inline gradient_layout lay_out_gradients(std::span<tensor_ref const> grads) {
  gradient_layout out;
  out.offsets.reserve(grads.size());
  for (tensor_ref const& g : grads) {
    std::size_t const align = size_of(g.dtype());
    out.bytes = (out.bytes + align - 1) / align * align;
    out.offsets.push_back(out.bytes);
    out.bytes += g.size_bytes();
  }
  return out;
}

/// Whether every gradient lies in host memory (the only memory process_group::allocate gives).
inline bool host_gradients(std::span<tensor_ref const> grads) {
  for (tensor_ref const& g : grads)
    if (g.device().kind != device_kind::host) return false;
  return true;
}

/// Moves `m`'s gradients (`grads`, as gradients(m) returns them now) into one block from
/// `allocate(bytes)`, their values copied, and hands the places to the model. Returns the places
/// given; the caller checks that gradients(m) returns them.
template <binds_gradients M, class Allocate>
gradient_memory bind_gradients(M& m, std::span<tensor_ref const> grads, Allocate&& allocate) {
  gradient_layout const layout = lay_out_gradients(grads);
  gradient_memory g;
  g.owner = std::forward<Allocate>(allocate)(layout.bytes == 0 ? std::size_t{1} : layout.bytes);
  g.places.reserve(grads.size());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    std::byte* const at = g.owner.get() + layout.offsets[i];
    if (grads[i].size_bytes() != 0) std::memcpy(at, grads[i].data(), grads[i].size_bytes());
    g.places.emplace_back(at, grads[i].size(), grads[i].dtype(), grads[i].device());
  }
  if constexpr (requires { m.bind_gradients(g); }) m.bind_gradients(g);
  else model_traits<M>::bind_gradients(m, g);
  return g;
}

/// "" when `now` (gradients(m) after bind_gradients) are the places given, else what differs
/// (naming the gradient as `label(i)` does: parameter_label).
template <class Label>
std::string check_bound_gradients(std::span<tensor_ref const> now, gradient_memory const& given, int rank,
                                  Label const& label) {
  std::string const who = "DDP on rank " + std::to_string(rank) + ": ";
  if (now.size() != given.places.size())
    return who + "after bind_gradients the model has " + std::to_string(now.size()) + " gradients, expected the " +
           std::to_string(given.places.size()) + " it was given places for";
  for (std::size_t i = 0; i < now.size(); ++i) {
    tensor_ref const& p = given.places[i];
    bool const moved = p.size() == 0 || now[i].data() == p.data();  // an empty gradient may point anywhere
    if (!moved || now[i].size() != p.size() || now[i].dtype() != p.dtype())
      return who + "after bind_gradients the model's gradient " + label(i) +
             " is not the place it was given (gradient_memory::places[" + std::to_string(i) +
             "]); expected gradients() to return the places bind_gradients received";
  }
  return "";
}

/// DDP with gradient_as_bucket_view, at construction: when the model (`s.models[0]`) has
/// bind_gradients and its gradients are host memory, they move into one block from the process
/// group (`s.group.allocate`), `s`'s views are re-read and `bound` set. Returns what went wrong
/// (bind_gradients threw, or gradients() does not return the places; "" when nothing did, or when
/// the model keeps its own memory), for the caller to report on every rank.
template <class Set>
std::string bind_replica_gradients(Set& s, bool& bound) {
  using model_type = std::remove_pointer_t<typename decltype(s.models)::value_type>;
  if constexpr (binds_gradients<model_type>) {
    if (!host_gradients(s.grads[0])) return "";
    auto const allocate = [&](std::size_t bytes) { return s.group.allocate(bytes); };
    gradient_memory given;
    try {  // an error here must reach every rank (through the caller), not strand the peers
      given = bind_gradients(*s.models[0], s.grads[0], allocate);
    } catch (std::exception const& e) {
      return "DDP on rank " + std::to_string(s.rank()) + ": the model's bind_gradients failed: " + e.what();
    }
    s.refresh_views();
    bound = true;
    return check_bound_gradients(s.grads[0], given, s.rank(),
                                 [&s](std::size_t i) { return parameter_label(*s.models[0], i); });
  } else {
    (void)s;
    (void)bound;
    return "";
  }
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

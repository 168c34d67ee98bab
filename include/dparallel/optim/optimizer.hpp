#pragma once
// optim::optimizer<Rule, Backend>: an update rule (optim/sgd.hpp, optim/adam.hpp, or your own
// update_rule) applied to every parameter of a model, with the rule's state (one f32 tensor per
// slot and parameter, shaped as the parameter) and the step count.
//
//   my_model model;
//   dparallel::optim::optimizer opt(model, dparallel::optim::adamw({.weight_decay = 0.1}));
//   for (...) {
//     model.forward_backward(batch);
//     opt.step(model, lr);                       // every parameter: p <- rule(p, grad, state)
//   }
//
// With a wrapper, step the wrapper (it steps its module()):
//   DataParallel: module() is the master; the next step() replicates it to the other devices, so
//     one optimizer over the master is all DP needs (its gradients are the reduced ones). On host
//     devices the devices' threads share the update, each its stripes of every tensor
//     (parallel::on_each_device); the rule is elementwise, so the bits are one thread's;
//   DDP: every rank builds an optimizer over its own replica and steps it after each step(); the
//     reduced gradients are bitwise identical on every rank and so are the updates, so the
//     replicas stay bitwise identical.
//   dparallel::distributed_data_parallel<my_model> ddp(model, rank);
//   dparallel::optim::optimizer opt(ddp, dparallel::optim::sgd({.momentum = 0.9}));
//   ddp.step(batch, step_fn);
//   opt.step(ddp, 0.1);
//
// The optimizer remembers the parameters' count, sizes and device and checks them at every step:
// stepping another model is an error that names the parameter. Its state saves with the model's
// parameter names (optim/state.hpp): "<parameter name>.<slot>" and "<rule>.step".
//
// F16/BF16 parameters (optimizer_options::master_weights): the optimizer keeps an F32 master copy
// of each 16-bit parameter (taken from the parameter when the optimizer is built; saved as
// "<parameter name>.master"), applies the rule to the master with the gradient widened to F32
// (exact), and writes the parameter back as the master rounded to nearest even. Without the
// option 16-bit parameters are refused: updating them in place would round every step's update
// into the 16-bit value, and small updates would vanish. Build the optimizer after loading the
// model's weights (or load the optimizer's state, master included, with them).

#include <dparallel/config.hpp>
#include <dparallel/backend/host/backend.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/stripes.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/io/state_dict.hpp>
#include <dparallel/optim/element.hpp>
#include <dparallel/optim/rule.hpp>
#include <dparallel/parallel.hpp>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace optim {

namespace detail {
/// The name of a rule in messages and saved state: R::name when it has one, else "custom".
template <class R>
constexpr std::string_view rule_name() {
  if constexpr (requires { std::string_view(R::name); }) return R::name;
  else return "custom";
}
}  // namespace detail

/// Where an optimizer's arithmetic runs for parameters of `Backend`: apply(r, c, p, g, slots)
/// updates one tensor, apply_master the same through an F32 master copy, widen fills a master
/// copy, copy(dst, src) copies in order with the updates, finish(device) returns once every
/// update issued is done. This is the
/// host's; optim/cuda/kernels.hpp specialises it for cuda::backend.
template <class Backend>
struct backend_kernels;

/// The host: the rule's own loop, on the calling thread.
template <>
struct backend_kernels<host::backend> {
  /// Updates the f32 tensor `p` from `g` and the slots `s` (null for slots the rule does not use).
  template <update_rule R>
  static void apply(R const& r, typename R::step_constants const& c, tensor_ref p, tensor_ref g,
                    std::span<float* const> s) {
    auto const pv = p.as<float>();
    auto const gv = g.as<float>();
    r.apply(c, std::span<float>(pv.data(), pv.size()), std::span<float const>(gv.data(), gv.size()), s);
  }
  /// Updates the F32 `master` of the 16-bit tensor `p` from `p`'s 16-bit gradient `g` widened
  /// to F32, then writes `p` = `master` rounded to nearest even (f16/bf16 of core/half.hpp).
  template <update_rule R>
  static void apply_master(R const& r, typename R::step_constants const& c, tensor_ref p, tensor_ref g,
                           float* master, std::span<float* const> s) {
    if (p.dtype() == dtype::bf16) master_chunks<bf16>(r, c, p, g, master, s);
    else master_chunks<f16>(r, c, p, g, master, s);
  }
  /// master = `p` (16-bit) widened to F32: exact.
  static void widen(float* master, tensor_ref p) {
    for (std::size_t i = 0; i < p.size(); ++i)
      master[i] = p.dtype() == dtype::bf16 ? static_cast<float>(static_cast<bf16 const*>(p.data())[i])
                                           : static_cast<float>(static_cast<f16 const*>(p.data())[i]);
  }
  /// dst = src (same size and dtype), in order with the updates (ZeRO-1's shard copies).
  static void copy(tensor_ref dst, tensor_ref src) { host::backend::immediate::copy(dst, src); }
  /// Nothing to wait for: apply ran to completion.
  static void finish(device) {}

 private:
  // The gradient widened through a stack buffer, a chunk at a time (no memory per step), the
  // rule over the chunk's stretch of master and slots, then the chunk rounded into `p`.
  template <class T, update_rule R>
  static void master_chunks(R const& r, typename R::step_constants const& c, tensor_ref p, tensor_ref g,
                            float* master, std::span<float* const> s) {
    constexpr std::size_t chunk = 256;
    float wide[chunk];
    std::array<float*, detail::slot_array_size<R>> at{};
    auto* const pv = static_cast<T*>(p.data());
    auto const* const gv = static_cast<T const*>(g.data());
    for (std::size_t lo = 0; lo < p.size(); lo += chunk) {
      std::size_t const m = std::min(chunk, p.size() - lo);
      for (std::size_t i = 0; i < m; ++i) wide[i] = static_cast<float>(gv[lo + i]);
      for (std::size_t k = 0; k < s.size(); ++k) at[k] = s[k] == nullptr ? nullptr : s[k] + lo;
      r.apply(c, std::span<float>(master + lo, m), std::span<float const>(wide, m),
              std::span<float* const>(at.data(), s.size()));
      for (std::size_t i = 0; i < m; ++i) pv[lo + i] = T(master[lo + i]);
    }
  }
};

/// Options of an optimizer beyond its rule.
struct optimizer_options {
  /// Keep an F32 master copy of every F16/BF16 parameter and update through it (see the top of
  /// optim/optimizer.hpp); without it 16-bit parameters are refused.
  bool master_weights = false;
};

/// The name of a master copy in saved state: "<parameter name>.master".
inline constexpr std::string_view master_slot_name = "master";


/// An update rule applied to every parameter of one model (see the top of optim/optimizer.hpp).
/// The state lives on the parameters' device, allocated through Backend::allocate (zeroed).
template <update_rule Rule, class Backend = host::backend>
class optimizer {
  static_assert(requires { sizeof(backend_kernels<Backend>); },
                "dparallel: optim::optimizer has no kernels for this backend: for cuda::backend include "
                "<dparallel/optim/cuda/kernels.hpp> (compiled by nvcc) before using it");

 public:
  /// The update rule.
  using rule_type = Rule;
  /// The backend whose memory and kernels hold and update the state.
  using backend_type = Backend;

  /// An optimizer for the parameters of `model_or_wrapper` (a model, or a DP/DDP wrapper whose
  /// module() it updates). Every parameter must be f32 (or f16/bf16 with o.master_weights, each
  /// gradient of its parameter's dtype) and all of them on one device.
  template <class X>
  explicit optimizer(X& model_or_wrapper, Rule rule = Rule{}, optimizer_options o = {}) : rule_(std::move(rule)) {
    static_assert(!detail::shards_gradients<X>,
                  "dparallel: optim::optimizer over a ddp_zero1 wrapper would update from this rank's own, "
                  "unaveraged gradients: use zero_redundancy_optimizer (dparallel/optim/zero_redundancy_optimizer.hpp)");
    auto& m = dparallel::detail::unwrap_model(model_or_wrapper);
    using M = std::remove_cvref_t<decltype(m)>;
    static_assert(check_model<M>());
    verify_model(m, where() + ": the model");
    auto const params = parameter_refs(m);
    if (!params.empty()) device_ = params[0].device();
    auto const grads = gradient_refs(m);
    for (std::size_t i = 0; i < params.size(); ++i) {
      dtype const t = params[i].dtype();
      bool const half = dparallel::detail::is_half(t);
      if (t != dtype::f32 && !(half && o.master_weights))
        throw invalid_argument("dparallel: " + where() + ": parameter " + std::to_string(i) + " ('" +
                               parameter_names(m)[i] + "') is " + std::string(name_of(t)) +
                               "; the optimizers update F32 parameters, and F16/BF16 ones through an F32 master "
                               "copy: build the optimizer with optimizer_options{.master_weights = true}");
      if (half && i < grads.size() && grads[i].dtype() != t)
        throw invalid_argument("dparallel: " + where() + ": parameter " + std::to_string(i) + " ('" +
                               parameter_names(m)[i] + "') is " + std::string(name_of(t)) + " and its gradient " +
                               std::string(name_of(grads[i].dtype())) +
                               "; a master-copy update expects the gradient in the parameter's dtype");
      if (params[i].device() != device_)
        throw invalid_argument("dparallel: " + where() + ": parameter " + std::to_string(i) + " is on " +
                               to_string(params[i].device()) + " and parameter 0 on " + to_string(device_) +
                               "; one optimizer updates parameters of one device");
      offsets_.push_back(total_);
      sizes_.push_back(params[i].size());
      dtypes_.push_back(t);
      master_offsets_.push_back(half ? master_total_ : no_master);
      total_ += params[i].size();
      if (half) master_total_ += params[i].size();
    }
    active_ = active_slots(rule_);
    for (std::size_t k = 0; k < active_; ++k)
      storage_[k] = total_ == 0 ? nullptr : Backend::allocate(device_, total_ * sizeof(float));
    if (master_total_ != 0) {
      master_ = Backend::allocate(device_, master_total_ * sizeof(float));
      for (std::size_t i = 0; i < params.size(); ++i)
        if (master_offsets_[i] != no_master) backend_kernels<Backend>::widen(master_data() + master_offsets_[i], params[i]);
      backend_kernels<Backend>::finish(device_);
    }
  }

  optimizer(optimizer const&) = delete;  // the state is owned: one optimizer per model
  optimizer& operator=(optimizer const&) = delete;
  /// Moves the state; the moved-from optimizer must not be used.
  optimizer(optimizer&&) noexcept = default;
  /// Moves the state; the moved-from optimizer must not be used.
  optimizer& operator=(optimizer&&) noexcept = default;
  ~optimizer() = default;

  /// One update of every parameter of `model_or_wrapper` at learning rate `lr`: update number
  /// steps() + 1. Throws invalid_argument when the model is not the one the optimizer was built
  /// for (parameter count, sizes, dtypes, device) or `lr` is invalid; then nothing changed.
  template <class X>
  void step(X& model_or_wrapper, double lr) {
    static_assert(!detail::shards_gradients<X>,
                  "dparallel: optim::optimizer over a ddp_zero1 wrapper would update from this rank's own, "
                  "unaveraged gradients: use zero_redundancy_optimizer (dparallel/optim/zero_redundancy_optimizer.hpp)");
    auto& m = dparallel::detail::unwrap_model(model_or_wrapper);
    params_.clear();
    grads_.clear();
    for (auto&& t : dparallel::parameters(m)) params_.emplace_back(t);
    for (auto&& t : dparallel::gradients(m)) grads_.emplace_back(t);
    check_model_matches(m);
    auto const next = static_cast<std::uint64_t>(step_) + 1;
    auto const c = rule_.constants(next, lr);
    if constexpr (std::same_as<Backend, host::backend> &&
                  requires { model_or_wrapper.on_each_device([](std::size_t, std::size_t) {}); }) {
      // DataParallel on host devices: the devices' threads update the master at once, each its
      // stripes of every tensor (the rule is elementwise, so the bits are those of one thread).
      if (model_or_wrapper.devices().size() > 1) {
        model_or_wrapper.on_each_device([&](std::size_t k, std::size_t n) { update_stripes(c, k, n); });
        step_ = static_cast<std::int64_t>(next);
        return;
      }
    }
    for (std::size_t i = 0; i < params_.size(); ++i) update(c, i, 0, params_[i].size());
    backend_kernels<Backend>::finish(device_);
    step_ = static_cast<std::int64_t>(next);
  }
  /// One update at the rule's default learning rate (Rule::default_lr, e.g. Adam's 1e-3).
  template <class X>
    requires requires { Rule::default_lr; }
  void step(X& model_or_wrapper) {
    step(model_or_wrapper, Rule::default_lr);
  }

  /// The number of updates done (loaded with the state).
  [[nodiscard]] std::uint64_t steps() const noexcept { return static_cast<std::uint64_t>(step_); }
  /// The update rule and its hyperparameters.
  [[nodiscard]] Rule const& rule() const noexcept { return rule_; }
  /// The device the parameters and the state live on.
  [[nodiscard]] device state_device() const noexcept { return device_; }
  /// Number of parameters.
  [[nodiscard]] std::size_t parameter_count() const noexcept { return sizes_.size(); }
  /// Number of slots the rule keeps (active_slots of the rule: plain SGD keeps none).
  [[nodiscard]] std::size_t slots_kept() const noexcept { return active_; }
  /// Bytes of state held (every kept slot over every parameter element, and the master copies).
  [[nodiscard]] std::size_t state_bytes() const noexcept { return (active_ * total_ + master_total_) * sizeof(float); }
  /// Whether parameter `i` is updated through an F32 master copy (it is F16/BF16).
  [[nodiscard]] bool has_master(std::size_t i) const { return master_offsets_.at(i) != no_master; }
  /// The F32 master copy of parameter `i` (has_master(i)), on state_device().
  [[nodiscard]] tensor_ref master(std::size_t i) const {
    dparallel::detail::require(i < sizes_.size() && has_master(i),
                               where() + "::master: expected a parameter with a master copy (F16/BF16, < " +
                                   std::to_string(sizes_.size()) + "), found parameter " + std::to_string(i));
    return {master_data() + master_offsets_[i], sizes_[i], dtype::f32, device_};
  }
  /// Slot `k` of parameter `i`, shaped (as a flat view) like the parameter, on state_device().
  [[nodiscard]] tensor_ref slot(std::size_t i, std::size_t k) const {
    dparallel::detail::require(i < sizes_.size() && k < active_,
                               where() + "::slot: expected parameter < " + std::to_string(sizes_.size()) +
                                   " and slot < " + std::to_string(active_) + ", found " + std::to_string(i) +
                                   " and " + std::to_string(k));
    return {slot_data(k) + offsets_[i], sizes_[i], dtype::f32, device_};
  }
  /// The step count as a one-element i64 tensor (host memory): what state_dict saves.
  [[nodiscard]] tensor_ref step_tensor() noexcept { return {&step_, 1, dtype::i64, host_memory}; }

  /// Throws invalid_argument unless `model_or_wrapper` has the parameters this optimizer was built
  /// for (count, sizes, dtypes, device), naming the first that differs.
  template <class X>
  void check(X& model_or_wrapper) {
    auto& m = dparallel::detail::unwrap_model(model_or_wrapper);
    params_ = parameter_refs(m);
    grads_ = gradient_refs(m);
    check_model_matches(m);
  }

 private:
  static std::string where() { return "optim::optimizer<" + std::string(detail::rule_name<Rule>()) + ">"; }

  // Elements [lo, hi) of parameter i.
  void update(typename Rule::step_constants const& c, std::size_t i, std::size_t lo, std::size_t hi) {
    std::array<float*, detail::slot_array_size<Rule>> slots{};
    for (std::size_t k = 0; k < active_; ++k) slots[k] = slot_data(k) + offsets_[i] + lo;
    std::span<float* const> const s(slots.data(), Rule::slot_count);
    tensor_ref const p = params_[i].subview(lo, hi - lo), g = grads_[i].subview(lo, hi - lo);
    if (master_offsets_[i] == no_master) backend_kernels<Backend>::apply(rule_, c, p, g, s);
    else backend_kernels<Backend>::apply_master(rule_, c, p, g, master_data() + master_offsets_[i] + lo, s);
  }
  // The stripes of every parameter that device k of n updates (core/stripes.hpp).
  void update_stripes(typename Rule::step_constants const& c, std::size_t k, std::size_t n) {
    for (std::size_t i = 0; i < params_.size(); ++i)
      dparallel::detail::for_each_stripe(params_[i].size(), static_cast<int>(n), static_cast<int>(k),
                                         size_of(params_[i].dtype()),
                                         [&](std::size_t lo, std::size_t hi) { update(c, i, lo, hi); });
  }

  float* slot_data(std::size_t k) const noexcept { return reinterpret_cast<float*>(storage_[k].get()); }
  float* master_data() const noexcept { return reinterpret_cast<float*>(master_.get()); }
  static constexpr std::size_t no_master = std::numeric_limits<std::size_t>::max();

  template <class M>
  void check_model_matches(M& m) const {
    if (params_.size() != sizes_.size() || grads_.size() != sizes_.size())
      throw invalid_argument("dparallel: " + where() + ": expected the model it was built for, with " +
                             std::to_string(sizes_.size()) + " parameters; found a model with " +
                             std::to_string(params_.size()) + " parameters and " + std::to_string(grads_.size()) +
                             " gradients (build one optimizer per model)");
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      auto const& p = params_[i];
      auto const& g = grads_[i];
      if (p.size() != sizes_[i] || p.dtype() != dtypes_[i] || p.device() != device_ || g.size() != sizes_[i] ||
          g.dtype() != dtypes_[i])
        throw invalid_argument("dparallel: " + where() + ": expected the model it was built for; its parameter " +
                               std::to_string(i) + " ('" + parameter_names(m)[i] + "') had " +
                               std::to_string(sizes_[i]) + " " + std::string(name_of(dtypes_[i])) + " elements on " + to_string(device_) +
                               ", found a parameter of " + std::to_string(p.size()) + " " +
                               std::string(name_of(p.dtype())) + " elements on " + to_string(p.device()) +
                               " with a gradient of " + std::to_string(g.size()) + " " +
                               std::string(name_of(g.dtype())) + " elements (build one optimizer per model)");
    }
  }

  Rule rule_;
  device device_ = host_memory;
  std::vector<std::size_t> offsets_, sizes_;  // per parameter, in elements of the flat slot storage
  std::vector<dtype> dtypes_;                  // per parameter
  std::vector<std::size_t> master_offsets_;    // per parameter, in the master storage (no_master: F32)
  std::size_t master_total_ = 0;               // elements of the master copies
  std::shared_ptr<std::byte> master_;          // the F32 master copies of the 16-bit parameters
  std::size_t total_ = 0;                     // elements over all parameters
  std::size_t active_ = 0;                    // slots kept
  std::array<std::shared_ptr<std::byte>, detail::slot_array_size<Rule>> storage_{};  // one flat tensor per slot
  std::int64_t step_ = 0;
  std::vector<tensor_ref> params_, grads_;  // refilled in place at every step
};

/// A DP/DDP wrapper's optimizer runs on the wrapper's backend.
template <class M, class S, class B, update_rule R>
optimizer(parallel<M, S, B>&, R) -> optimizer<R, B>;
/// A bare model's optimizer runs on the host.
template <class X, update_rule R>
optimizer(X&, R) -> optimizer<R, host::backend>;
/// A DP/DDP wrapper's optimizer with options runs on the wrapper's backend.
template <class M, class S, class B, update_rule R>
optimizer(parallel<M, S, B>&, R, optimizer_options) -> optimizer<R, B>;
/// A bare model's optimizer with options runs on the host.
template <class X, update_rule R>
optimizer(X&, R, optimizer_options) -> optimizer<R, host::backend>;

}  // namespace optim

DPARALLEL_NAMESPACE_END

#pragma once
// The libtorch adapter's gradient machinery (<dparallel/adapters/libtorch.hpp> uses it): the
// autograd hooks that report each parameter's gradient to the running step, the gradients the
// adapter keeps alive and puts back when a step function drops or replaces .grad, and the zeros
// that stand for frozen parameters' gradients.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/step_context.hpp>

#include <torch/torch.h>

#if defined(DPARALLEL_LIBTORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dparallel/backend/cuda/device.hpp>
#include <dparallel/backend/cuda/error.hpp>
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace libtorch::detail {

/// A parameter's gradient accumulator as autograd hands it out: std::shared_ptr<Node> in older
/// libtorch releases (1.13), c10::intrusive_ptr<Node> in recent ones (2.15).
using accumulator_ptr = decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor const&>()));

/// What the hooks of one module share: the step they report to (null outside a step), the
/// gradient accumulators they are attached to during a shard (kept alive here, as autograd holds
/// them weakly), and, per parameter, the gradient dparallel reads during the step and a frozen
/// parameter's own.
struct hook_state {
  hook_state() = default;
  hook_state(hook_state const&) = delete;
  hook_state& operator=(hook_state const&) = delete;
  ~hook_state();

  std::atomic<step_context*> ctx{nullptr};
  std::vector<accumulator_ptr> accumulators;  // per parameter during a shard; null when frozen
  std::vector<std::uintptr_t> keys;           // the post hooks, for del_post_hook
  std::vector<at::Tensor> params;             // the parameters hooked
  std::vector<std::string> names;             // and their names
  std::vector<char> trainable;                // requires_grad() when hooked
  // Per parameter, from begin_shard to the next: the .grad dparallel's views point at (kept alive
  // here, so a step function that drops it cannot free the memory a reduction reads), and whether
  // autograd's hook has reported it ready in this step.
  std::vector<at::Tensor> handed;
  std::vector<char> marked;
  // Per parameter: a frozen parameter's gradient, zeros the adapter owns (never its .grad).
  std::vector<at::Tensor> frozen;
#if defined(DPARALLEL_LIBTORCH_CUDA)
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
  cuda::detail::current_state shard_current{};  // dparallel's current stream of the bound shard
  // Per parameter, made on first use: recorded after autograd's accumulation into .grad when that
  // ran on another stream than the shard's, and waited for by the shard's stream.
  std::vector<cudaEvent_t> accumulated;
#endif
};

inline hook_state::~hook_state() {
#if defined(DPARALLEL_LIBTORCH_CUDA)
  for (cudaEvent_t e : accumulated)
    if (e != nullptr) (void)cudaEventDestroy(e);
#endif
}

#if defined(DPARALLEL_LIBTORCH_CUDA)
/// Orders the work dparallel launches next on the shard's stream after autograd's accumulation of
/// parameter `i`'s gradient into .grad (and restore_gradient's copy). Called in the accumulator's
/// post hook, where the accumulation was just issued on the accumulator's stream, which autograd's engine makes the
/// current stream while it runs the node and its post hooks (Engine::evaluate_function guards on
/// Node::stream(): the stream of the node's input metadata, i.e. the stream that was current on
/// the parameter's device when the accumulator was made). The adapter makes the accumulators
/// with the shard's stream current, so the two are one stream and nothing is needed; an
/// accumulator made before (held by a graph the caller kept, or by the caller) runs on the
/// stream of its time, unordered with dparallel's non-blocking stream (CUDA Runtime API, "stream
/// synchronization behavior"): an event recorded there is waited for by the shard's stream.
inline void follow_accumulation(hook_state& s, std::size_t i) {
  at::Tensor const& p = s.params[i];
  if (!p.is_cuda() || !s.shard_current.set) return;
  c10::cuda::CUDAGuard const on(p.device());
  cudaStream_t const accumulation = c10::cuda::getCurrentCUDAStream(p.device().index()).stream();
  cudaStream_t const shard = s.shard_current.stream;
  if (accumulation == shard || i >= s.accumulated.size()) return;  // sized by install_hooks
  device const where{device_kind::cuda, p.device().index(), 0};
  cudaEvent_t& e = s.accumulated[i];
  if (e == nullptr) cuda::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags", where);
  // Recording again is safe: a wait made earlier captured the event as it was then (CUDA Runtime
  // API, cudaStreamWaitEvent: "uses the most recent call to cudaEventRecord").
  cuda::check(cudaEventRecord(e, accumulation), "cudaEventRecord", where);
  cuda::check(cudaStreamWaitEvent(shard, e, 0), "cudaStreamWaitEvent", where);
}
#endif

/// If the step function dropped or replaced parameter `i`'s .grad (zero_grad(set_to_none), an
/// assignment), makes the tensor dparallel's views point at its .grad again, with the gradient the
/// step function left copied in (none: zeros) unless `keep_values` (the gradient was reported
/// ready before: what was reported is what counts). Throws invalid_argument when the replacement
/// cannot be copied.
inline void restore_gradient(hook_state& s, std::size_t i, bool keep_values = false) {
  at::Tensor const& p = s.params[i];
  at::Tensor const& kept = s.handed[i];
  if (!kept.defined()) return;
  at::Tensor const g = p.grad();
  if (g.defined() && g.unsafeGetTensorImpl() == kept.unsafeGetTensorImpl()) return;
  torch::NoGradGuard const no_grad;
  if (keep_values) {
    // nothing to copy
  } else if (g.defined()) {
    bool const fits = g.sizes() == kept.sizes() && g.scalar_type() == kept.scalar_type() && g.device() == kept.device();
    if (!fits) p.mutable_grad() = kept;  // the module stays usable: its .grad is dparallel's again
    dparallel::detail::require(fits, [&] {
      return "libtorch: the step function replaced " + s.names[i] + ".grad by a tensor of " + c10::str(g.sizes()) +
             " " + std::string(c10::toString(g.scalar_type())) + " on " + g.device().str() +
             "; expected the parameter's shape, dtype and device";
    });
    kept.copy_(g);
  } else {
    kept.zero_();
  }
  p.mutable_grad() = kept;
}

/// Runs after an accumulator added its gradient into .grad: tells the bound step that parameter
/// `index` is ready.
class ready_hook final : public torch::autograd::FunctionPostHook {
 public:
  ready_hook(std::weak_ptr<hook_state> s, std::size_t index) : state_(std::move(s)), index_(index) {}
  torch::autograd::variable_list operator()(torch::autograd::variable_list const& outputs,
                                            torch::autograd::variable_list const& /*inputs*/) override {
    if (auto s = state_.lock()) {
      if (step_context* c = s->ctx.load(std::memory_order_acquire)) {
#if defined(DPARALLEL_LIBTORCH_CUDA)
        // Autograd runs the backward of CUDA tensors on a thread of its own per GPU, not on the
        // step's thread (the step's thread waits in backward() meanwhile). The reducer launches
        // its copies and collectives on dparallel's current stream of the calling thread, so the
        // shard's is made current here for the call, ordered after the accumulation first.
        std::optional<cuda::detail::current_scope> borrowed;
        if (s->shard_current.set) borrowed.emplace(s->shard_current);
#endif
        restore_gradient(*s, index_);  // before the reduction reads it
#if defined(DPARALLEL_LIBTORCH_CUDA)
        follow_accumulation(*s, index_);
#endif
        s->marked[index_] = 1;
        c->grad_ready(index_);
      }
    }
    return outputs;
  }

 private:
  std::weak_ptr<hook_state> state_;
  std::size_t index_;
};

/// The hook state of module `m`, made on first use; entries of destroyed modules are dropped.
inline std::shared_ptr<hook_state> hooks_of(torch::nn::Module& m) {
  struct entry {
    std::weak_ptr<torch::nn::Module> module;
    std::shared_ptr<hook_state> state;
  };
  static std::mutex mu;
  static std::unordered_map<torch::nn::Module const*, entry> table;
  std::lock_guard<std::mutex> const lock(mu);
  for (auto it = table.begin(); it != table.end();) it = it->second.module.expired() ? table.erase(it) : std::next(it);
  auto& e = table[&m];
  if (!e.state) e = entry{m.shared_from_this(), std::make_shared<hook_state>()};
  return e.state;
}

/// Attaches one ready_hook to the gradient accumulator of each trainable parameter of `m`, for one
/// shard (remove_hooks detaches them). An accumulator autograd does not hold already is made here,
/// with the caller's current stream as its stream (on CUDA: dparallel's, see begin_shard), and
/// held until remove_hooks; the module's forward links it into the graph.
inline void install_hooks(torch::nn::Module& m, std::shared_ptr<hook_state> const& s) {
  auto const named = m.named_parameters(true);
  std::size_t const n = named.size();
  s->accumulators.assign(n, nullptr);
  s->keys.assign(n, 0);
  s->params.assign(n, at::Tensor());
  s->names.assign(n, std::string());
  s->trainable.assign(n, 0);
  s->handed.assign(n, at::Tensor());
  s->marked.assign(n, 0);
  s->frozen.resize(n);
#if defined(DPARALLEL_LIBTORCH_CUDA)
  if (s->accumulated.size() < n) s->accumulated.resize(n, nullptr);  // before any hook can fire
#endif
  for (std::size_t i = 0; i < n; ++i) {
    s->params[i] = named[i].value();
    s->names[i] = named[i].key();
    s->trainable[i] = named[i].value().requires_grad();
    if (!s->trainable[i]) continue;  // frozen: no gradient accumulator, its zeros are ready from the start
    s->accumulators[i] = torch::autograd::impl::grad_accumulator(s->params[i]);
    s->keys[i] = s->accumulators[i]->add_post_hook(std::make_unique<ready_hook>(s, i));
  }
}

/// Detaches the hooks install_hooks attached and lets the accumulators go: autograd keeps one only
/// while a graph uses it, so the next shard makes them again under its own stream (an accumulator
/// held past the wrapper would go on running on a stream dparallel has destroyed).
inline void remove_hooks(hook_state& s) noexcept {
  for (std::size_t i = 0; i < s.accumulators.size(); ++i)
    if (s.accumulators[i]) (void)s.accumulators[i]->del_post_hook(s.keys[i]);
  s.accumulators.assign(s.accumulators.size(), nullptr);
}

/// Makes each parameter of `replica` trainable or frozen as the same parameter of `source` is.
inline void follow_requires_grad(torch::nn::Module& replica, torch::nn::Module& source) {
  auto const from = source.parameters(true);
  auto to = replica.parameters(true);
  for (std::size_t i = 0; i < from.size() && i < to.size(); ++i)
    if (to[i].requires_grad() != from[i].requires_grad()) to[i].set_requires_grad(from[i].requires_grad());
}

/// Frozen parameter `i`'s gradient: zeros of its shape that the adapter owns, made once.
inline at::Tensor const& frozen_gradient(hook_state& s, std::size_t i, at::Tensor const& p) {
  if (s.frozen.size() <= i) s.frozen.resize(i + 1);
  at::Tensor& g = s.frozen[i];
  if (!g.defined() || g.sizes() != p.sizes() || g.scalar_type() != p.scalar_type() || g.device() != p.device()) {
    torch::NoGradGuard const no_grad;
    g = torch::zeros(p.sizes(), p.options().requires_grad(false));
  }
  return g;
}

/// Gives every trainable parameter without a gradient a zero one: the parameters of one dtype
/// and device share one flat buffer, each gradient a view of its slice, in parameter order.
inline void allocate_missing_gradients(torch::OrderedDict<std::string, at::Tensor> const& named) {
  std::vector<at::Tensor> missing;
  for (auto const& item : named)
    if (item.value().requires_grad() && !item.value().grad().defined()) missing.push_back(item.value());
  if (missing.empty()) return;
  torch::NoGradGuard const no_grad;
  std::vector<bool> done(missing.size(), false);
  for (std::size_t first = 0; first < missing.size(); ++first) {
    if (done[first]) continue;
    auto const same_kind = [&](at::Tensor const& t) {
      return t.scalar_type() == missing[first].scalar_type() && t.device() == missing[first].device();
    };
    std::int64_t total = 0;
    for (std::size_t i = first; i < missing.size(); ++i)
      if (!done[i] && same_kind(missing[i])) total += missing[i].numel();
    at::Tensor const flat = torch::zeros({total}, missing[first].options());
    std::int64_t offset = 0;
    for (std::size_t i = first; i < missing.size(); ++i) {
      if (done[i] || !same_kind(missing[i])) continue;
      // set_ rather than narrow/view: a plain tensor over the buffer's storage, not an autograd
      // view (libtorch's Optimizer::zero_grad detaches gradients in place, which views refuse).
      missing[i].mutable_grad() = torch::empty({0}, flat.options()).set_(flat.storage(), offset, missing[i].sizes());
      offset += missing[i].numel();
      done[i] = true;
    }
  }
}

}  // namespace libtorch::detail
DPARALLEL_NAMESPACE_END

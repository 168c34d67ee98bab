#pragma once
// libtorch adapter: torch::nn modules as dparallel models, torch::Tensor as batches.
//
//   #include <dparallel/adapters/libtorch.hpp>            // CMake: link dparallel::libtorch
//   struct NetImpl : torch::nn::Cloneable<NetImpl> { ... };  TORCH_MODULE(Net);
//   Net net;
//   dparallel::distributed_data_parallel<Net> ddp(net, rank);
//   ddp.step(std::tuple{x, y}, [](Net& m, std::tuple<torch::Tensor, torch::Tensor> b) {
//     torch::mse_loss(m->forward(std::get<0>(b)), std::get<1>(b)).backward();
//   });
//
// Adapted model types: torch::nn::ModuleHolder<T> and the module types TORCH_MODULE declares
// (Net above), and std::shared_ptr<T> for T derived from torch::nn::Module.
// - parameters / gradients / buffers: views of the tensors' own memory, in named_parameters()
//   and named_buffers() order; names and shapes for state dicts come from the same lists, so a
//   state dict written by dparallel loads into the Python module with load_state_dict(strict=True).
//   Every tensor must be contiguous, on the CPU or a CUDA device, of a dtype dparallel knows.
// - Gradients autograd has not created yet are allocated once (zeros, one flat buffer per dtype and
//   device, in parameter order) the first time dparallel asks for them. Backward then accumulates
//   into them in place, so their memory stays the same step after step: do not replace or reset
//   .grad tensors (libtorch 1.13's Optimizer::zero_grad() and Module::zero_grad() zero them in
//   place, which is fine; libtorch 2.x's Optimizer::zero_grad() needs set_to_none = false).
// - Replicas (DataParallel) are made once, by Module::clone(): modules must derive from
//   torch::nn::Cloneable<Impl> (every built-in module does).
// - Readiness: a post hook on each parameter's gradient accumulator (the autograd node that adds
//   a leaf's gradient into .grad) calls step_context::grad_ready once the gradient is
//   accumulated, so DDP reduces its buckets while backward goes on. The hooks are installed once
//   per module and bound to the running step only between begin_shard and end_shard; before each
//   shard the gradients are zeroed, so the step function is ordinary `loss.backward()` code that
//   leaves the gradient of its shard's mean loss (one backward per step).
// - CUDA (when compiled with DPARALLEL_LIBTORCH_CUDA, which the dparallel::libtorch target sets
//   when libtorch has CUDA): the step function runs with dparallel's stream of the device as
//   libtorch's current stream (c10::cuda::CUDAStreamGuard), so the model's kernels and NCCL are
//   ordered on one stream without host synchronisation.

#include <dparallel/config.hpp>
#include <dparallel/core/batch.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/gradient_memory.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/step_context.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <torch/torch.h>

#if defined(DPARALLEL_LIBTORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <dparallel/backend/cuda/device.hpp>
#endif

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// The libtorch adapter's helpers (the adaptation itself is the model_traits and batch_traits
/// specialisations below).
namespace libtorch {

/// The dparallel dtype of a torch scalar type; throws invalid_argument for the others, naming
/// `what` (a tensor's name).
inline dtype dtype_of(at::ScalarType t, std::string const& what) {
  switch (t) {
    case at::kFloat: return dtype::f32;
    case at::kDouble: return dtype::f64;
    case at::kHalf: return dtype::f16;
    case at::kBFloat16: return dtype::bf16;
    case at::kInt: return dtype::i32;
    case at::kLong: return dtype::i64;
    case at::kByte: return dtype::u8;
    default: break;
  }
  throw invalid_argument("dparallel: libtorch: tensor '" + what + "' has dtype " + std::string(c10::toString(t)) +
                         "; expected float32, float64, float16, bfloat16, int32, int64 or uint8 (convert the module "
                         "with ->to(dtype))");
}

/// The dparallel device of a torch device: the CPU is host memory, cuda:N is GPU N.
inline device device_of(at::Device d, std::string const& what) {
  if (d.is_cpu()) return host_memory;
  if (d.is_cuda()) return device{device_kind::cuda, d.has_index() ? d.index() : 0, 0};
  throw invalid_argument("dparallel: libtorch: tensor '" + what + "' lives on " + d.str() +
                         "; expected the CPU or a CUDA device");
}

/// A view of `t`'s memory; throws invalid_argument when it is not contiguous or not defined.
inline tensor_ref view(at::Tensor const& t, std::string const& what) {
  detail::require(t.defined(), "dparallel: libtorch: tensor '" + what + "' is undefined; expected a tensor");
  detail::require(t.is_contiguous(), "dparallel: libtorch: tensor '" + what +
                                         "' is not contiguous; expected contiguous parameters and buffers "
                                         "(assign param.set_data(param.contiguous()) once before wrapping)");
  return {t.data_ptr(), static_cast<std::size_t>(t.numel()), dtype_of(t.scalar_type(), what),
          device_of(t.device(), what)};
}

namespace detail {
/// The module behind a holder or a shared_ptr.
template <class M>
torch::nn::Module& module_of(M& m) {
  if constexpr (requires { m.ptr(); }) return *m.ptr();
  else return *m;
}

/// What the hooks of one module share: the step they report to (null outside a step), and the
/// gradient accumulators they are attached to (kept alive here, as autograd holds them weakly).
struct hook_state {
  std::atomic<step_context*> ctx{nullptr};
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // per parameter; null when frozen
  std::vector<std::uintptr_t> keys;                                  // the post hooks, for del_post_hook
  std::vector<at::TensorImpl const*> hooked;                         // the parameters hooked
#if defined(DPARALLEL_LIBTORCH_CUDA)
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
  cuda::detail::current_state shard_current{};  // dparallel's current stream of the bound shard
#endif
};

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
        // shard's is made current here for the call (its kernels then follow the gradient's).
        std::optional<cuda::detail::current_scope> borrowed;
        if (s->shard_current.set) borrowed.emplace(s->shard_current);
#endif
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

/// Installs (again, when the parameters changed) one ready_hook per parameter of `m`.
inline void install_hooks(torch::nn::Module& m, std::shared_ptr<hook_state> const& s) {
  auto const params = m.parameters(true);
  bool same = params.size() == s->hooked.size();
  for (std::size_t i = 0; same && i < params.size(); ++i) same = params[i].unsafeGetTensorImpl() == s->hooked[i];
  if (same) return;
  for (std::size_t i = 0; i < s->accumulators.size(); ++i)
    if (s->accumulators[i]) s->accumulators[i]->del_post_hook(s->keys[i]);
  s->accumulators.assign(params.size(), nullptr);
  s->keys.assign(params.size(), 0);
  s->hooked.assign(params.size(), nullptr);
  for (std::size_t i = 0; i < params.size(); ++i) {
    s->hooked[i] = params[i].unsafeGetTensorImpl();
    if (!params[i].requires_grad()) continue;  // frozen: no gradient, never ready
    s->accumulators[i] = torch::autograd::impl::grad_accumulator(params[i]);
    s->keys[i] = s->accumulators[i]->add_post_hook(std::make_unique<ready_hook>(s, i));
  }
}

/// Gives every parameter without a gradient a zero one: the parameters of one dtype and device
/// share one flat buffer, each gradient a view of its slice, in parameter order.
inline void allocate_missing_gradients(torch::OrderedDict<std::string, at::Tensor> const& named) {
  std::vector<at::Tensor> missing;
  for (auto const& item : named)
    if (!item.value().grad().defined()) missing.push_back(item.value());
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

/// Views of the named tensors (parameters or buffers) of `m`.
inline std::vector<tensor_ref> views_of(torch::OrderedDict<std::string, at::Tensor> const& named) {
  std::vector<tensor_ref> out;
  out.reserve(named.size());
  for (auto const& item : named) out.push_back(libtorch::view(item.value(), item.key()));
  return out;
}
/// The shapes of the named tensors.
inline std::vector<std::vector<std::uint64_t>> shapes_of(torch::OrderedDict<std::string, at::Tensor> const& named) {
  std::vector<std::vector<std::uint64_t>> out;
  for (auto const& item : named) {
    auto const sizes = item.value().sizes();
    out.emplace_back(sizes.begin(), sizes.end());
  }
  return out;
}

template <class M>
struct is_shared_module : std::false_type {};
template <class T>
struct is_shared_module<std::shared_ptr<T>> : std::bool_constant<std::derived_from<T, torch::nn::Module>> {};
}  // namespace detail

/// The model types the adapter handles: torch::nn::ModuleHolder<T> and the types derived from it
/// (TORCH_MODULE(Net) declares one), and std::shared_ptr<T> of a torch::nn::Module type.
template <class M>
concept torch_module = detail::is_shared_module<M>::value ||
                 requires { typename M::ContainedType; } &&
                     std::derived_from<M, torch::nn::ModuleHolder<typename M::ContainedType>>;

}  // namespace libtorch

/// The libtorch adapter's model customisation (see the top of adapters/libtorch.hpp).
template <class M>
  requires libtorch::torch_module<M>
struct model_traits<M> {
  /// Views of named_parameters(), in order.
  static std::vector<tensor_ref> parameters(M& m) {
    return libtorch::detail::views_of(libtorch::detail::module_of(m).named_parameters(true));
  }
  /// Views of each parameter's .grad. The gradients autograd has not made yet are made once
  /// (zeros), as views of one flat buffer per dtype and device, in parameter order: every rank
  /// then lays its gradients out alike (what gradient_as_bucket_view needs).
  static std::vector<tensor_ref> gradients(M& m) {
    auto const named = libtorch::detail::module_of(m).named_parameters(true);
    libtorch::detail::allocate_missing_gradients(named);
    std::vector<tensor_ref> out;
    out.reserve(named.size());
    for (auto const& item : named) out.push_back(libtorch::view(item.value().grad(), item.key() + ".grad"));
    return out;
  }
  /// DDP with gradient_as_bucket_view lays the gradients out (core/gradient_memory.hpp, host
  /// gradients only): each parameter's .grad becomes a plain tensor over its place in the block
  /// from the process group (group memory on one node), which the tensor keeps alive.
  static void bind_gradients(M& m, gradient_memory const& given) {
    auto const named = libtorch::detail::module_of(m).named_parameters(true);
    dparallel::detail::require(given.places.size() == named.size(),
                               "dparallel: libtorch: bind_gradients: expected a place per parameter");
    torch::NoGradGuard const no_grad;
    std::size_t i = 0;
    for (auto const& item : named) {
      at::Tensor const& p = item.value();
      std::shared_ptr<std::byte> keep = given.owner;
      p.mutable_grad() = torch::from_blob(given.places[i++].data(), p.sizes(), [keep](void*) {},
                                          torch::TensorOptions().dtype(p.scalar_type()).device(p.device()));
    }
  }
  /// Views of named_buffers(), in order.
  static std::vector<tensor_ref> buffers(M& m) {
    return libtorch::detail::views_of(libtorch::detail::module_of(m).named_buffers(true));
  }
  /// The names of named_parameters(): "fc1.weight", ...
  static std::vector<std::string> parameter_names(M& m) {
    return libtorch::detail::module_of(m).named_parameters(true).keys();
  }
  /// The names of named_buffers().
  static std::vector<std::string> buffer_names(M& m) { return libtorch::detail::module_of(m).named_buffers(true).keys(); }
  /// The parameters' shapes (sizes()).
  static std::vector<std::vector<std::uint64_t>> parameter_shapes(M& m) {
    return libtorch::detail::shapes_of(libtorch::detail::module_of(m).named_parameters(true));
  }
  /// The buffers' shapes.
  static std::vector<std::vector<std::uint64_t>> buffer_shapes(M& m) {
    return libtorch::detail::shapes_of(libtorch::detail::module_of(m).named_buffers(true));
  }
  /// A deep copy by Module::clone(), on GPU `d.index` for a CUDA device.
  static M make_replica(M const& m, device d) {
    auto& src = libtorch::detail::module_of(const_cast<M&>(m));
    c10::optional<torch::Device> to;
    if (d.kind == device_kind::cuda) to = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(d.index));
    std::shared_ptr<torch::nn::Module> copy = src.clone(to);
    if constexpr (libtorch::detail::is_shared_module<M>::value) {
      auto typed = std::dynamic_pointer_cast<typename M::element_type>(copy);
      dparallel::detail::require(typed != nullptr, "dparallel: libtorch: clone() returned another module type");
      return typed;
    } else {
      auto typed = std::dynamic_pointer_cast<typename M::ContainedType>(copy);
      dparallel::detail::require(typed != nullptr, "dparallel: libtorch: clone() returned another module type");
      return M(std::move(typed));
    }
  }
  /// Before the step function runs on replica `m`: hooks installed (once) and bound to `ctx`,
  /// gradients zeroed in place, and on CUDA dparallel's stream made libtorch's current stream.
  static void begin_shard(M& m, step_context& ctx) {
    auto& mod = libtorch::detail::module_of(m);
    auto const s = libtorch::detail::hooks_of(mod);
    libtorch::detail::install_hooks(mod, s);
#if defined(DPARALLEL_LIBTORCH_CUDA)
    // CUDA rule: the model's kernels must go to the stream dparallel orders NCCL and the
    // reductions on; inside a step that is cuda::current_stream() of the device's logical stream.
    // First, so that the zeroing below is on it too (on another stream it could land after
    // backward's first accumulation: dparallel's streams are non-blocking).
    if (ctx.device().kind == device_kind::cuda) {
      s->stream_guard.emplace(c10::cuda::getStreamFromExternal(cuda::current_stream(),
                                                               static_cast<c10::DeviceIndex>(ctx.device().index)));
      s->shard_current = cuda::detail::current();
    }
#endif
    {
      torch::NoGradGuard const no_grad;
      for (auto& p : mod.parameters(true))
        if (p.grad().defined()) p.mutable_grad().zero_();
    }
    s->ctx.store(&ctx, std::memory_order_release);
  }
  /// After the step function: the hooks report to no step.
  static void end_shard(M& m) noexcept {
    try {
      auto const s = libtorch::detail::hooks_of(libtorch::detail::module_of(m));
      s->ctx.store(nullptr, std::memory_order_release);
#if defined(DPARALLEL_LIBTORCH_CUDA)
      s->stream_guard.reset();
      s->shard_current = {};
#endif
    } catch (...) {  // NOLINT(bugprone-empty-catch): only allocation can fail here; the hooks then stay unbound
    }
  }
};

/// A torch::Tensor is a batch of size(0) samples; a slice is narrow(0, first, last - first), a
/// view of the same memory. Tuples, pairs and plain structs of tensors follow from batch.hpp.
template <>
struct batch_traits<at::Tensor> {
  /// Number of samples: size(0); throws invalid_argument for a 0-dimensional tensor.
  static std::size_t size(at::Tensor const& b) {
    detail::require(b.defined() && b.dim() > 0,
                    "dparallel: libtorch: expected a batch tensor with a first (batch) dimension, found " +
                        std::string(b.defined() ? "a 0-dimensional tensor" : "an undefined tensor"));
    return static_cast<std::size_t>(b.size(0));
  }
  /// Samples [first, last).
  static at::Tensor slice(at::Tensor const& b, std::size_t first, std::size_t last) {
    return b.narrow(0, static_cast<std::int64_t>(first), static_cast<std::int64_t>(last - first));
  }
};

DPARALLEL_NAMESPACE_END

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
//   Every tensor must be contiguous, on the CPU or a CUDA device, of a dtype dparallel knows
//   (bool buffers are moved as their bytes, uint8).
// - Gradients autograd has not created yet are allocated once (zeros, one flat buffer per dtype and
//   device, in parameter order) the first time dparallel asks for them. Backward then accumulates
//   into them in place, so their memory stays the same step after step. A step function that
//   drops or replaces a .grad (zero_grad(set_to_none = true), libtorch 2.x's default) costs a
//   copy: the new gradient is copied into the memory dparallel reads and becomes .grad again.
// - Frozen parameters (requires_grad() false) get no .grad, as in PyTorch (optimizers skip them):
//   their gradient for dparallel is a zero tensor the adapter owns, which DDP counts as ready at
//   the start of every step, so no option is needed for them.
// - Replicas (DataParallel) are made once, by Module::clone(): modules must derive from
//   torch::nn::Cloneable<Impl> (every built-in module does).
// - Readiness: a post hook on each parameter's gradient accumulator (the autograd node that adds
//   a leaf's gradient into .grad) calls step_context::grad_ready once the gradient is
//   accumulated, so DDP reduces its buckets while backward goes on. The hooks are attached at
//   begin_shard and detached at end_shard (a backward outside a step reports to nothing); before each
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
#include <dparallel/adapters/libtorch_hooks.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/policy/gather.hpp>

#include <torch/torch.h>

#if defined(DPARALLEL_LIBTORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <dparallel/backend/cuda/device.hpp>
#endif

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
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
    case at::kBool: return dtype::u8;  // one byte, 0 or 1: broadcast and copied as bytes (never reduced)
    default: break;
  }
  throw invalid_argument("dparallel: libtorch: tensor '" + what + "' has dtype " + std::string(c10::toString(t)) +
                         "; expected float32, float64, float16, bfloat16, int32, int64, uint8 or bool");
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
  dparallel::detail::require(t.defined(),
                             [&] { return "libtorch: tensor '" + what + "' is undefined; expected a tensor"; });
  dparallel::detail::require(t.is_contiguous(), [&] {
    return "libtorch: tensor '" + what +
           "' is not contiguous; expected contiguous parameters and buffers (assign "
           "param.set_data(param.contiguous()) once before wrapping)";
  });
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

/// The module class of a model type: T of std::shared_ptr<T>, else the holder's ContainedType.
template <class M>
struct module_type {
  using type = typename M::ContainedType;
};
template <class T>
struct module_type<std::shared_ptr<T>> {
  using type = T;
};
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
  /// Views of each trainable parameter's .grad, and of a frozen one's zeros (owned by the adapter,
  /// never its .grad). The gradients autograd has not made yet are made once (zeros), as views of
  /// one flat buffer per dtype and device, in parameter order: every rank then lays its gradients
  /// out alike (what gradient_as_bucket_view needs).
  static std::vector<tensor_ref> gradients(M& m) {
    auto& mod = libtorch::detail::module_of(m);
    auto const named = mod.named_parameters(true);
    libtorch::detail::allocate_missing_gradients(named);
    std::shared_ptr<libtorch::detail::hook_state> s;  // looked up for the first frozen parameter
    std::vector<tensor_ref> out;
    out.reserve(named.size());
    for (std::size_t i = 0; i < named.size(); ++i) {
      at::Tensor const& p = named[i].value();
      if (!p.requires_grad() && !s) s = libtorch::detail::hooks_of(mod);
      at::Tensor const& g = p.requires_grad() ? p.grad() : libtorch::detail::frozen_gradient(*s, i, p);
      out.push_back(libtorch::view(g, named[i].key() + ".grad"));
    }
    return out;
  }
  /// DDP with gradient_as_bucket_view lays the gradients out (core/gradient_memory.hpp, host
  /// gradients only): each trainable parameter's .grad (a frozen one's zeros) becomes a plain
  /// tensor over its place in the block from the process group (group memory on one node), which
  /// the tensor keeps alive.
  static void bind_gradients(M& m, gradient_memory const& given) {
    auto& mod = libtorch::detail::module_of(m);
    auto const named = mod.named_parameters(true);
    dparallel::detail::require(given.places.size() == named.size(),
                               "libtorch: bind_gradients: expected a place per parameter");
    torch::NoGradGuard const no_grad;
    auto const s = libtorch::detail::hooks_of(mod);
    for (std::size_t i = 0; i < named.size(); ++i) {
      at::Tensor const& p = named[i].value();
      std::shared_ptr<std::byte> keep = given.owner;
      at::Tensor placed = torch::from_blob(
          given.places[i].data(), p.sizes(), [keep](void*) {},
          torch::TensorOptions().dtype(p.scalar_type()).device(p.device()));
      if (p.requires_grad()) {
        p.mutable_grad() = std::move(placed);
      } else {
        (void)libtorch::detail::frozen_gradient(*s, i, p);  // sizes the list
        s->frozen[i] = std::move(placed);
      }
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
  /// A deep copy by Module::clone(), on GPU `d.index` for a CUDA device, with the source's
  /// requires_grad flags (as Python's copy.deepcopy keeps them; clone() makes every parameter
  /// trainable).
  static M make_replica(M const& m, device d) {
    using impl = typename libtorch::detail::module_type<M>::type;
    static_assert(std::derived_from<impl, torch::nn::Cloneable<impl>>,
                  "dparallel: libtorch: DataParallel makes its replicas with Module::clone(): derive the module "
                  "from torch::nn::Cloneable<Impl> and register its parameters and submodules in reset()");
    auto& src = libtorch::detail::module_of(const_cast<M&>(m));
    c10::optional<torch::Device> to;
    if (d.kind == device_kind::cuda) to = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(d.index));
    auto typed = std::dynamic_pointer_cast<impl>(src.clone(to));
    dparallel::detail::require(typed != nullptr, "libtorch: clone() returned another module type");
    libtorch::detail::follow_requires_grad(*typed, src);
    if constexpr (libtorch::detail::is_shared_module<M>::value)
      return typed;
    else
      return M(std::move(typed));
  }
  /// DataParallel, before each step: replica `r` takes the module's requires_grad flags, as
  /// torch.nn.DataParallel's replicas do at every forward (a parameter frozen or unfrozen between
  /// steps is so on every device).
  static void follow_master(M& r, M& master) {
    libtorch::detail::follow_requires_grad(libtorch::detail::module_of(r), libtorch::detail::module_of(master));
  }
  /// Before the step function runs on replica `m`: on CUDA dparallel's stream made libtorch's
  /// current stream, hooks installed and bound to `ctx`, gradients zeroed in place (and kept, see
  /// restore_gradient), frozen parameters' zeros marked ready.
  static void begin_shard(M& m, step_context& ctx) {
    auto& mod = libtorch::detail::module_of(m);
    auto const s = libtorch::detail::hooks_of(mod);
#if defined(DPARALLEL_LIBTORCH_CUDA)
    // CUDA rule: the model's kernels must go to the stream dparallel orders NCCL and the
    // reductions on; inside a step that is cuda::current_stream() of the device's logical stream.
    // First, so that the zeroing below is on it too (on another stream it could land after
    // backward's first accumulation: dparallel's streams are non-blocking), and so that the
    // gradient accumulators install_hooks makes take it as their stream: autograd accumulates
    // into .grad on the stream that was current when the accumulator was made.
    if (ctx.device().kind == device_kind::cuda) {
      s->stream_guard.emplace(c10::cuda::getStreamFromExternal(cuda::current_stream(),
                                                               static_cast<c10::DeviceIndex>(ctx.device().index)));
      s->shard_current = cuda::detail::current();
    }
#endif
    try {
      libtorch::detail::install_hooks(mod, s);
      torch::NoGradGuard const no_grad;
      for (std::size_t i = 0; i < s->params.size(); ++i) {
        at::Tensor const& p = s->params[i];
        s->marked[i] = 0;
        if (s->trainable[i]) {
          if (p.grad().defined()) p.mutable_grad().zero_();
          s->handed[i] = p.grad();
        } else {  // a .grad left from before it was frozen is zeroed too, as zero_grad(false) would
          if (p.grad().defined()) p.mutable_grad().zero_();
          libtorch::detail::frozen_gradient(*s, i, p).zero_();
        }
      }
      // PyTorch's DDP leaves frozen parameters out of its buckets; here their zeros are final now.
      for (std::size_t i = 0; i < s->params.size(); ++i)
        if (!s->trainable[i]) ctx.grad_ready(i);
    } catch (...) {
      unbind(*s);
      throw;
    }
    s->ctx.store(&ctx, std::memory_order_release);
  }
  /// After the step function: the gradients it dropped or replaced become .grad again (those not
  /// reported ready by autograd's hook with the step function's values copied in; an error when
  /// they cannot be), and the hooks report to no step.
  /// Called once the step function returned (its exception is the step's) and, without
  /// throwing, when the step function threw.
  static void end_shard(M& m) {
    auto const s = libtorch::detail::hooks_of(libtorch::detail::module_of(m));
    std::exception_ptr first;  // every gradient is restored; the first error is reported
    for (std::size_t i = 0; i < s->params.size(); ++i) {
      try {
        if (s->trainable[i]) libtorch::detail::restore_gradient(*s, i, s->marked[i] != 0);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    unbind(*s);
    if (first) std::rethrow_exception(first);
  }

 private:
  static void unbind(libtorch::detail::hook_state& s) noexcept {
    s.ctx.store(nullptr, std::memory_order_release);
    libtorch::detail::remove_hooks(s);
#if defined(DPARALLEL_LIBTORCH_CUDA)
    s.stream_guard.reset();
    s.shard_current = {};
#endif
  }
};

/// A torch::Tensor is a batch of size(0) samples; a slice is narrow(0, first, last - first), a
/// view of the same memory. Tuples, pairs and plain structs of tensors follow from batch.hpp.
template <>
struct batch_traits<at::Tensor> {
  /// Number of samples: size(0); throws invalid_argument for a 0-dimensional tensor.
  static std::size_t size(at::Tensor const& b) {
    detail::require(b.defined() && b.dim() > 0, [&] {
      return "libtorch: expected a batch tensor with a first (batch) dimension, found " +
             std::string(b.defined() ? "a 0-dimensional tensor" : "an undefined tensor");
    });
    return static_cast<std::size_t>(b.size(0));
  }
  /// Samples [first, last).
  static at::Tensor slice(at::Tensor const& b, std::size_t first, std::size_t last) {
    return b.narrow(0, static_cast<std::int64_t>(first), static_cast<std::int64_t>(last - first));
  }
};

/// DataParallel's outputs as torch.nn.DataParallel gathers them: the replicas' tensors concatenated
/// along dim 0 on options::output_device (0-dimensional ones, e.g. losses, stacked into a vector
/// of one value per replica), detached (each replica's backward has already run).
template <>
struct gather_traits<at::Tensor> {
  /// One tensor on `to` (the CPU for host devices).
  static at::Tensor concat(std::vector<at::Tensor>&& outs, device to) {
    torch::NoGradGuard const no_grad;
    at::Device const where = to.kind == device_kind::cuda
                                 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(to.index))
                                 : at::Device(at::kCPU);
    bool scalars = true;
    for (auto& o : outs) {
      detail::require(o.defined(), "libtorch: gather: a replica's step function returned an undefined tensor");
      scalars = scalars && o.dim() == 0;
      o = o.detach().to(where);
    }
    return scalars ? torch::stack(outs) : torch::cat(outs, 0);
  }
};

DPARALLEL_NAMESPACE_END

#pragma once
// State dicts: a model's parameters and buffers saved and loaded by name, in safetensors files
// that PyTorch (safetensors.torch.load_file) and the Hugging Face tools read.
//
//   struct mlp {
//     std::vector<float> w1, b1, w2, b2, gw1, gb1, gw2, gb2;
//     auto parameters() { return std::array{dparallel::view(w1), dparallel::view(b1), ...}; }
//     auto gradients()  { ... }
//     // optional: names and shapes, in parameters() order (default names: param.0, param.1, ...)
//     static auto parameter_names() { return std::array{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}; }
//     auto parameter_shapes() const {
//       return std::vector<std::vector<std::size_t>>{{512, 784}, {512}, {10, 512}, {10}};
//     }
//   };
//
//   dparallel::save_state_dict("mlp.safetensors", model);    // a model, or a DP/DDP wrapper
//   dparallel::load_state_dict("mlp.safetensors", model);    // strict: every name must match
//   auto r = dparallel::load_state_dict("mlp.safetensors", model, {.strict = false});
//   // r.missing: the model's names the file lacks; r.unexpected: the file's names the model lacks
//
// Names. A model names its tensors with members parameter_names() / buffer_names(), or with
// static members of the same names in a specialisation of dparallel::model_traits<M>: ranges of
// strings, one per tensor, in parameters() / buffers() order. Without them the names are
// "param.0", "param.1", ... and "buffer.0", .... Shapes likewise come from parameter_shapes() /
// buffer_shapes() (ranges of ranges of integers); without them a tensor of n elements is saved
// with shape [n], and loading compares element counts only.
//
// Wrappers. Saving a DataParallel or DDP wrapper saves its module() (the master model, or this
// rank's replica) under the model's own names: never with a "module." prefix. In DDP save on rank
// 0 only (all ranks hold the same parameters) and load on every rank. Loading accepts names with
// or without a leading "module." (files saved from a wrapped PyTorch model).
//
// Loading checks everything before it changes anything: on error the model is untouched. Names
// whose shape or dtype differ are an error even when loading non-strictly; the error lists the
// missing, unexpected and mismatched names together. The tensors are read into a staging buffer
// first and copied into the model only once every read succeeded and the file's size and header
// are those it had when it was opened: a file truncated or rewritten in place during the load is
// an error that leaves the model as it was (the cost: memory for one copy of the loaded tensors
// and one memory copy of them). Tensors of safetensors dtypes dparallel does not handle (BOOL,
// I8, U16, F8_*, ...) fail a strict load; a non-strict one skips them and lists them in
// load_result::skipped.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/core/detail/printable.hpp>
#include <dparallel/io/detail/staging.hpp>
#include <dparallel/io/safetensors.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <new>
#include <optional>
#include <ranges>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {

template <class M>
concept member_buffer_names = requires(M& m) {
  { m.buffer_names() } -> name_range;
};
template <class M>
concept traits_buffer_names = requires(M& m) {
  { model_traits<M>::buffer_names(m) } -> name_range;
};
template <class M>
concept member_buffer_shapes = requires(M& m) {
  { m.buffer_shapes() } -> shape_range;
};
template <class M>
concept traits_buffer_shapes = requires(M& m) {
  { model_traits<M>::buffer_shapes(m) } -> shape_range;
};

template <class R>
std::vector<std::string> to_names(R&& r) {
  std::vector<std::string> out;
  for (auto&& n : r) out.emplace_back(std::string_view(n));
  return out;
}
template <class R>
std::vector<std::vector<std::uint64_t>> to_shapes(R&& r) {
  std::vector<std::vector<std::uint64_t>> out;
  for (auto&& s : r) {
    std::vector<std::uint64_t> shape;
    for (auto d : s) {
      if constexpr (std::is_signed_v<decltype(d)>)
        detail::require(d >= 0, "the model gives a shape with a negative dimension: " + std::to_string(d));
      shape.push_back(static_cast<std::uint64_t>(d));
    }
    out.push_back(std::move(shape));
  }
  return out;
}

/// A DataParallel / DDP wrapper (anything with a model_type and a module() returning it).
template <class W>
concept model_wrapper = requires(W& w) {
  typename W::model_type;
  { w.module() } -> std::same_as<typename W::model_type&>;
};

/// The model inside a wrapper, or the model itself.
template <class X>
auto& unwrap_model(X& x) noexcept {
  if constexpr (model_wrapper<X>) return x.module();
  else return x;
}

}  // namespace detail

/// The names of m's parameters, in parameters() order: from m.parameter_names() or
/// model_traits<M>::parameter_names(m), else "param.0", "param.1", ...
template <model M>
std::vector<std::string> parameter_names(M& m) {
  std::size_t const n = parameter_refs(m).size();
  std::vector<std::string> names;
  if constexpr (detail::member_parameter_names<M>) names = detail::to_names(m.parameter_names());
  else if constexpr (detail::traits_parameter_names<M>) names = detail::to_names(model_traits<M>::parameter_names(m));
  else
    for (std::size_t i = 0; i < n; ++i) names.push_back("param." + std::to_string(i));
  detail::require(names.size() == n, "the model gives " + std::to_string(names.size()) + " parameter names for " +
                                         std::to_string(n) + " parameters; give one name per parameter, in "
                                                             "parameters() order");
  return names;
}

/// The names of m's buffers, in buffers() order: from m.buffer_names() or
/// model_traits<M>::buffer_names(m), else "buffer.0", "buffer.1", ...
template <model M>
std::vector<std::string> buffer_names(M& m) {
  std::size_t const n = buffer_refs(m).size();
  std::vector<std::string> names;
  if constexpr (detail::member_buffer_names<M>) names = detail::to_names(m.buffer_names());
  else if constexpr (detail::traits_buffer_names<M>) names = detail::to_names(model_traits<M>::buffer_names(m));
  else
    for (std::size_t i = 0; i < n; ++i) names.push_back("buffer." + std::to_string(i));
  detail::require(names.size() == n, "the model gives " + std::to_string(names.size()) + " buffer names for " +
                                         std::to_string(n) + " buffers; give one name per buffer, in buffers() order");
  return names;
}

/// The model's tensors with their names and shapes: parameters, then buffers. This is what
/// save_state_dict writes and load_state_dict fills. Accepts a model or a DP/DDP wrapper (its
/// module()). Throws invalid_argument when names are duplicated or a shape does not hold its
/// tensor's element count.
template <class X>
std::vector<named_tensor> state_dict(X& model_or_wrapper) {
  auto& m = detail::unwrap_model(model_or_wrapper);
  using M = std::remove_cvref_t<decltype(m)>;
  static_assert(check_model<M>());
  auto const params = parameter_refs(m);
  auto const bufs = buffer_refs(m);
  auto const pnames = parameter_names(m);
  auto const bnames = buffer_names(m);
  std::vector<std::optional<std::vector<std::uint64_t>>> pshapes(params.size()), bshapes(bufs.size());
  auto assign = [](auto& dst, std::vector<std::vector<std::uint64_t>> src, char const* what) {
    detail::require(src.size() == dst.size(), std::string("the model gives ") + std::to_string(src.size()) + " " +
                                                  what + " shapes for " + std::to_string(dst.size()) + " " + what +
                                                  "s");
    for (std::size_t i = 0; i < src.size(); ++i) dst[i] = std::move(src[i]);
  };
  if constexpr (detail::member_parameter_shapes<M>)
    assign(pshapes, detail::to_shapes(m.parameter_shapes()), "parameter");
  else if constexpr (detail::traits_parameter_shapes<M>)
    assign(pshapes, detail::to_shapes(model_traits<M>::parameter_shapes(m)), "parameter");
  if constexpr (detail::member_buffer_shapes<M>) assign(bshapes, detail::to_shapes(m.buffer_shapes()), "buffer");
  else if constexpr (detail::traits_buffer_shapes<M>)
    assign(bshapes, detail::to_shapes(model_traits<M>::buffer_shapes(m)), "buffer");

  std::vector<named_tensor> out;
  out.reserve(params.size() + bufs.size());
  for (std::size_t i = 0; i < params.size(); ++i) out.push_back({pnames[i], params[i], pshapes[i]});
  for (std::size_t i = 0; i < bufs.size(); ++i) out.push_back({bnames[i], bufs[i], bshapes[i]});
  std::unordered_set<std::string_view> seen;
  for (std::size_t i = 0; i < out.size(); ++i) {
    detail::require(seen.insert(out[i].name).second, "state_dict: expected unique tensor names, found '" + out[i].name +
                                                         "' twice (parameters and buffers share one namespace)");
    if (out[i].shape) {
      std::uint64_t n = 1;
      for (auto d : *out[i].shape) n *= d;
      detail::require(n == out[i].data.size(), "state_dict: tensor '" + out[i].name + "' has shape " +
                                                   detail::shape_string(*out[i].shape) + " but " +
                                                   std::to_string(out[i].data.size()) + " elements");
    }
  }
  return out;
}

/// Options of load_state_dict.
struct load_options {
  /// Every tensor of the model must be in the file and every tensor of the file in the model
  /// (PyTorch's strict=True). Without it, missing and unexpected names are reported in the result.
  bool strict = true;
};

/// What load_state_dict did not match (empty after a strict load, which throws instead).
struct load_result {
  std::vector<std::string> missing;     ///< the model's names the file lacks (left unchanged)
  std::vector<std::string> unexpected;  ///< the file's names the model lacks (ignored)
  /// The file's tensors of a dtype dparallel does not handle (see safetensors_reader::unsupported),
  /// skipped by a non-strict load (a strict one fails on them).
  std::vector<std::string> skipped;
};

namespace detail {

/// How the names in a file map to the targets' names.
struct name_mapping {
  /// Strip one leading "module." from the file's names (state dicts of wrapped PyTorch models),
  /// unless the name matches a target as it is.
  bool strip_module = false;
  /// Only file names starting with this prefix belong to the targets (it is removed before matching);
  /// others are ignored.
  std::string prefix;
};

/// Loads `targets` from `file`: validates names, dtypes and shapes of all first, then reads every
/// tensor into a staging buffer, checks that the file did not change meanwhile, and only then
/// copies into the targets, so that any error leaves them unchanged.
inline load_result load_named(safetensors_reader const& file, std::vector<named_tensor> const& targets,
                              load_options const& opts, name_mapping const& mapping, std::string const& what) {
  std::string const where = in_quotes(file.path().string());
  // The file's tensor for each target (null: missing); file names no target has.
  std::vector<tensor_info const*> source(targets.size(), nullptr);
  std::vector<std::string> unexpected;
  std::unordered_map<std::string_view, std::size_t> target_index;
  for (std::size_t i = 0; i < targets.size(); ++i) target_index.emplace(targets[i].name, i);
  std::unordered_set<std::string_view> file_keys;  // the mapped name of every file tensor considered
  // The mapped name of a file tensor, or nothing when it does not belong to the targets.
  auto map_name = [&](std::string const& name) -> std::optional<std::string_view> {
    std::string_view key = name;
    if (!mapping.prefix.empty()) {
      if (!key.starts_with(mapping.prefix)) return std::nullopt;
      key.remove_prefix(mapping.prefix.size());
    }
    // A name the model has as it is matches as it is (a model may name a tensor "module.x");
    // otherwise a leading "module." is dropped.
    if (mapping.strip_module && key.starts_with("module.") && !target_index.contains(key)) key.remove_prefix(7);
    if (!file_keys.insert(key).second)
      throw error("dparallel: " + where + " holds tensor " + in_quotes(key) +
                  " twice (with and without the \"module.\" prefix); keep one of them");
    return key;
  };
  for (auto const& t : file.tensors()) {
    auto const key = map_name(t.name);
    if (!key) continue;
    auto const it = target_index.find(*key);
    if (it != target_index.end()) source[it->second] = &t;
    else unexpected.push_back(t.name);
  }
  load_result result;
  std::vector<std::string> mismatched;
  std::vector<bool> unsupported_source(targets.size(), false);  // the file has it in a dtype not handled
  for (auto const& t : file.unsupported()) {
    auto const key = map_name(t.name);
    if (!key) continue;
    auto const it = target_index.find(*key);
    if (it == target_index.end()) {
      result.skipped.push_back(t.name);
      continue;
    }
    auto const& dst = targets[it->second];
    unsupported_source[it->second] = true;
    mismatched.push_back(in_quotes(dst.name) + " (the file has " + printable(t.dtype) +
                         ", a dtype dparallel does not handle; the " + what + " " +
                         std::string(name_of(dst.data.dtype())) + ")");
  }
  for (std::size_t i = 0; i < targets.size(); ++i) {
    auto const& dst = targets[i];
    tensor_info const* src = source[i];
    if (src == nullptr) {
      if (!unsupported_source[i]) result.missing.push_back(dst.name);
      continue;
    }
    bool const same_dtype = src->type == dst.data.dtype();
    bool const same_shape = dst.shape ? src->shape == *dst.shape : src->elements() == dst.data.size();
    if (!same_dtype || !same_shape) {
      std::vector<std::uint64_t> const want = dst.shape.value_or(std::vector<std::uint64_t>{dst.data.size()});
      mismatched.push_back(in_quotes(dst.name) + " (the file has " + std::string(name_of(src->type)) + " " +
                           shape_string(src->shape) + ", the " + what + " " + std::string(name_of(dst.data.dtype())) +
                           " " + shape_string(want) + ")");
    }
    require(dst.data.device().kind == device_kind::host, [&] {
      return "load " + where + ": tensor " + in_quotes(dst.name) + " is in " + to_string(dst.data.device()) +
             " memory; load into a host copy and copy it to the device";
    });
  }
  bool const names_fail = opts.strict && (!result.missing.empty() || !unexpected.empty() || !result.skipped.empty());
  if (names_fail || !mismatched.empty()) {
    auto list = [](std::vector<std::string> const& v, bool escape) {
      std::string s;
      for (std::size_t i = 0; i < v.size(); ++i) {
        if (i != 0) s.append(", ");
        s.append(escape ? printable(v[i]) : v[i]);
      }
      return s;
    };
    std::string msg = "dparallel: could not load " + where + " into the " + what + ":";
    if (opts.strict && !result.missing.empty()) msg += " missing in the file: " + list(result.missing, true) + ";";
    if (opts.strict && !unexpected.empty())
      msg += " unexpected in the file (the " + what + " has no such tensor): " + list(unexpected, true) + ";";
    if (opts.strict && !result.skipped.empty())
      msg += " of a dtype dparallel does not handle (a non-strict load skips them): " + list(result.skipped, true) +
             ";";
    if (!mismatched.empty()) msg += " shape or dtype mismatch: " + list(mismatched, false) + ";";
    msg += " nothing was loaded; ";
    msg += mismatched.empty() ? "check that the file belongs to this " + what +
                                    ", or load with {.strict = false} to load the names that match"
                              : "a tensor whose shape or dtype differs cannot be loaded, even non-strictly: "
                                "check that the file belongs to this " + what + " and convert it if needed";
    throw error(msg);
  }
  // Stage, check, then copy: the targets change only when everything was read from an unchanged file.
  std::uint64_t total = 0;
  for (auto const* src : source)
    if (src != nullptr) total += src->size_bytes();
  std::optional<staging_buffer> staging;
  try {
    staging.emplace(static_cast<std::size_t>(total));
  } catch (std::bad_alloc const&) {
    throw error("dparallel: could not load " + where + ": not enough memory to stage its " + std::to_string(total) +
                " bytes of tensors before copying them into the " + what + "; nothing was loaded");
  }
  std::uint64_t at = 0;
  for (auto const* src : source) {
    if (src == nullptr) continue;
    file.read_bytes(*src, staging->data() + at);
    at += src->size_bytes();
  }
  file.verify_unchanged();
  at = 0;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (source[i] == nullptr) continue;
    auto const n = static_cast<std::size_t>(source[i]->size_bytes());
    if (n != 0) std::memcpy(targets[i].data.data(), staging->data() + at, n);
    at += n;
  }
  result.unexpected = std::move(unexpected);
  return result;
}

}  // namespace detail

/// Saves the parameters and buffers of a model, or of a DP/DDP wrapper's module(), to `path`
/// (safetensors, written atomically). `metadata` goes to the file's __metadata__, with
/// "format": "pt" added unless it sets "format" (the Hugging Face loaders look for it).
template <class X>
void save_state_dict(std::filesystem::path const& path, X& model_or_wrapper, safetensors_metadata metadata = {}) {
  auto const tensors = state_dict(model_or_wrapper);
  metadata.emplace("format", "pt");
  save_safetensors(path, tensors, metadata);
}

/// Loads the parameters and buffers of a model, or of a DP/DDP wrapper's module(), from `path`.
/// Names may carry a leading "module.". Strict by default; see load_options and load_result.
/// Throws dparallel::error listing the missing, unexpected and mismatched names; then the model
/// is unchanged.
template <class X>
load_result load_state_dict(std::filesystem::path const& path, X& model_or_wrapper, load_options opts = {}) {
  auto const targets = state_dict(model_or_wrapper);
  safetensors_reader const file(path);
  return detail::load_named(file, targets, opts, {.strip_module = true, .prefix = {}}, "model");
}

DPARALLEL_NAMESPACE_END

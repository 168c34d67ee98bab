#pragma once
// The contract-checking mode (options::check_contracts, else DPARALLEL_CHECK_CONTRACTS=1): a debug
// check that the step function kept its side of the step's contract, leaving the gradient of
// its shard in gradients(replica), on the replica it was given.
//
// The contract lets a step function overwrite the gradients or add into them, the latter only
// into gradients that are zero when it starts (zeroed by the user, as module.zero_grad() in
// PyTorch, or by the wrapper). So, on each device just before its step function, each
// floating-point gradient of the replica is filled according to what it holds:
// - a gradient that is not all zeros must be overwritten: it is filled with a quiet NaN whose
//   payload no arithmetic produces (and which x86 keeps through an addition, so `g += ...` keeps
//   it too); an element whose bits are still the pattern after the step function is an error
//   naming the parameter, the elements and the device or rank;
// - a gradient of zeros may be added into: it is filled with -0.0 (a zero, so sums into it are
//   exact), and a step function that left every element of every gradient of its replica at
//   -0.0 wrote nothing (it trained a copy of the model) and is an error; elements left at -0.0
//   are set back to +0.0.
// A gradient marked ready (step_context::grad_ready: under DDP its bucket may be reduced at once)
// is looked at then, and not again. DataParallel replicas whose gradients share memory are an
// error before any step function runs (an address check of every replica's gradients).
//
// Gradient accumulation (no_sync) changes nothing here: the reducer accumulates into storage of
// its own, and the step function writes its micro-step's gradient afresh every time, so every
// step is filled and checked. Parameters a DDP step never marks ready with
// options::find_unused_parameters are not checked (their gradients count as zeros) and are left
// zeroed. Models whose traits have begin_shard (framework adapters: libtorch zeroes the gradients
// there and autograd accumulates into them) keep their own protocol and are not checked.
//
// Gradients outside host memory (CUDA) are read through Backend::read_to_host(host_dst, src) (a
// copy waited for) and filled by the backend's copy from host memory, on the device's stream; a
// backend without read_to_host leaves them unchecked. A GPU turns any NaN arithmetic produces into
// its canonical NaN, so there `g += ...` into a gradient that was not zero is not caught.
//
// Off, it costs one branch per step and per grad_ready call. On, it costs a few passes over
// every gradient per step; its lists are kept across steps.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// Whether the mode is on: `option` (options::check_contracts) when it holds a value, else whether
/// DPARALLEL_CHECK_CONTRACTS is set to anything but "" or "0".
inline bool contract_check_requested(std::optional<bool> option) {
  if (option) return *option;
  char const* env = std::getenv("DPARALLEL_CHECK_CONTRACTS");  // NOLINT(concurrency-mt-unsafe): read once per wrapper
  return env != nullptr && std::string_view(env) != "" && std::string_view(env) != "0";
}

/// The fill of replica `replica` for one element of `t`, as bits (0 for a dtype that is not
/// floating-point: those are not filled). Quiet NaNs with a payload: 0xDE in the low bits marks
/// dparallel's, the replica index above it (mod 16, which is enough to tell neighbours apart).
constexpr std::uint64_t contract_pattern(dtype t, std::size_t replica) noexcept {
  auto const r = static_cast<std::uint64_t>(replica % 16);
  switch (t) {
    case dtype::f32: return 0x7FC0'C0DEu | (r << 16);
    case dtype::f64: return 0x7FF8'0000'C0DE'C0DEull | (r << 32);
    case dtype::f16: return 0x7E00u | 0xDEu | ((r & 1) << 8);    // 9 payload bits
    case dtype::bf16: return 0x7FC0u | 0x1Eu | ((r & 1) << 5);   // 6 payload bits
    default: return 0;
  }
}

/// The ranges of elements of `t` (host memory) whose bits equal `bits`, as "0..9, 12, 20..29" (at
/// most four ranges listed), and how many elements hold it in all; "" when none does.
inline std::string pattern_ranges(void const* data, std::size_t n, std::size_t width, std::uint64_t bits,
                                  std::size_t& count) {
  auto const at = [&](std::size_t k) {
    std::uint64_t v = 0;
    std::memcpy(&v, static_cast<std::byte const*>(data) + k * width, width);  // little-endian: the low bytes
    return v == bits;
  };
  std::string out;
  std::size_t listed = 0, runs = 0;
  count = 0;
  for (std::size_t k = 0; k < n;) {
    if (!at(k)) {
      ++k;
      continue;
    }
    std::size_t e = k;
    while (e + 1 < n && at(e + 1)) ++e;
    count += e - k + 1;
    ++runs;
    if (listed < 4) {
      out += (listed++ ? ", " : "") + std::to_string(k) + (e == k ? "" : ".." + std::to_string(e));
    }
    k = e + 1;
  }
  if (runs > listed) out += " and " + std::to_string(runs - listed) + " more range" + (runs - listed == 1 ? "" : "s");
  return out;
}

/// How many of the `n` elements at `data` (host memory, `width` bytes each) hold the bits `bits`.
inline std::size_t pattern_count(void const* data, std::size_t n, std::size_t width, std::uint64_t bits) noexcept {
  auto const* p = static_cast<std::byte const*>(data);
  std::size_t count = 0;
  for (std::size_t k = 0; k < n; ++k, p += width) {
    std::uint64_t v = 0;
    std::memcpy(&v, p, width);
    count += v == bits ? 1 : 0;
  }
  return count;
}

/// The bits of -0.0 in `t` (0 for a dtype that is not floating-point).
constexpr std::uint64_t negative_zero(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return 0x8000'0000u;
    case dtype::f64: return 0x8000'0000'0000'0000ull;
    case dtype::f16:
    case dtype::bf16: return 0x8000u;
    default: return 0;
  }
}

/// Sets the `n` elements at `data` (host memory, `width` bytes each) to the bits `bits`.
inline void put_bits(void* data, std::size_t n, std::size_t width, std::uint64_t bits) noexcept {
  auto* p = static_cast<std::byte*>(data);
  for (std::size_t k = 0; k < n; ++k, p += width) std::memcpy(p, &bits, width);
}
/// The same for the elements that hold the bits `only`.
inline void replace_bits(void* data, std::size_t n, std::size_t width, std::uint64_t only,
                         std::uint64_t bits) noexcept {
  auto* p = static_cast<std::byte*>(data);
  for (std::size_t k = 0; k < n; ++k, p += width) {
    std::uint64_t v = 0;
    std::memcpy(&v, p, width);
    if (v == only) std::memcpy(p, &bits, width);
  }
}

/// One wrapper's contract checker (see the top of this file); its `Set` arguments are the wrapper's
/// replica_set.
template <class Model, class Backend>
class contract_check {
  enum fill : char { none, overwrite, accumulate };  // how a gradient was filled this step

 public:
  /// Turns the mode on or off (at construction: options::check_contracts or the variable).
  void enable(bool on) noexcept { on_ = on && !traits_begin_shard<Model>; }
  /// Whether the mode is on.
  [[nodiscard]] bool on() const noexcept { return on_; }

  /// Before the step functions are enqueued, on the calling thread: sizes the per-device lists and
  /// checks that no two replicas' gradients share memory.
  template <class Set>
  void before_compute(Set& s) {
    fills_.resize(s.size());
    done_.resize(s.size());
    wrote_.assign(s.size(), 0);
    scratch_.resize(s.size());  // here: the devices' threads use their own entries
    for (std::size_t i = 0; i < s.size(); ++i) {
      fills_[i].assign(s.grads[i].size(), none);
      done_[i].assign(s.grads[i].size(), 0);
    }
    spans_.clear();
    for (std::size_t i = 0; i < s.size(); ++i)
      if (s.active(i))
        for (std::size_t p = 0; p < s.grads[i].size(); ++p)
          if (s.grads[i][p].size() != 0) spans_.push_back({s.grads[i][p].data(), s.grads[i][p].size_bytes(), i, p});
    std::sort(spans_.begin(), spans_.end(), [](span const& a, span const& b) {
      return std::less<>{}(a.at, b.at) || (a.at == b.at && a.replica < b.replica);
    });
    for (std::size_t k = 1; k < spans_.size(); ++k) {
      span const& a = spans_[k - 1];
      span const& b = spans_[k];
      auto const a_end = reinterpret_cast<std::uintptr_t>(a.at) + a.bytes;
      if (a.replica == b.replica || reinterpret_cast<std::uintptr_t>(b.at) >= a_end) continue;
      throw invalid_argument("dparallel: DataParallel: gradient " + parameter_label(*s.models[b.replica], b.param) +
                             " on " + to_string(s.devices[b.replica]) + " shares memory with gradient " +
                             parameter_label(*s.models[a.replica], a.param) + " on " + to_string(s.devices[a.replica]) +
                             "; every replica needs gradient storage of its own: a replica made by copying must not "
                             "keep pointers into the model it was copied from");
    }
  }

  /// On replica i's stream, just before its step function: fills its gradients (see the top of
  /// this file).
  template <class Set>
  void fill_device(Set& s, std::size_t i) {
    for (std::size_t p = 0; p < s.grads[i].size(); ++p) {
      tensor_ref const g = s.grads[i][p];
      std::uint64_t const nan = contract_pattern(g.dtype(), i);
      if (nan == 0 || g.size() == 0) continue;
      std::size_t const w = size_of(g.dtype());
      void* data = readable(i, g);
      if (data == nullptr) continue;  // not in host memory, and the backend cannot read it
      std::uint64_t const nz = negative_zero(g.dtype());
      bool const zeros = pattern_count(data, g.size(), w, 0) + pattern_count(data, g.size(), w, nz) == g.size();
      fills_[i][p] = zeros ? accumulate : overwrite;
      put_bits(data, g.size(), w, zeros ? nz : nan);
      write_back(i, g, data);
    }
  }

  /// From step_context::grad_ready(param) on replica `replica`: gradient `param` is final; it is
  /// checked now, before a reducer reads it.
  template <class Set>
  void on_ready(Set& s, std::size_t replica, std::size_t param) {
    if (replica >= done_.size() || param >= done_[replica].size() || done_[replica][param]) return;
    done_[replica][param] = 1;
    inspect(s, replica, param, false);  // the reducer may already read it: left as it is
  }

  /// On replica i's stream, after its step function returned: checks every gradient not checked
  /// when it was marked ready, then whether the step function wrote anything at all.
  template <class Set>
  void after_step(Set& s, std::size_t i) {
    auto& done = done_[i];
    bool any = false;
    for (char m : done) any = any || m != 0;
    for (std::size_t p = 0; p < done.size(); ++p) {
      if (done[p]) continue;
      if (any && s.opts.find_unused_parameters) {  // unused: a zero gradient, not the pattern
        Backend::immediate::zero(s.grads[i][p]);
        wrote_[i] = 1;
        continue;
      }
      inspect(s, i, p, true);
    }
    bool filled = false;
    for (char f : fills_[i]) filled = filled || f != none;
    if (!filled || wrote_[i]) return;
    throw invalid_argument("dparallel: the step function wrote none of the gradients of the replica on " + here(s, i) +
                           " (every element still holds the -0.0 the contract check put in the zeroed "
                           "gradients): it trained a copy of the model? Take the model as `Model&`; a step "
                           "function that computes no gradient on purpose (a forward pass only) needs "
                           "options::check_contracts = false. " +
                           std::string(reason));
  }

 private:
  static constexpr char const* reason =
      "The check is on because of options::check_contracts or DPARALLEL_CHECK_CONTRACTS";

  struct span {
    void const* at;
    std::size_t bytes;
    std::size_t replica, param;
  };

  template <class Set>
  static std::string here(Set& s, std::size_t i) {
    return s.group.valid() ? "rank " + std::to_string(s.rank()) : "device " + to_string(s.devices[i]);
  }

  // The gradient's elements where the host can read and write them: in place in host memory, else
  // a copy read through the backend (null when it cannot).
  void* readable(std::size_t replica, tensor_ref g) {
    if (g.device().kind == device_kind::host) return g.data();
    if constexpr (requires(tensor_ref a) { Backend::read_to_host(a, a); }) {
      auto& h = scratch_[replica];
      h.resize(g.size_bytes());
      Backend::read_to_host(tensor_ref(h.data(), g.size(), g.dtype()), g);
      return h.data();
    } else {
      return nullptr;
    }
  }
  // After `data` (from readable) was changed: the copy goes back to the gradient.
  static void write_back(std::size_t, tensor_ref g, void* data) {
    if (data != g.data()) Backend::immediate::copy(g, tensor_ref(data, g.size(), g.dtype()));
  }

  template <class Set>
  void inspect(Set& s, std::size_t i, std::size_t p, bool restore) {
    auto const how = static_cast<fill>(fills_[i][p]);
    if (how == none) return;
    tensor_ref const g = s.grads[i][p];
    std::size_t const w = size_of(g.dtype());
    void* data = readable(i, g);
    if (data == nullptr) return;
    if (how == accumulate) {
      std::uint64_t const nz = negative_zero(g.dtype());
      std::size_t const left = pattern_count(data, g.size(), w, nz);
      if (left < g.size()) wrote_[i] = 1;
      if (restore && left != 0) {  // never written, or added nothing: +0.0, as without the check
        replace_bits(data, g.size(), w, nz, 0);
        write_back(i, g, data);
      }
      return;
    }
    std::uint64_t const bits = contract_pattern(g.dtype(), i);
    if (pattern_count(data, g.size(), w, bits) == 0) {
      wrote_[i] = 1;
      return;
    }
    std::size_t n = 0;
    std::string const ranges = pattern_ranges(data, g.size(), w, bits, n);
    throw invalid_argument("dparallel: the step function did not write gradient " + parameter_label(*s.models[i], p) +
                           " elements " + ranges + " (" + std::to_string(n) + " of " + std::to_string(g.size()) +
                           " elements still hold the NaN pattern the contract check wrote before the step) on " +
                           here(s, i) +
                           "; a step function must overwrite every element of a gradient that is not zero when it "
                           "starts (add into a gradient only after zeroing it), on the replica it is given (take the "
                           "model as `Model&`). " +
                           std::string(reason));
  }

  bool on_ = false;
  std::vector<std::vector<char>> fills_;  // per replica and parameter: a fill value this step
  std::vector<std::vector<char>> done_;   // per replica and parameter: checked at grad_ready
  std::vector<char> wrote_;               // per replica: the step function wrote some gradient element
  std::vector<span> spans_;               // before_compute: every replica's gradients, by address
  std::vector<std::vector<std::byte>> scratch_;  // per replica: a host copy (gradients not in host memory)
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

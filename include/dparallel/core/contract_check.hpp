#pragma once
// The contract-checking mode (options::check_contracts, else DPARALLEL_CHECK_CONTRACTS=1): a debug
// check that the step function kept its side of the step's contract, leaving the gradient of
// its shard in gradients(replica), every element of it, on the replica it was given.
//
// Before the step functions run, every floating-point gradient of every replica that runs one is
// filled with a pattern: a quiet NaN whose payload no arithmetic produces (and which x86 keeps
// through an addition, so `g += ...` keeps it too), different per replica. After a step function
// returns, and earlier for a gradient it marks ready (step_context::grad_ready: under DDP its
// bucket may be reduced at once), an element whose bits are still the pattern is an error naming
// the parameter, the elements and the device or rank. That catches a model taken by value
// (nothing written), a step function that writes only part of a gradient or adds into it, and
// (DataParallel) replicas whose gradients share memory: a replica's fill then overwrites
// another's, which is seen before any step function runs.
//
// Gradient accumulation (no_sync) changes nothing here: the reducer accumulates into storage of
// its own, and the step function writes its micro-step's gradient afresh every time, so every
// step is filled and checked. Parameters a DDP step never marks ready with
// options::find_unused_parameters are not checked (their gradients count as zeros) and are left
// zeroed. Models whose traits have begin_shard (framework adapters: libtorch zeroes the gradients
// there and autograd accumulates into them) keep their own protocol and are not checked.
//
// Gradients outside host memory (CUDA) are filled by the backend's copy from a host pattern on the
// device's stream, and read back through Backend::read_to_host(host_dst, src) (a copy waited for);
// a backend without read_to_host leaves them unchecked. A GPU turns any NaN arithmetic produces
// into its canonical NaN, so there `g += ...` is not caught, only elements never written.
//
// Off, it costs one branch per step and per grad_ready call. On, it costs a write and a read of
// every gradient per step, and the first step allocates the pattern.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/model.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
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

/// One wrapper's contract checker (see the top of this file); its `Set` arguments are the wrapper's
/// replica_set.
template <class Model, class Backend>
class contract_check {
 public:
  /// Turns the mode on or off (at construction: options::check_contracts or the variable).
  void enable(bool on) noexcept { on_ = on && !traits_begin_shard<Model>; }
  /// Whether the mode is on.
  [[nodiscard]] bool on() const noexcept { return on_; }

  /// Before the step functions are enqueued, on the calling thread: fills every gradient of every
  /// replica that runs a step function (host memory here; other memory is filled by fill_device on
  /// the device's own stream), then checks that no replica's fill overwrote another's.
  template <class Set>
  void before_compute(Set& s) {
    marked_.resize(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) marked_[i].assign(s.grads[i].size(), 0);
    scratch_.resize(s.size());  // here: the devices' threads use their own entries
    bool host = true;
    for (std::size_t i = 0; i < s.size(); ++i)
      for (auto const& g : s.grads[i]) host = host && g.device().kind == device_kind::host;
    host_ = host;
    if (!host_) return;
    for (std::size_t i = 0; i < s.size(); ++i)
      if (s.active(i))
        for (auto const& g : s.grads[i]) fill_host(g, i);
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (!s.active(i)) continue;
      for (std::size_t p = 0; p < s.grads[i].size(); ++p) {
        tensor_ref const g = s.grads[i][p];
        std::uint64_t const bits = contract_pattern(g.dtype(), i);
        if (bits == 0 || g.size() == 0) continue;
        std::size_t const n = pattern_count(g.data(), g.size(), size_of(g.dtype()), bits);
        if (n == g.size()) continue;
        throw invalid_argument("dparallel: " + where(s, i) + ": gradient " + parameter_label(*s.models[i], p) +
                               " shares memory with the gradients of another replica (" +
                               std::to_string(g.size() - n) + " of its " + std::to_string(g.size()) +
                               " elements were overwritten when the other replicas' gradients were prepared for "
                               "the step); every replica needs gradient storage of its own: a replica made by "
                               "copying must not keep pointers into the model it was copied from");
      }
    }
  }

  /// On replica i's stream, before its step function: fills its gradients when they are not in
  /// host memory (through the backend's copy from a host pattern).
  template <class Set>
  void fill_device(Set& s, std::size_t i) {
    if (host_) return;
    if constexpr (requires(tensor_ref a) { Backend::read_to_host(a, a); }) {
      for (auto const& g : s.grads[i]) {
        std::uint64_t const bits = contract_pattern(g.dtype(), i);
        if (bits == 0 || g.size() == 0) continue;
        auto& h = host_copy(i, g);
        for (std::size_t k = 0; k < g.size(); ++k)
          std::memcpy(h.data() + k * size_of(g.dtype()), &bits, size_of(g.dtype()));
        Backend::immediate::copy(g, tensor_ref(h.data(), g.size(), g.dtype()));
      }
    }
  }

  /// From step_context::grad_ready(param) on replica `replica`: gradient `param` is final; it is
  /// checked now, before a reducer reads it.
  template <class Set>
  void on_ready(Set& s, std::size_t replica, std::size_t param) {
    if (replica >= marked_.size() || param >= marked_[replica].size() || marked_[replica][param]) return;
    marked_[replica][param] = 1;
    check(s, replica, param);
  }

  /// On replica i's stream, after its step function returned: checks every gradient not checked
  /// when it was marked ready.
  template <class Set>
  void after_step(Set& s, std::size_t i) {
    auto& marked = marked_[i];
    bool any = false;
    for (char m : marked) any = any || m != 0;
    for (std::size_t p = 0; p < marked.size(); ++p) {
      if (marked[p]) continue;
      if (any && s.opts.find_unused_parameters) {  // unused: a zero gradient, not the pattern
        Backend::immediate::zero(s.grads[i][p]);
        continue;
      }
      check(s, i, p);
    }
  }

 private:
  template <class Set>
  static std::string where(Set& s, std::size_t i) {
    return s.group.valid() ? "DDP on rank " + std::to_string(s.rank()) : "DataParallel on " + to_string(s.devices[i]);
  }

  void fill_host(tensor_ref g, std::size_t replica) const {
    std::uint64_t const bits = contract_pattern(g.dtype(), replica);
    if (bits == 0) return;
    auto* p = static_cast<std::byte*>(g.data());
    std::size_t const w = size_of(g.dtype());
    for (std::size_t k = 0; k < g.size(); ++k, p += w) std::memcpy(p, &bits, w);
  }

  std::vector<std::byte>& host_copy(std::size_t replica, tensor_ref g) {
    scratch_[replica].resize(g.size_bytes());
    return scratch_[replica];
  }

  template <class Set>
  void check(Set& s, std::size_t i, std::size_t p) {
    tensor_ref const g = s.grads[i][p];
    std::uint64_t const bits = contract_pattern(g.dtype(), i);
    if (bits == 0 || g.size() == 0) return;
    void const* data = g.data();
    if (!host_) {
      if constexpr (requires(tensor_ref a) { Backend::read_to_host(a, a); }) {
        auto& h = host_copy(i, g);
        Backend::read_to_host(tensor_ref(h.data(), g.size(), g.dtype()), g);
        data = h.data();
      } else {
        return;
      }
    }
    std::size_t const w = size_of(g.dtype());
    if (pattern_count(data, g.size(), w, bits) == 0) return;
    std::size_t n = 0;
    std::string const ranges = pattern_ranges(data, g.size(), w, bits, n);
    throw invalid_argument(
        "dparallel: the step function did not write gradient " +
        parameter_label(*s.models[i], p) + " elements " + ranges + " (" + std::to_string(n) + " of " +
        std::to_string(g.size()) + " elements still hold the NaN pattern the contract check wrote before the step) on " +
        (s.group.valid() ? "rank " + std::to_string(s.rank()) : "device " + to_string(s.devices[i])) +
        "; a step function must assign every element of every gradient of the replica it is given (take the model "
        "as `Model&`, not by value; write `g = ...`, not `g += ...`); the check is on because of "
        "options::check_contracts or DPARALLEL_CHECK_CONTRACTS");
  }

  bool on_ = false;
  bool host_ = true;  // this step's gradients are all in host memory (filled in before_compute)
  std::vector<std::vector<char>> marked_;        // per replica and parameter: checked at grad_ready
  std::vector<std::vector<std::byte>> scratch_;  // per replica: a host copy (gradients not in host memory)
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

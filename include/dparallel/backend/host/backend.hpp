#pragma once
// The host backend: logical devices are worker threads over host memory. It is a real backend,
// the one that runs everywhere: the same policy code drives it and the CUDA backend.

#include <dparallel/config.hpp>
#include <dparallel/backend/host/kernels.hpp>
#include <dparallel/backend/host/stream.hpp>
#include <dparallel/core/buffer.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dp_plan.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace host {

/// `n` logical host devices, host:0 .. host:n-1.
inline std::vector<device> devices(int n) {
  dparallel::detail::require(n > 0, "host::devices: expected at least one device, found " + std::to_string(n));
  std::vector<device> out;
  for (int i = 0; i < n; ++i) out.push_back(device{device_kind::host, i});
  return out;
}

/// The backend tag handed to parallel<>: its stream and event types and its kernels.
struct backend {
  /// A logical device's ordered worker queue.
  using stream_type = host::stream;
  /// What the stream operations return: an event to wait on.
  using event_type = host::event;
  /// The kind of device this backend runs on.
  static constexpr device_kind kind = device_kind::host;
  /// DataParallel's copies and sums are shared out in stripes (core/dp_plan.hpp): threads read
  /// what another core just wrote fastest from the shared cache.
  static constexpr dp_sharing dp_share = dp_sharing::stripes;

  /// One logical device per hardware thread (at least one): the default device list.
  static std::vector<device> all_devices() {
    return devices(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  }
  /// Throws invalid_argument unless `d` is a host device.
  static void check_device(device d) {
    dparallel::detail::require(d.kind == device_kind::host && d.index >= 0,
                               "host backend: expected a host device with index >= 0, found " + to_string(d));
  }
  /// Throws invalid_argument naming `what` unless `t` is host memory.
  static void check_view(tensor_ref t, device d, char const* what) {
    dparallel::detail::require(t.device().kind == device_kind::host,
                               std::string(what) + ": expected host memory on " + to_string(d) + ", found a view on " +
                                   to_string(t.device()));
  }

  /// Kernels run on the calling thread, which must be the stream's own worker (work already
  /// ordered on the stream, like a kernel launched from a stream callback).
  struct immediate {
    /// dst = src.
    static void copy(tensor_ref dst, tensor_ref src) { host::copy(dst, src); }
    /// dst *= alpha.
    static void scale(tensor_ref dst, double alpha) { host::scale(dst, alpha); }
    /// dst += alpha * src.
    static void add_scaled(tensor_ref dst, tensor_ref src, double alpha) { host::add_scaled(dst, src, alpha); }
    /// dst = 0.
    static void zero(tensor_ref dst) {
      if (dst.size() != 0) std::memset(dst.data(), 0, dst.size_bytes());
    }
  };
  /// Owning memory of `bytes` zeroed bytes on a device (bucket storage), 64-byte aligned.
  static std::shared_ptr<std::byte> allocate(device, std::size_t bytes) {
    auto owner = std::make_shared<buffer<std::byte>>(bytes);
    return std::shared_ptr<std::byte>(owner, owner->data());
  }

  // Kernels enqueued on a stream by the policies.
  /// Enqueues dst = src on `s`; the event completes when the copy has.
  static event copy(stream_type& s, tensor_ref dst, tensor_ref src) {
    return s.enqueue([=] { host::copy(dst, src); });
  }
  /// Copies each src[i] to dst[i] as one piece of work (the coalesced form).
  static event copy_all(stream_type& s, std::vector<tensor_ref> dst, std::vector<tensor_ref> src) {
    return s.enqueue([dst = std::move(dst), src = std::move(src)] {
      for (std::size_t i = 0; i < dst.size(); ++i) host::copy(dst[i], src[i]);
    });
  }
  /// Enqueues dst = sum_k w[k] * srcs[k] on `s` (host::weighted_sum's pairwise order).
  static event weighted_sum(stream_type& s, tensor_ref dst, std::vector<tensor_ref> srcs, std::vector<double> w) {
    return s.enqueue([=, srcs = std::move(srcs), w = std::move(w)] { host::weighted_sum(dst, srcs, w); });
  }

  // Borrowed forms, for the policies' steady state: the lists are read when the work runs, not
  // copied, so the caller keeps them alive and unchanged until the returned event completes (the
  // policies hold them as members, and every step ends by draining the streams). They do what
  // the forms above do without allocating the lists each step. They are overloads of the same
  // names on purpose: a backend derived from this one that replaces copy_all or weighted_sum
  // hides them too, and the policies then fall back to calling its replacement.

  /// copy_all over borrowed lists: dst[i] = src[i] for each i, as one piece of work.
  static event copy_all(stream_type& s, std::span<tensor_ref const> dst, std::span<tensor_ref const> src) {
    if (dst.size() != src.size())
      throw invalid_argument("dparallel: host::backend::copy_all: expected as many destinations as sources, found " +
                             std::to_string(dst.size()) + " and " + std::to_string(src.size()));
    return s.enqueue([dst, src] {
      for (std::size_t i = 0; i < dst.size(); ++i) host::copy(dst[i], src[i]);
    });
  }
  /// Several weighted sums over borrowed lists, in order, as one piece of work: for each
  /// j < dst.size(), dst[j] = sum_k w[k] * srcs[j * w.size() + k] (host::weighted_sum's order).
  static event weighted_sum(stream_type& s, std::span<tensor_ref const> dst, std::span<tensor_ref const> srcs,
                            std::span<double const> w) {
    if (srcs.size() != dst.size() * w.size())
      throw invalid_argument("dparallel: host::backend::weighted_sum: expected " + std::to_string(w.size()) +
                             " sources (one per weight) for each of the " + std::to_string(dst.size()) +
                             " destinations, found " + std::to_string(srcs.size()) + " sources");
    return s.enqueue([dst, srcs, w] {
      for (std::size_t j = 0; j < dst.size(); ++j) host::weighted_sum(dst[j], srcs.subspan(j * w.size(), w.size()), w);
    });
  }
};

}  // namespace host
DPARALLEL_NAMESPACE_END

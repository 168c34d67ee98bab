#pragma once
// linreg<T> (tests/models.hpp) with its parameters, gradients and buffer in GPU memory: the model
// the DataParallel contracts use on the CUDA backend. The same arithmetic, in the same order, as
// the host model: one thread per sample for the residuals, one thread per weight summing over the
// samples in order, so results are deterministic. Its work goes to cuda::current_stream() (the
// logical device's stream inside a step; the legacy stream outside).
#include "../models.hpp"

#include <dparallel/backend/cuda/backend.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

namespace test {

namespace kernels {
template <class T>
__global__ void residuals(T const* w, T const* b, T const* x, T const* y, T* r, std::size_t n, std::size_t dim) {
  std::size_t const i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  T pred = b[0];
  for (std::size_t j = 0; j < dim; ++j) pred = pred + w[j] * x[i * dim + j];
  r[i] = pred - y[i];
}
template <class T>
__global__ void gradients(T const* r, T const* x, T* gw, T* gb, T* loss, T* seen, std::size_t n, std::size_t dim) {
  std::size_t const j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  T const inv = T(1) / static_cast<T>(n);
  if (j < dim) {
    T acc = 0;
    for (std::size_t i = 0; i < n; ++i) acc = acc + r[i] * x[i * dim + j];
    gw[j] = acc * inv;
  }
  if (j == dim) {
    T acc = 0, l = 0;
    for (std::size_t i = 0; i < n; ++i) {
      acc = acc + r[i];
      l = l + T(0.5) * r[i] * r[i];
    }
    gb[0] = acc * inv;
    loss[0] = l * inv;
    seen[0] = seen[0] + static_cast<T>(n);
  }
}
template <class T>
__global__ void sgd(T* w, T const* g, T lr, std::size_t n) {
  std::size_t const i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) w[i] = w[i] - lr * g[i];
}
}  // namespace kernels

template <class T>
struct cuda_linreg {
  using buf = dparallel::cuda::device_buffer<T>;
  dparallel::device dev{dparallel::device_kind::cuda, 0, 0};
  std::size_t dim = 0;
  buf w, b, gw, gb, seen;

  explicit cuda_linreg(std::size_t d = 4, std::uint64_t seed = 1, dparallel::device on = {dparallel::device_kind::cuda, 0, 0})
      : dev(on), dim(d) {
    linreg<T> host(d, seed);
    allocate();
    upload(w, host.w);
    upload(b, host.b);
  }
  cuda_linreg(cuda_linreg const& o) : dev(o.dev), dim(o.dim) { copy_from(o); }
  cuda_linreg& operator=(cuda_linreg const& o) {
    if (this != &o) {
      dev = o.dev;
      dim = o.dim;
      copy_from(o);
    }
    return *this;
  }
  /// A replica on another GPU (or lane): its own memory on that GPU.
  cuda_linreg make_replica(dparallel::device d) const {
    cuda_linreg r(*this);
    if (d.index != dev.index) {
      r.dev = d;
      r.copy_from(*this);
    }
    return r;
  }

  auto parameters() { return std::array{w.view(), b.view()}; }
  auto gradients() { return std::array{gw.view(), gb.view()}; }
  auto buffers() { return std::array{seen.view()}; }

  T forward_backward(samples<T> const& s) {
    dparallel::cuda::device_guard g(dev.index);
    cudaStream_t const st = dparallel::cuda::current_stream();
    std::size_t const n = s.x.rows();
    auto const scratch = dparallel::cuda::uninitialized;  // every element is written before it is read
    buf x(s.x.size(), dev, st, scratch), y(n, dev, st, scratch), r(n, dev, st, scratch), loss(1, dev, st, scratch);
    // The shard is host memory (outside DataParallel) or memory of this GPU (DataParallel's
    // scatter put it there): cudaMemcpyDefault reads either.
    check(cudaMemcpyAsync(x.data(), s.x.data(), s.x.size() * sizeof(T), cudaMemcpyDefault, st));
    check(cudaMemcpyAsync(y.data(), s.y.data(), n * sizeof(T), cudaMemcpyDefault, st));
    kernels::residuals<<<blocks(n), 128, 0, st>>>(w.data(), b.data(), x.data(), y.data(), r.data(), n, dim);
    kernels::gradients<<<blocks(dim + 1), 128, 0, st>>>(r.data(), x.data(), gw.data(), gb.data(), loss.data(),
                                                        seen.data(), n, dim);
    check(cudaGetLastError());
    T out = 0;
    check(cudaMemcpyAsync(&out, loss.data(), sizeof(T), cudaMemcpyDeviceToHost, st));
    check(cudaStreamSynchronize(st));
    return out;
  }
  /// Per-sample predictions, computed on the host from the samples wherever they live.
  std::vector<T> predict(samples<T> const& s) {
    auto const h = to_host();
    if (s.x.device().kind != dparallel::device_kind::cuda) return h.predict(s);
    std::vector<T> x(s.x.size()), y(s.y.size());
    check(cudaStreamSynchronize(dparallel::cuda::current_stream()));  // the shard's copy is on this stream
    check(cudaMemcpy(x.data(), s.x.data(), x.size() * sizeof(T), cudaMemcpyDefault));
    check(cudaMemcpy(y.data(), s.y.data(), y.size() * sizeof(T), cudaMemcpyDefault));
    return h.predict(samples<T>{dparallel::tensor_view<T const>(x.data(), x.size(), s.x.rows()), dparallel::view(y)});
  }
  void sgd(T lr) {
    dparallel::cuda::device_guard g(dev.index);
    cudaStream_t const st = dparallel::cuda::current_stream();
    kernels::sgd<<<blocks(dim), 128, 0, st>>>(w.data(), gw.data(), lr, dim);
    kernels::sgd<<<1, 1, 0, st>>>(b.data(), gb.data(), lr, std::size_t{1});
    check(cudaGetLastError());
    check(cudaStreamSynchronize(st));
  }
  /// The same model in host memory.
  linreg<T> to_host() const {
    linreg<T> h(dim, 1);
    download(h.w, w);
    download(h.b, b);
    download(h.gw, gw);
    download(h.gb, gb);
    download(h.seen, seen);
    return h;
  }

 private:
  static unsigned blocks(std::size_t n) { return static_cast<unsigned>((n + 127) / 128 == 0 ? 1 : (n + 127) / 128); }
  static void check(cudaError_t e) { dparallel::cuda::check(e, "test model"); }
  void allocate() {
    dparallel::cuda::device_guard g(dev.index);
    w = buf(dim, dev);
    b = buf(1, dev);
    gw = buf(dim, dev);
    gb = buf(1, dev);
    seen = buf(1, dev);
    check(cudaDeviceSynchronize());
  }
  void upload(buf& dst, std::vector<T> const& src) const {
    dparallel::cuda::device_guard g(dev.index);
    check(cudaMemcpy(dst.data(), src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  void download(std::vector<T>& dst, buf const& src) const {
    dparallel::cuda::device_guard g(dev.index);
    check(cudaDeviceSynchronize());
    check(cudaMemcpy(dst.data(), src.data(), dst.size() * sizeof(T), cudaMemcpyDeviceToHost));
  }
  void copy_from(cuda_linreg const& o) {
    allocate();
    dparallel::cuda::device_guard g(o.dev.index);
    check(cudaDeviceSynchronize());
    for (auto [dst, src] : {std::pair{&w, &o.w}, std::pair{&b, &o.b}, std::pair{&gw, &o.gw}, std::pair{&gb, &o.gb},
                            std::pair{&seen, &o.seen}})
      check(cudaMemcpyPeer(dst->data(), dev.index, src->data(), o.dev.index, dim_of(*src) * sizeof(T)));
  }
  static std::size_t dim_of(buf const& x) { return x.size(); }
};

}  // namespace test

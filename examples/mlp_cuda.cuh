#pragma once
// The example's model on a GPU: the 784-512-ReLU-10 perceptron of mlp.hpp with its parameters and
// gradients in the memory of one GPU, forward and backward as cuBLAS GEMMs plus a few small kernels.
// Written as user code: dparallel reaches it through the members parameters() and gradients()
// (CUDA views carrying the device) and make_replica(device), and it launches its work on
// dparallel::cuda::current_stream() (the logical device's stream inside a step function; the
// legacy default stream outside one).
//
// Same parameters as mlp (names, shapes, row-major layout, initialisation): an mlp_cuda is made
// from a host mlp (seeded, or read from a file) and copied back into one (download), so the state
// dicts and checkpoints of --backend host and --backend cuda are interchangeable. The gradient is
// that of the mean loss over the batch, as mlp's, but summed in cuBLAS's order over the whole batch
// (no mlp::blocking): runs on several devices agree with one device within rounding, not to the bit.
//
// Compile with nvcc; link dparallel::cuda and CUDA::cublas.

#include "mlp.hpp"

#include <dparallel/backend/cuda/backend.hpp>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// mlp_cuda's kernels and small helpers.
namespace mlp_kernels {

/// Threads per block of the kernels below.
inline constexpr unsigned threads = 256;
/// Blocks of `threads` covering `n` elements (at least one).
inline unsigned blocks(std::size_t n) {
  return static_cast<unsigned>(n == 0 ? 1 : (n + threads - 1) / threads);
}

/// x[i][j] = x[i][j] + b[j] over `rows` rows of `cols`; with `relu`, then max(., 0).
static __global__ void add_bias(float* x, float const* b, std::size_t rows, std::size_t cols, bool relu) {
  std::size_t const k = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (k >= rows * cols) return;
  float const v = x[k] + b[k % cols];
  x[k] = relu ? fmaxf(v, 0.0f) : v;
}

/// Softmax cross-entropy of `rows` samples of mlp::classes logits: loss[i] is sample i's loss, and
/// z becomes d(mean loss)/d(logits) = (softmax - onehot) * inv_n. One thread per sample.
static __global__ void softmax_cross_entropy(float* z, std::int32_t const* labels, float* loss, std::size_t rows,
                                             float inv_n) {
  std::size_t const i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  constexpr std::size_t classes = mlp::classes;
  float* zi = z + i * classes;
  float mx = zi[0];
  for (std::size_t j = 1; j < classes; ++j) mx = fmaxf(mx, zi[j]);
  float s = 0.0f;
  for (std::size_t j = 0; j < classes; ++j) s += expf(zi[j] - mx);
  auto const y = static_cast<std::size_t>(labels[i]);
  loss[i] = mx + logf(s) - zi[y];
  for (std::size_t j = 0; j < classes; ++j) zi[j] = expf(zi[j] - mx) / s * inv_n;
  zi[y] -= inv_n;
}

/// d[k] = 0 where the unit was inactive (h[k] <= 0): the gradient through the ReLU.
static __global__ void relu_backward(float* d, float const* h, std::size_t n) {
  std::size_t const k = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (k < n && !(h[k] > 0.0f)) d[k] = 0.0f;
}

/// out[j] = sum over i of d[i][j], rows in order: one thread per column, no atomics, so the sum
/// is the same bits every run.
static __global__ void column_sums(float const* d, std::size_t rows, std::size_t cols, float* out) {
  std::size_t const j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  float acc = 0.0f;
  for (std::size_t i = 0; i < rows; ++i) acc += d[i * cols + j];
  out[j] = acc;
}

/// p[i] -= lr * g[i].
static __global__ void sgd(float* p, float const* g, float lr, std::size_t n) {
  std::size_t const i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] -= lr * g[i];
}

/// Destroys a cuBLAS handle with its GPU current.
struct blas_deleter {
  int ordinal = 0;
  void operator()(cublasContext* h) const noexcept {
    int previous = 0;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(ordinal);
    (void)cublasDestroy(h);
    (void)cudaSetDevice(previous);
  }
};

}  // namespace mlp_kernels

class mlp_cuda {
 public:
  static constexpr std::size_t inputs = mlp::inputs;
  static constexpr std::size_t hidden = mlp::hidden;
  static constexpr std::size_t classes = mlp::classes;
  // Parameters (and gradients) in one flat buffer, in mlp's order and layout: w1 (inputs x hidden,
  // row-major), b1, w2 (hidden x classes), b2. Every offset is a multiple of 4 floats.
  static constexpr std::size_t w1_at = 0;
  static constexpr std::size_t b1_at = w1_at + inputs * hidden;
  static constexpr std::size_t w2_at = b1_at + hidden;
  static constexpr std::size_t b2_at = w2_at + hidden * classes;
  static constexpr std::size_t count = b2_at + classes;

  /// `host`'s parameters (seeded, or read from a file) on `d`'s GPU.
  mlp_cuda(mlp const& host, dparallel::device d) : dev_(d) {
    allocate();
    std::vector<float> flat(count);
    auto put = [&](std::vector<float> const& v, std::size_t at) {
      std::copy(v.begin(), v.end(), flat.begin() + static_cast<std::ptrdiff_t>(at));
    };
    put(host.w1, w1_at);
    put(host.b1, b1_at);
    put(host.w2, w2_at);
    put(host.b2, b2_at);
    dparallel::cuda::device_guard g(dev_.index);
    check(cudaMemcpy(params_.data(), flat.data(), count * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  }

  mlp_cuda(mlp_cuda&&) noexcept = default;
  mlp_cuda& operator=(mlp_cuda&&) noexcept = default;
  mlp_cuda(mlp_cuda const&) = delete;
  mlp_cuda& operator=(mlp_cuda const&) = delete;
  ~mlp_cuda() = default;

  /// A replica for DataParallel on `d` (another GPU, or another lane of this one): this model's
  /// parameters in memory of its own on d's GPU, with a cuBLAS handle of its own.
  [[nodiscard]] mlp_cuda make_replica(dparallel::device d) const {
    mlp_cuda r(d);
    dparallel::cuda::device_guard g(dev_.index);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    check(cudaMemcpyPeer(r.params_.data(), d.index, params_.data(), dev_.index, count * sizeof(float)),
          "cudaMemcpyPeer");
    dparallel::cuda::device_guard to(d.index);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // before any stream of `d` reads it
    return r;
  }

  /// w1, b1, w2, b2: views of GPU memory tagged with this model's device.
  auto parameters() { return views(params_); }
  /// Their gradients, same order and sizes.
  auto gradients() { return views(grads_); }

  [[nodiscard]] dparallel::device where() const noexcept { return dev_; }

  /// Forward and backward over the host batch `b` on cuda::current_stream(): copies it to the GPU,
  /// leaves the gradient of the mean loss over `b` in gradients() (overwriting them) and returns
  /// that mean loss. Waits for its stream before it returns (to read the loss).
  float forward_backward(batch const& b) {
    std::size_t const n = check_batch(b);
    dparallel::cuda::device_guard g(dev_.index);
    cudaStream_t const st = dparallel::cuda::current_stream();
    reserve(n);
    // Host memory, or this GPU's (DataParallel's scatter copied the shard here): cudaMemcpyDefault.
    check(cudaMemcpyAsync(x_.data(), b.images.data(), n * inputs * sizeof(float), cudaMemcpyDefault, st),
          "cudaMemcpyAsync");
    check(cudaMemcpyAsync(y_.data(), b.labels.data(), n * sizeof(std::int32_t), cudaMemcpyDefault, st),
          "cudaMemcpyAsync");
    blas(cublasSetStream(blas_.get(), st), "cublasSetStream");

    // Row-major matrices are column-major transposes: a row-major X W (n x out) is computed as the
    // column-major W^T X^T, so every GEMM below names the row-major operands in swapped order.
    auto const ni = static_cast<int>(n);
    float* const p = params_.data();
    float* const gr = grads_.data();
    float* const h = h_.data();
    float* const z = z_.data();
    float* const dh = dh_.data();
    float const* const x = x_.data();
    // hidden = relu(X W1 + b1), logits = hidden W2 + b2.
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, int{hidden}, ni, int{inputs}, p + w1_at, int{hidden}, x, int{inputs}, h,
         int{hidden});
    mlp_kernels::add_bias<<<mlp_kernels::blocks(n * hidden), mlp_kernels::threads, 0, st>>>(h, p + b1_at, n, hidden,
                                                                                            true);
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, int{classes}, ni, int{hidden}, p + w2_at, int{classes}, h, int{hidden}, z,
         int{classes});
    mlp_kernels::add_bias<<<mlp_kernels::blocks(n * classes), mlp_kernels::threads, 0, st>>>(z, p + b2_at, n, classes,
                                                                                             false);
    // Softmax cross-entropy; logits become d(mean loss)/d(logits).
    mlp_kernels::softmax_cross_entropy<<<mlp_kernels::blocks(n), mlp_kernels::threads, 0, st>>>(
        z, y_.data(), loss_.data(), n, 1.0f / static_cast<float>(n));
    // Output layer: gw2 = H^T dZ, gb2 = column sums of dZ, dH = dZ W2^T.
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, int{classes}, int{hidden}, ni, z, int{classes}, h, int{hidden}, gr + w2_at,
         int{classes});
    mlp_kernels::column_sums<<<mlp_kernels::blocks(classes), mlp_kernels::threads, 0, st>>>(z, n, classes, gr + b2_at);
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, int{hidden}, ni, int{classes}, p + w2_at, int{classes}, z, int{classes}, dh,
         int{hidden});
    // Through the ReLU, then the first layer: gw1 = X^T dZ1, gb1 = column sums of dZ1.
    mlp_kernels::relu_backward<<<mlp_kernels::blocks(n * hidden), mlp_kernels::threads, 0, st>>>(dh, h, n * hidden);
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, int{hidden}, int{inputs}, ni, dh, int{hidden}, x, int{inputs}, gr + w1_at,
         int{hidden});
    mlp_kernels::column_sums<<<mlp_kernels::blocks(hidden), mlp_kernels::threads, 0, st>>>(dh, n, hidden, gr + b1_at);
    check(cudaGetLastError(), "a kernel launch");

    std::vector<float> losses(n);
    check(cudaMemcpyAsync(losses.data(), loss_.data(), n * sizeof(float), cudaMemcpyDeviceToHost, st),
          "cudaMemcpyAsync");
    check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    double sum = 0;
    for (float l : losses) sum += static_cast<double>(l);
    return static_cast<float>(sum / static_cast<double>(n));
  }

  /// Plain SGD, p -= lr * g, on the calling thread's current stream; waits for it.
  void sgd(float lr) {
    dparallel::cuda::device_guard g(dev_.index);
    cudaStream_t const st = dparallel::cuda::current_stream();
    mlp_kernels::sgd<<<mlp_kernels::blocks(count), mlp_kernels::threads, 0, st>>>(params_.data(), grads_.data(), lr,
                                                                                  count);
    check(cudaGetLastError(), "a kernel launch");
    check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  }

  /// Copies the parameters into `host` (an mlp of the same shapes), e.g. to evaluate or save them.
  void download(mlp& host) const {
    std::vector<float> flat(count);
    dparallel::cuda::device_guard g(dev_.index);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    check(cudaMemcpy(flat.data(), params_.data(), count * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
    auto get = [&](std::vector<float>& v, std::size_t at) {
      auto const first = flat.begin() + static_cast<std::ptrdiff_t>(at);
      std::copy(first, first + static_cast<std::ptrdiff_t>(v.size()), v.begin());
    };
    get(host.w1, w1_at);
    get(host.b1, b1_at);
    get(host.w2, w2_at);
    get(host.b2, b2_at);
  }

 private:
  // One cuBLAS handle per model (so per logical device and per rank), made on the model's GPU.
  using blas_handle = std::unique_ptr<cublasContext, mlp_kernels::blas_deleter>;

  explicit mlp_cuda(dparallel::device d) : dev_(d) { allocate(); }

  void check(cudaError_t e, char const* what) const { dparallel::cuda::check(e, what, dev_); }
  void blas(cublasStatus_t s, char const* what) const {
    if (s != CUBLAS_STATUS_SUCCESS)
      throw dparallel::device_error(dev_.index,
                                    dparallel::to_string(dev_) + ": " + what + " failed: " + cublasGetStatusString(s));
  }

  // C = A B (column-major, op as given), alpha 1 and beta 0, on the handle's stream.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float const* a, int lda, float const* b,
            int ldb, float* c, int ldc) const {
    float const one = 1.0f, zero = 0.0f;
    blas(cublasSgemm(blas_.get(), ta, tb, m, n, k, &one, a, lda, b, ldb, &zero, c, ldc), "cublasSgemm");
  }

  // Parameters, gradients and the cuBLAS handle on dev_'s GPU; waits until they are usable from any stream.
  void allocate() {
    dparallel::cuda::device_guard g(dev_.index);
    params_ = dparallel::cuda::device_buffer<float>(count, dev_);
    grads_ = dparallel::cuda::device_buffer<float>(count, dev_);
    cublasHandle_t h = nullptr;
    blas(cublasCreate(&h), "cublasCreate");
    blas_ = blas_handle(h, mlp_kernels::blas_deleter{dev_.index});
    check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
  }

  // Scratch for batches of up to n samples. Allocated in the order of the legacy stream (freed in it
  // too, after this model's streams are gone) and waited for, so that any stream may use it.
  void reserve(std::size_t n) {
    if (n <= rows_) return;
    x_ = dparallel::cuda::device_buffer<float>(n * inputs, dev_);
    y_ = dparallel::cuda::device_buffer<std::int32_t>(n, dev_);
    h_ = dparallel::cuda::device_buffer<float>(n * hidden, dev_);
    dh_ = dparallel::cuda::device_buffer<float>(n * hidden, dev_);
    z_ = dparallel::cuda::device_buffer<float>(n * classes, dev_);
    loss_ = dparallel::cuda::device_buffer<float>(n, dev_);
    check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
    rows_ = n;
  }

  // The batch's shape and labels, checked on the host before anything reaches the GPU (a label out
  // of range would index past the logits). Returns the number of samples.
  static std::size_t check_batch(batch const& b) {
    std::size_t const n = b.images.rows();
    if (n == 0 || b.images.row_size() != inputs || b.labels.rows() != n || b.labels.row_size() != 1)
      throw std::invalid_argument("mlp_cuda: expected a batch of n >= 1 images of " + std::to_string(inputs) +
                                  " pixels and n labels, found " + std::to_string(n) + " images of " +
                                  std::to_string(b.images.row_size()) + " values and " +
                                  std::to_string(b.labels.size()) + " labels");
    if (n * inputs > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      throw std::invalid_argument("mlp_cuda: a batch of " + std::to_string(n) + " samples is too large for one GEMM");
    std::vector<std::int32_t> on_host;  // labels in GPU memory (a DataParallel shard) are read back
    std::int32_t const* labels = b.labels.data();
    if (b.labels.device().kind == dparallel::device_kind::cuda) {
      on_host.resize(n);
      cudaStream_t const st = dparallel::cuda::current_stream();  // the shard's copy is ordered on it
      dparallel::cuda::check(cudaMemcpyAsync(on_host.data(), labels, n * sizeof(std::int32_t), cudaMemcpyDefault, st),
                             "cudaMemcpyAsync", b.labels.device());
      dparallel::cuda::check(cudaStreamSynchronize(st), "cudaStreamSynchronize", b.labels.device());
      labels = on_host.data();
    }
    for (std::size_t i = 0; i < n; ++i)
      if (labels[i] < 0 || static_cast<std::size_t>(labels[i]) >= classes)
        throw std::invalid_argument("mlp_cuda: expected labels 0.." + std::to_string(classes - 1) + ", found " +
                                    std::to_string(labels[i]) + " for sample " + std::to_string(i));
    return n;
  }

  std::array<dparallel::tensor_view<float>, 4> views(dparallel::cuda::device_buffer<float> const& flat) const {
    float* const p = flat.data();
    return {dparallel::tensor_view<float>(p + w1_at, inputs * hidden, dev_),
            dparallel::tensor_view<float>(p + b1_at, hidden, dev_),
            dparallel::tensor_view<float>(p + w2_at, hidden * classes, dev_),
            dparallel::tensor_view<float>(p + b2_at, classes, dev_)};
  }

  dparallel::device dev_;
  dparallel::cuda::device_buffer<float> params_, grads_;
  blas_handle blas_;
  std::size_t rows_ = 0;  // samples the scratch below holds
  dparallel::cuda::device_buffer<float> x_, h_, dh_, z_, loss_;
  dparallel::cuda::device_buffer<std::int32_t> y_;
};
static_assert(dparallel::replicable_model<mlp_cuda>);

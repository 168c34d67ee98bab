#pragma once
// The example's model: the 784-512-ReLU-10 multilayer perceptron with a softmax cross-entropy
// loss, written as ordinary user code: std::vector storage, OpenBLAS GEMMs, no base class and
// nothing from dparallel inside it. dparallel reaches its parameters through the
// model_traits<mlp> specialisation at the end of this file, and copies it with its copy
// constructor to make a replica per device.

#include <dparallel/dparallel.hpp>

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

// OpenBLAS's own threads would compete with dparallel's devices: one device is one core, so the
// program calls openblas_set_num_threads(1) first. Declared here as well, since not every
// cblas.h declares it.
extern "C" void openblas_set_num_threads(int);

/// One batch of samples: `images` holds rows = samples of 784 pixels, `labels` one class per
/// sample. A plain struct of views: dparallel slices it into shards of the same type.
struct batch {
  dparallel::tensor_view<float const> images;
  dparallel::tensor_view<std::int32_t const> labels;
};

/// SplitMix64: a small, fast, well-mixed 64-bit generator; the same numbers on every platform.
class splitmix64 {
 public:
  explicit splitmix64(std::uint64_t seed) noexcept : state_(seed) {}
  std::uint64_t operator()() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1) with 24 random bits (every value exact in float).
  float uniform() noexcept { return static_cast<float>((*this)() >> 40) * 0x1.0p-24f; }
  /// Uniform in [0, n): the multiply-shift reduction, bias below n / 2^32.
  std::uint64_t below(std::uint64_t n) noexcept { return ((*this)() >> 32) * n >> 32; }

 private:
  std::uint64_t state_;
};

/// Where a model keeps its gradients: memory of its own, or memory it was given to keep them in
/// (place()): DDP's (mlp::bind_gradients), or a process group's (process_group::allocate), which
/// DDP over processes on one node all-reduces in place. A copy (a replica) always gets memory of
/// its own: it must not write the gradients of the model it copies.
class gradient_buffer {
 public:
  explicit gradient_buffer(std::size_t n) : size_(n), own_(n) {}
  gradient_buffer(gradient_buffer const& o) : size_(o.size_), own_(o.data(), o.data() + o.size_) {}
  gradient_buffer& operator=(gradient_buffer const& o) {
    if (this != &o) {
      if (o.size_ != size_) throw std::invalid_argument("gradient_buffer: assigning gradients of another size");
      std::copy_n(o.data(), size_, data());
    }
    return *this;
  }
  gradient_buffer(gradient_buffer&&) noexcept = default;
  gradient_buffer& operator=(gradient_buffer&&) noexcept = default;
  ~gradient_buffer() = default;

  [[nodiscard]] float* data() noexcept { return placed_ ? reinterpret_cast<float*>(placed_.get()) : own_.data(); }
  [[nodiscard]] float const* data() const noexcept {
    return placed_ ? reinterpret_cast<float const*>(placed_.get()) : own_.data();
  }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Moves the gradients into `memory` (room for size() floats, suitably aligned), kept alive here.
  void place(std::shared_ptr<std::byte> memory) {
    if (!memory) throw std::invalid_argument("gradient_buffer::place: expected memory, found a null pointer");
    std::copy_n(data(), size_, reinterpret_cast<float*>(memory.get()));
    adopt(std::move(memory));
  }
  /// Keeps the gradients in `memory`, which already holds them (DDP's block: mlp::bind_gradients).
  void adopt(std::shared_ptr<std::byte> memory) {
    if (!memory) throw std::invalid_argument("gradient_buffer::adopt: expected memory, found a null pointer");
    placed_ = std::move(memory);
    own_ = {};
  }

 private:
  std::size_t size_;
  std::vector<float> own_;
  std::shared_ptr<std::byte> placed_;
};

struct mlp {
  static constexpr std::size_t inputs = 784;
  static constexpr std::size_t hidden = 512;
  static constexpr std::size_t classes = 10;

  // Row-major: w1 is inputs x hidden, w2 is hidden x classes; a layer computes x W + b.
  std::vector<float> w1, b1, w2, b2;
  // The gradients of the mean loss of the last forward_backward, in one buffer: gw1, gb1, gw2, gb2
  // back to back (what DDP's options::gradient_as_bucket_view all-reduces in place).
  gradient_buffer grads;
  /// DDP with options::gradient_as_bucket_view lays the gradients out itself, in memory from the
  /// process group (group memory on one node: all-reduced in place in every process): they come
  /// back to back in parameter order, as `grads` holds them, so the block replaces the buffer.
  void bind_gradients(dparallel::gradient_memory const& given) {
    if (given.places.size() != 4 || given.places[0].data() != given.owner.get())
      throw std::invalid_argument("mlp::bind_gradients: expected 4 places from the block's start");
    grads.adopt(given.owner);  // DDP copied the values there
  }
  /// Gradient k (0: w1, 1: b1, 2: w2, 3: b2) as a view of `grads`.
  [[nodiscard]] dparallel::tensor_view<float> gradient(std::size_t k) {
    return {grads.data() + grad_offset(k), grad_size(k)};
  }
  static constexpr std::size_t grad_size(std::size_t k) {
    return k == 0 ? inputs * hidden : k == 1 ? hidden : k == 2 ? hidden * classes : classes;
  }
  static constexpr std::size_t grad_offset(std::size_t k) { return k == 0 ? 0 : grad_offset(k - 1) + grad_size(k - 1); }
  static constexpr std::size_t grad_total = inputs * hidden + hidden + hidden * classes + classes;

  /// Deterministic initialisation from `seed`: He-uniform for the ReLU layer, Glorot-uniform for
  /// the output layer, zero biases.
  explicit mlp(std::uint64_t seed)
      : w1(inputs * hidden),
        b1(hidden, 0.0f),
        w2(hidden * classes),
        b2(classes, 0.0f),
        grads(grad_total) {
    splitmix64 rng(seed);
    auto fill = [&](std::vector<float>& w, float limit) {
      for (float& x : w) x = (2.0f * rng.uniform() - 1.0f) * limit;
    };
    fill(w1, std::sqrt(6.0f / static_cast<float>(inputs)));
    fill(w2, std::sqrt(6.0f / static_cast<float>(hidden + classes)));
  }

  /// How forward_backward cuts a batch into forward/backward passes, and sums their gradients. A
  /// runtime property, inherited by copies (dparallel's replicas copy the model they replicate).
  struct blocking {
    /// Parts the batch is cut into, as dparallel's DataParallel cuts a batch over devices
    /// (torch.chunk: ceil(n / parts) samples each, the last one the rest). 1 on a device or rank
    /// that computes its own shard; R on one device that reproduces R devices or ranks.
    std::size_t parts = 1;
    /// At most this many samples per pass within a part; 0: each part in one pass (the largest
    /// GEMMs, the fastest).
    std::size_t block = 0;
    /// How the parts' gradients are summed: false: pairwise ((p0 + p1) + (p2 + p3)), DataParallel's
    /// reduction (host::weighted_sum); true: in order ((p0 + p1) + p2) + p3, the host communicator's
    /// all-reduce (DDP over thread ranks). The same for up to 3 parts.
    bool parts_in_order = false;
  };
  /// This model's blocking (see forward_backward).
  blocking split;

  /// Forward and backward over `b`: leaves the gradient of the mean loss over `b` in `grads`
  /// (overwriting it) and returns that mean loss.
  ///
  /// The batch is cut into `split.parts` parts, each part into passes of at most `split.block`
  /// samples. The passes of a part are summed pairwise, ((g0 + g1) + (g2 + g3)) + ..., the tree
  /// dparallel's DataParallel reduction uses across devices; the parts pairwise as well, or in order
  /// (split.parts_in_order). So a device whose shard is one part computes what the same part
  /// computes here, and the reduction across devices (ranks) adds the parts as this model adds them:
  /// when the reduction's weights are powers of two (2 or 4 equal shards), single, dp and ddp train
  /// the same model bit for bit, the last, partial batch of an epoch included when every device's
  /// (rank's) shard of it is a part here. Each pass's samples are weighted by 1 / n exactly as the
  /// device's 1 / (n / parts) times the reduction's 1 / parts (powers of two scale exactly).
  float forward_backward(batch const& b) {
    std::size_t const n = check(b);
    float const inv_n = 1.0f / static_cast<float>(n);
    std::size_t const per_part = (n + split.parts - 1) / split.parts;
    std::size_t const per_pass = pass_rows(n);
    double loss = 0;
    tree parts{0};
    for (std::size_t first = 0; first < n; first += per_part) {
      std::size_t const end = std::min(n, first + per_part);
      tree passes{parts.top()};  // this part's passes, above the partial sums of the parts before it
      for (std::size_t at = first; at < end; at += per_pass) {
        loss += block_gradient(b, at, std::min(per_pass, end - at), inv_n, level(passes.top()));
        push(passes, false);
      }
      fold(passes);  // the part's gradient, at level parts.top()
      push(parts, split.parts_in_order);
    }
    fold(parts);
    return static_cast<float>(loss / static_cast<double>(n));
  }

  /// Number of samples of `b` whose largest logit is at their label (ties: the lowest class).
  std::size_t count_correct(batch const& b) {
    std::size_t const n = check(b);
    std::size_t correct = 0;
    std::size_t const rows = pass_rows(n);
    for (std::size_t first = 0; first < n; first += rows) {
      std::size_t const m = std::min(rows, n - first);
      forward(b.images.data() + first * inputs, m);
      for (std::size_t i = 0; i < m; ++i) {
        float const* z = logits_.data() + i * classes;
        auto const predicted = static_cast<std::size_t>(std::max_element(z, z + classes) - z);
        correct += predicted == static_cast<std::size_t>(b.labels[first + i]) ? 1 : 0;
      }
    }
    return correct;
  }

 private:
  // One set of gradient tensors: the model's own (level 0) or a scratch partial sum.
  struct grad_set {
    float *w1, *b1, *w2, *b2;
  };
  grad_set level(std::size_t k) {
    while (k > 0 && scratch_.size() < k) scratch_.emplace_back(grad_total);
    float* p = k == 0 ? grads.data() : scratch_[k - 1].data();  // both laid out as grads
    return {p + grad_offset(0), p + grad_offset(1), p + grad_offset(2), p + grad_offset(3)};
  }
  // A sum of terms over scratch levels from `base` up, in host::weighted_sum's pairwise tree or in
  // order: a term is written at level top(), then push() merges it; fold() leaves the sum at `base`.
  struct tree {
    std::size_t base;
    std::size_t depth = 0;
    std::size_t terms[64] = {};  // terms summed in each partial sum
    [[nodiscard]] std::size_t top() const { return base + depth; }
  };
  void push(tree& t, bool in_order) {
    t.terms[t.depth++] = 1;
    while (t.depth >= 2 && (in_order || t.terms[t.depth - 1] == t.terms[t.depth - 2])) {
      add(level(t.base + t.depth - 2), level(t.base + t.depth - 1));
      t.terms[t.depth - 2] += t.terms[t.depth - 1];
      --t.depth;
    }
  }
  // Uneven counts: the remaining partial sums, right to left (as host::weighted_sum folds them).
  void fold(tree& t) {
    for (; t.depth >= 2; --t.depth) add(level(t.base + t.depth - 2), level(t.base + t.depth - 1));
  }
  void add(grad_set into, grad_set from) const {
    auto sum = [](float* d, float const* s, std::size_t count) {
      for (std::size_t i = 0; i < count; ++i) d[i] += s[i];
    };
    sum(into.w1, from.w1, grad_size(0));
    sum(into.b1, from.b1, grad_size(1));
    sum(into.w2, from.w2, grad_size(2));
    sum(into.b2, from.b2, grad_size(3));
  }

  // Forward and backward over samples [first, first + m) of `b`; writes their contribution to the
  // gradient of the batch's mean loss (each sample weighted by inv_n) into `out`; returns the
  // block's summed loss.
  double block_gradient(batch const& b, std::size_t first, std::size_t m, float inv_n, grad_set out) {
    float const* x = b.images.data() + first * inputs;
    forward(x, m);
    // Softmax cross-entropy; logits_ becomes d(mean loss)/d(logits) = (softmax - onehot) / n.
    double loss = 0;
    for (std::size_t i = 0; i < m; ++i) {
      float* z = logits_.data() + i * classes;
      float const mx = *std::max_element(z, z + classes);
      float s = 0;
      for (std::size_t j = 0; j < classes; ++j) s += std::exp(z[j] - mx);
      auto const y = static_cast<std::size_t>(b.labels[first + i]);
      loss += static_cast<double>(mx + std::log(s) - z[y]);
      for (std::size_t j = 0; j < classes; ++j) z[j] = std::exp(z[j] - mx) / s * inv_n;
      z[y] -= inv_n;
    }
    // Output layer: gw2 = H^T dZ2, gb2 = column sums of dZ2, dH = dZ2 W2^T.
    auto const mi = static_cast<int>(m);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int{hidden}, int{classes}, mi, 1.0f, hidden_.data(),
                int{hidden}, logits_.data(), int{classes}, 0.0f, out.w2, int{classes});
    column_sums(logits_.data(), m, classes, out.b2);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mi, int{hidden}, int{classes}, 1.0f, logits_.data(),
                int{classes}, w2.data(), int{classes}, 0.0f, delta_.data(), int{hidden});
    // Through the ReLU: dZ1 = dH where the unit was active.
    for (std::size_t k = 0; k < m * hidden; ++k)
      if (!(hidden_[k] > 0.0f)) delta_[k] = 0.0f;
    // First layer: gw1 = X^T dZ1, gb1 = column sums of dZ1.
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int{inputs}, int{hidden}, mi, 1.0f, x, int{inputs},
                delta_.data(), int{hidden}, 0.0f, out.w1, int{hidden});
    column_sums(delta_.data(), m, hidden, out.b1);
    return loss;
  }

  // Checks the batch's shape; sizes the scratch buffers. Returns the number of samples.
  std::size_t check(batch const& b) {
    std::size_t const n = b.images.rows();
    if (n == 0 || b.images.row_size() != inputs || b.labels.rows() != n || b.labels.row_size() != 1) {
      throw std::invalid_argument("mlp: expected a batch of n >= 1 images of " + std::to_string(inputs) +
                                  " pixels and n labels, found " + std::to_string(n) + " images of " +
                                  std::to_string(b.images.row_size()) + " values and " +
                                  std::to_string(b.labels.size()) + " labels; view the images with rows = samples");
    }
    if (n * inputs > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      throw std::invalid_argument("mlp: a batch of " + std::to_string(n) + " samples is too large for one GEMM");
    for (std::size_t i = 0; i < n; ++i) {
      if (b.labels[i] < 0 || static_cast<std::size_t>(b.labels[i]) >= classes) {
        throw std::invalid_argument("mlp: expected labels 0.." + std::to_string(classes - 1) + ", found " +
                                    std::to_string(b.labels[i]) + " for sample " + std::to_string(i));
      }
    }
    if (split.parts == 0)
      throw std::invalid_argument("mlp: expected split.parts >= 1 (1: the batch is one part), found 0");
    std::size_t const rows = pass_rows(n);  // forward_backward works pass by pass
    if (hidden_.size() < rows * hidden) {
      hidden_.resize(rows * hidden);
      delta_.resize(rows * hidden);
      logits_.resize(rows * classes);
    }
    return n;
  }

  // The most samples forward_backward passes at once over a batch of n.
  [[nodiscard]] std::size_t pass_rows(std::size_t n) const {
    std::size_t const per_part = (n + split.parts - 1) / split.parts;
    return split.block == 0 ? per_part : std::min(split.block, per_part);
  }

  // hidden_ = relu(X W1 + b1), logits_ = hidden_ W2 + b2, for the first n rows of X.
  void forward(float const* x, std::size_t n) {
    auto const ni = static_cast<int>(n);
    for (std::size_t i = 0; i < n; ++i) std::copy(b1.begin(), b1.end(), hidden_.begin() + i * hidden);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, int{hidden}, int{inputs}, 1.0f, x, int{inputs},
                w1.data(), int{hidden}, 1.0f, hidden_.data(), int{hidden});
    for (std::size_t k = 0; k < n * hidden; ++k) hidden_[k] = std::max(hidden_[k], 0.0f);
    for (std::size_t i = 0; i < n; ++i) std::copy(b2.begin(), b2.end(), logits_.begin() + i * classes);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, int{classes}, int{hidden}, 1.0f, hidden_.data(),
                int{hidden}, w2.data(), int{classes}, 1.0f, logits_.data(), int{classes});
  }

  // out[j] = sum_i d[i * cols + j], accumulated in row order.
  static void column_sums(float const* d, std::size_t rows, std::size_t cols, float* out) {
    std::fill(out, out + cols, 0.0f);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) out[j] += d[i * cols + j];
  }

  // Scratch, sized for the largest pass seen; each replica has its own.
  std::vector<float> hidden_, delta_, logits_;
  std::vector<std::vector<float>> scratch_;  // partial gradient sums of the trees (levels 1..)
};

/// The adaptation to dparallel, outside the model: its parameters and their gradients, in the
/// same stable order. Replicas come from mlp's copy constructor.
///
/// The names and shapes are what a state dict or checkpoint file records (dparallel/io): "w1"
/// [784, 512], "b1" [512], "w2" [512, 10], "b2" [10], each as the model stores it. The weights are
/// inputs x outputs (a layer computes x W + b), the transpose of torch.nn.Linear's weight. With the
/// shapes, loading a file whose tensors have the right sizes but other shapes is an error.
template <>
struct dparallel::model_traits<mlp> {
  static auto parameters(mlp& m) {
    return std::array{dparallel::view(m.w1), dparallel::view(m.b1), dparallel::view(m.w2), dparallel::view(m.b2)};
  }
  static auto gradients(mlp& m) {
    return std::array{m.gradient(0), m.gradient(1), m.gradient(2), m.gradient(3)};
  }
  static auto parameter_names(mlp&) { return std::array{"w1", "b1", "w2", "b2"}; }
  static auto parameter_shapes(mlp&) {
    return std::array{std::vector<std::size_t>{mlp::inputs, mlp::hidden}, std::vector<std::size_t>{mlp::hidden},
                      std::vector<std::size_t>{mlp::hidden, mlp::classes}, std::vector<std::size_t>{mlp::classes}};
  }
};
static_assert(dparallel::replicable_model<mlp>);
static_assert(dparallel::batch<batch>);

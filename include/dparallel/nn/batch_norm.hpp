#pragma once
// Batch normalisation over the channels of [rows x channels] data (torch.nn.BatchNorm1d on an
// (N, C) input), and its synchronised form (torch.nn.SyncBatchNorm): the batch statistics of the
// global batch, every rank of a process group together.
//
//   dparallel::nn::batch_norm bn(512);                     // weight 1, bias 0, running mean 0, var 1
//   bn.forward(x, y, &ctx_group);                          // training: global-batch statistics
//   ...                                                    // the rest of forward and backward
//   bn.backward(dy, dx);                                   // dx, and the weight and bias gradients
//
// A layer the user's model owns and calls from its step function; the model lists bn.weight() and
// bn.bias() among its parameters, bn.weight_grad() and bn.bias_grad() among its gradients, and
// bn.running_mean() and bn.running_var() among its buffers.
//
// Forward (training). Per channel, over the batch (with a group: over every rank's rows, each row
// counted once, so uneven shards are right): mean and biased variance, y = (x - mean) / sqrt(var +
// eps) * weight + bias; running_mean <- (1 - momentum) running_mean + momentum mean and
// running_var <- (1 - momentum) running_var + momentum var * N / (N - 1) (the unbiased variance, N
// the global count), as PyTorch. With a group, one all_reduce of 2C + 1 f64 numbers (the per-channel
// sums and sums of squares, and the count); sums are accumulated in f64.
//
// Backward. With a group, one all_reduce of 2C f64 numbers: the per-channel sums of dy and of dy x
// x_hat, each rank's weighted by its share in the wrapper's gradient average (batch_norm_options::
// weight: 1/ranks for average_mode::ranks, PyTorch's SyncBatchNorm; rows/N for average_mode::
// samples), so that after DDP averages the gradients they are those of one device on the global
// batch. dx is this rank's share: the one-device input gradient divided by that weight (as the
// rank's loss is its part of the global loss divided by it). The weight and bias gradients are
// this rank's own sums (DDP's reduction combines them).
//
// Every rank of the group must call forward and backward together, in the same order relative to
// its other collectives (DDP's buckets are issued in the same order on every rank, so a layer
// called at the same place of every rank's step keeps the ranks' sequences alike).
#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace nn {

/// How a rank's backward sums count across the ranks: as the wrapper averages gradients.
enum class sync_weight {
  /// Every rank weighs 1 / ranks (DDP's default average_mode::ranks; PyTorch's SyncBatchNorm).
  ranks,
  /// Each rank weighs its rows / the global rows (average_mode::samples).
  samples,
};

/// batch_norm's settings: PyTorch's defaults.
struct batch_norm_options {
  /// Added to the variance before the square root.
  double eps = 1e-5;
  /// The running statistics' update factor.
  double momentum = 0.1;
  /// How a rank's backward sums count (with a group): match the wrapper's options::average.
  sync_weight weight = sync_weight::ranks;
};

/// Batch normalisation over `channels` channels, optionally synchronised over a process group
/// (see the top of nn/batch_norm.hpp). Host memory, f32.
class batch_norm {
 public:
  /// Weight 1, bias 0, running mean 0 and running variance 1 per channel, as PyTorch. Throws
  /// invalid_argument for no channel, eps <= 0 or momentum outside [0, 1].
  explicit batch_norm(std::size_t channels, batch_norm_options o = {})
      : opts_(o), c_(channels), weight_(channels, 1.0f), bias_(channels, 0.0f), dweight_(channels, 0.0f),
        dbias_(channels, 0.0f), running_mean_(channels, 0.0f), running_var_(channels, 1.0f) {
    detail::require(channels > 0, "nn::batch_norm: expected at least one channel, found 0");
    detail::require(o.eps > 0 && std::isfinite(o.eps), "nn::batch_norm: expected eps > 0");
    detail::require(o.momentum >= 0 && o.momentum <= 1, "nn::batch_norm: expected momentum in [0, 1]");
  }

  /// The scale (gamma), a parameter.
  [[nodiscard]] tensor_view<float> weight() noexcept { return view(weight_); }
  /// The shift (beta), a parameter.
  [[nodiscard]] tensor_view<float> bias() noexcept { return view(bias_); }
  /// The gradient of weight() (written by backward).
  [[nodiscard]] tensor_view<float> weight_grad() noexcept { return view(dweight_); }
  /// The gradient of bias() (written by backward).
  [[nodiscard]] tensor_view<float> bias_grad() noexcept { return view(dbias_); }
  /// The running mean, a buffer.
  [[nodiscard]] tensor_view<float> running_mean() noexcept { return view(running_mean_); }
  /// The running (unbiased) variance, a buffer.
  [[nodiscard]] tensor_view<float> running_var() noexcept { return view(running_var_); }
  /// Channels.
  [[nodiscard]] std::size_t channels() const noexcept { return c_; }

  /// Training forward: y = the batch-normalised x (both rows x channels, row-major). With `group`,
  /// the statistics are the global batch's over its ranks (a collective: every rank calls it).
  /// Updates the running statistics and keeps what backward needs (x_hat, 1/std).
  void forward(tensor_view<float const> x, tensor_view<float> y, process_group const* group = nullptr) {
    std::size_t const n = check_rows(x, y, "forward");
    std::vector<double> sums(2 * c_ + 1, 0.0);  // sum, sum of squares per channel, then the count
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t k = 0; k < c_; ++k) {
        double const v = x[i * c_ + k];
        sums[k] += v;
        sums[c_ + k] += v * v;
      }
    sums[2 * c_] = static_cast<double>(n);
    if (group != nullptr) group->all_reduce(view(sums)).wait();
    double const total = sums[2 * c_];
    detail::require(total > 1, "nn::batch_norm::forward: expected more than one value per channel in training, found " +
                                   std::to_string(static_cast<long long>(total)));
    group_ = group;
    rows_ = n;
    total_ = total;
    mean_.assign(c_, 0.0);
    invstd_.assign(c_, 0.0);
    for (std::size_t k = 0; k < c_; ++k) {
      double const mean = sums[k] / total;
      double const var = std::max(sums[c_ + k] / total - mean * mean, 0.0);
      mean_[k] = mean;
      invstd_[k] = 1.0 / std::sqrt(var + opts_.eps);
      double const m = opts_.momentum;
      running_mean_[k] = static_cast<float>((1 - m) * running_mean_[k] + m * mean);
      running_var_[k] = static_cast<float>((1 - m) * running_var_[k] + m * var * total / (total - 1));
    }
    xhat_.resize(n * c_);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t k = 0; k < c_; ++k) {
        double const h = (x[i * c_ + k] - mean_[k]) * invstd_[k];
        xhat_[i * c_ + k] = h;
        y[i * c_ + k] = static_cast<float>(h * weight_[k] + bias_[k]);
      }
  }

  /// Evaluation forward: normalises with the running statistics (no collective).
  void forward_eval(tensor_view<float const> x, tensor_view<float> y) const {
    std::size_t const n = check_rows(x, y, "forward_eval");
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t k = 0; k < c_; ++k) {
        double const inv = 1.0 / std::sqrt(static_cast<double>(running_var_[k]) + opts_.eps);
        y[i * c_ + k] = static_cast<float>((x[i * c_ + k] - running_mean_[k]) * inv * weight_[k] + bias_[k]);
      }
  }

  /// Backward of the last training forward: dx (skipped when empty) and the weight and bias
  /// gradients (assigned). With the forward's group, a collective: every rank calls it.
  void backward(tensor_view<float const> dy, tensor_view<float> dx) {
    detail::require(total_ > 0, "nn::batch_norm::backward: expected a training forward() first");
    detail::require(dy.size() == rows_ * c_, "nn::batch_norm::backward: expected dy of " + std::to_string(rows_ * c_) +
                                                 " elements (the forward's rows x channels), found " +
                                                 std::to_string(dy.size()));
    detail::require(dx.size() == 0 || dx.size() == rows_ * c_,
                    "nn::batch_norm::backward: expected dx empty or of " + std::to_string(rows_ * c_) + " elements");
    std::vector<double> sums(2 * c_, 0.0);  // sum of dy, sum of dy x_hat per channel: this rank's
    for (std::size_t i = 0; i < rows_; ++i)
      for (std::size_t k = 0; k < c_; ++k) {
        sums[k] += dy[i * c_ + k];
        sums[c_ + k] += dy[i * c_ + k] * xhat_[i * c_ + k];
      }
    for (std::size_t k = 0; k < c_; ++k) {
      dbias_[k] = static_cast<float>(sums[k]);
      dweight_[k] = static_cast<float>(sums[c_ + k]);
    }
    double w = 1;  // this rank's share in the gradient average
    if (group_ != nullptr) {
      w = opts_.weight == sync_weight::ranks ? 1.0 / group_->size() : static_cast<double>(rows_) / total_;
      for (double& s : sums) s *= w;
      group_->all_reduce(view(sums)).wait();
    }
    if (dx.size() == 0) return;
    double const scale = 1.0 / (w * total_);  // the global means, in this rank's units
    for (std::size_t i = 0; i < rows_; ++i)
      for (std::size_t k = 0; k < c_; ++k) {
        double const g = dy[i * c_ + k] - sums[k] * scale - xhat_[i * c_ + k] * sums[c_ + k] * scale;
        dx[i * c_ + k] = static_cast<float>(g * invstd_[k] * weight_[k]);
      }
  }

 private:
  template <class X, class Y>
  std::size_t check_rows(X const& x, Y const& y, char const* who) const {
    detail::require(x.size() % c_ == 0, std::string("nn::batch_norm::") + who + ": expected rows x " +
                                            std::to_string(c_) + " values, found " + std::to_string(x.size()));
    detail::require(y.size() == x.size(), std::string("nn::batch_norm::") + who + ": expected y of " +
                                              std::to_string(x.size()) + " elements, found " + std::to_string(y.size()));
    return x.size() / c_;
  }

  batch_norm_options opts_;
  std::size_t c_;
  std::vector<float> weight_, bias_, dweight_, dbias_, running_mean_, running_var_;
  // The last training forward's: its group, rows here and in all, per-channel mean and 1/std, x_hat.
  process_group const* group_ = nullptr;
  std::size_t rows_ = 0;
  double total_ = 0;
  std::vector<double> mean_, invstd_, xhat_;
};

}  // namespace nn

DPARALLEL_NAMESPACE_END

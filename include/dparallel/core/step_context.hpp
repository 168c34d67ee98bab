#pragma once
// step_context: what the user's step function learns about the shard it runs, and the
// grad_ready() hook through which a model lets communication start during backward.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>

#include <cstddef>

DPARALLEL_NAMESPACE_BEGIN

/// What the step function learns about its shard, and the grad_ready() hook that lets DDP reduce buckets
/// while backward goes on.
class step_context {
 public:
  step_context() = default;

  /// The device this shard runs on.
  [[nodiscard]] dparallel::device device() const noexcept { return device_; }
  /// Index of this replica among the wrapper's local devices (0 = the master's device).
  [[nodiscard]] int replica() const noexcept { return replica_; }
  /// Rank of this process group member (0 for DataParallel).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of ranks in the process group (1 for DataParallel).
  [[nodiscard]] int world_size() const noexcept { return world_size_; }
  /// First sample of this shard within the batch given to step().
  [[nodiscard]] std::size_t shard_offset() const noexcept { return offset_; }
  /// Number of samples in this shard.
  [[nodiscard]] std::size_t shard_size() const noexcept { return size_; }
  /// Number of samples in the batch given to step() (the global batch for DataParallel).
  [[nodiscard]] std::size_t batch_size() const noexcept { return batch_; }
  /// This shard's share of the batch: shard_size() / batch_size(). Gradients of the shard's mean
  /// loss are weighted by it when they are reduced.
  [[nodiscard]] double shard_weight() const noexcept {
    return batch_ == 0 ? 0.0 : static_cast<double>(size_) / static_cast<double>(batch_);
  }

  /// Tells dparallel that gradient `param_index` (in parameters() order) is final for this step.
  /// Under DDP this lets its bucket's all-reduce start while backward goes on; calling it is
  /// optional, and a no-op where the reduce policy does not overlap.
  void grad_ready(std::size_t param_index) {
    if (ready_fn_ != nullptr) ready_fn_(ready_obj_, replica_, param_index);
  }

  /// Used by the wrappers to describe a shard; not meant for user code.
  struct shard_info {
    /// The shard's device.
    dparallel::device device;
    /// Index of the replica among the wrapper's devices.
    int replica = 0;
    /// Rank in the process group (0 for DataParallel).
    int rank = 0;
    /// Number of ranks (1 for DataParallel).
    int world_size = 1;
    /// First sample of the shard within the batch.
    std::size_t offset = 0;
    /// Number of samples in the shard.
    std::size_t size = 0;
    /// Number of samples in the batch given to step().
    std::size_t batch = 0;
  };
  /// Called by grad_ready() with the wrapper object, the replica and the parameter index.
  using ready_hook = void (*)(void* obj, int replica, std::size_t param_index);
  /// A context describing shard `s`, whose grad_ready() calls `hook(obj, replica, index)`; made by the
  /// wrappers.
  step_context(shard_info const& s, ready_hook hook, void* obj) noexcept
      : device_(s.device),
        replica_(s.replica),
        rank_(s.rank),
        world_size_(s.world_size),
        offset_(s.offset),
        size_(s.size),
        batch_(s.batch),
        ready_fn_(hook),
        ready_obj_(obj) {}

 private:
  dparallel::device device_{};
  int replica_ = 0;
  int rank_ = 0;
  int world_size_ = 1;
  std::size_t offset_ = 0;
  std::size_t size_ = 0;
  std::size_t batch_ = 0;
  ready_hook ready_fn_ = nullptr;
  void* ready_obj_ = nullptr;
};

DPARALLEL_NAMESPACE_END

#pragma once
// distributed_sampler: which samples of a dataset each rank reads in an epoch, with the
// partitioning rules of PyTorch's torch.utils.data.DistributedSampler.
//
// For a dataset of `len` samples and `n` replicas:
//   num_samples = drop_last ? floor(len / n) : ceil(len / n)      (per rank; size())
//   total_size  = num_samples * n
// The epoch's order is a permutation of 0..len-1 (shuffle) or 0..len-1 itself (no shuffle).
// Without drop_last the order is padded to total_size by repeating it from its start, as often
// as needed (len = 2, n = 5: 0 1 | 0 1 0); with drop_last its tail beyond total_size is dropped.
// Rank r takes every n-th entry starting at r: padded[r], padded[r + n], ...
// (Python: indices[rank:total_size:num_replicas]).
//
// The shuffled order is PyTorch's by default (shuffle_order::torch): the permutation that
// torch.randperm(len, generator=g) returns after g.manual_seed(seed + epoch), so a C++ job reads
// the samples of a PyTorch job with the same seed, rank by rank and epoch by epoch. PyTorch's CPU
// generator is MT19937 seeded with the low 32 bits of the seed (std::mt19937 gives the same
// stream), and randperm swaps entry i with entry i + (draw mod (len - i)) for i = 0..len-2. From
// len = 214748364 on (2^32 / 20), PyTorch's source today draws 64 bits per entry instead (an
// inside-out shuffle); this sampler follows it there, where PyTorch 1.13 still used the first rule.
// shuffle_order::splitmix64 keeps dparallel's earlier order (an unbiased Fisher-Yates from
// splitmix64; detail::splitmix_permutation). seed + epoch is computed modulo 2^64.

#include <dparallel/config.hpp>
#include <dparallel/core/epoch_note.hpp>
#include <dparallel/core/error.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Which permutation a shuffled epoch follows.
enum class shuffle_order {
  torch,       ///< torch.randperm's after manual_seed(seed + epoch): DistributedSampler's own order
  splitmix64,  ///< dparallel's earlier order: Fisher-Yates from splitmix64(seed + epoch), without bias
};

/// The order's name, as a checkpoint stores it ("torch", "splitmix64").
constexpr std::string_view name_of(shuffle_order o) noexcept {
  return o == shuffle_order::splitmix64 ? "splitmix64" : "torch";
}

/// Options of distributed_sampler; the defaults are DistributedSampler's.
struct sampler_options {
  bool shuffle = true;                         ///< draw a new order every epoch (from seed + epoch)
  std::uint64_t seed = 0;                      ///< must be the same on every rank
  bool drop_last = false;                      ///< drop the tail instead of padding, so no sample is read twice
  shuffle_order order = shuffle_order::torch;  ///< the permutation a shuffled epoch follows
};

/// Anything that knows its rank and the number of ranks, e.g. a rank_context of a process group.
/// Both member functions must be callable on a const object.
template <class R>
concept rank_source = requires(R const& r) {
  { r.rank() } -> std::convertible_to<int>;
  { r.world_size() } -> std::convertible_to<int>;
};

namespace detail {

/// SplitMix64 (Steele, Lea, Flood 2014): 64-bit state, state += 0x9e3779b97f4a7c15 per draw,
/// then the finaliser below. Fully specified, so its stream is the same everywhere.
class splitmix64 {
 public:
  explicit constexpr splitmix64(std::uint64_t seed) noexcept : state_(seed) {}

  constexpr std::uint64_t operator()() noexcept {
    state_ += 0x9e3779b97f4a7c15ULL;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

 private:
  std::uint64_t state_;
};

/// A uniform integer in [0, bound), bound >= 1, without bias: 64-bit draws below
/// 2^64 mod bound are rejected, the accepted draw is reduced modulo bound.
constexpr std::uint64_t uniform_below(splitmix64& gen, std::uint64_t bound) noexcept {
  std::uint64_t const reject_below = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    std::uint64_t const x = gen();
    if (x >= reject_below) return x % bound;
  }
}

/// shuffle_order::splitmix64's order for seed + epoch = `seed`: p = 0..len-1; for i = len-1 down
/// to 1: swap(p[i], p[uniform_below(i+1)]), drawing from splitmix64(seed).
inline std::vector<std::size_t> splitmix_permutation(std::size_t len, std::uint64_t seed) {
  std::vector<std::size_t> p(len);
  for (std::size_t i = 0; i < len; ++i) p[i] = i;
  splitmix64 gen(seed);
  for (std::size_t i = len; i > 1; --i) {
    auto const j = static_cast<std::size_t>(uniform_below(gen, static_cast<std::uint64_t>(i)));
    std::swap(p[i - 1], p[j]);
  }
  return p;
}

/// Below this length torch.randperm draws 32 bits per entry, from it on 64 (PyTorch's
/// std::numeric_limits<uint32_t>::max() / 20).
inline constexpr std::size_t torch_randperm_wide_from = 0xFFFFFFFFu / 20;

/// What torch.randperm(len, generator=g) returns on the CPU after g.manual_seed(seed), as indices.
/// The generator is MT19937 seeded with seed's low 32 bits (std::mt19937 is the same engine, with
/// the same seeding). Below torch_randperm_wide_from: p = 0..len-1, then for i = 0..len-2 swap
/// p[i] with p[i + draw % (len - i)]. From it on: for i = 0..len-1, j = draw64 % (i + 1), p[i] =
/// p[j], p[j] = i, where draw64 is two draws, the first the high half. (`wide_from` moves the
/// switch, for tests.)
inline std::vector<std::size_t> torch_randperm(std::size_t len, std::uint64_t seed,
                                               std::size_t wide_from = torch_randperm_wide_from) {
  std::mt19937 gen(static_cast<std::uint32_t>(seed & 0xFFFFFFFFu));
  std::vector<std::size_t> p(len);
  if (len < wide_from) {
    for (std::size_t i = 0; i < len; ++i) p[i] = i;
    for (std::size_t i = 0; i + 1 < len; ++i) {
      std::size_t const z = static_cast<std::size_t>(gen()) % (len - i);
      std::swap(p[i], p[i + z]);
    }
    return p;
  }
  for (std::size_t i = 0; i < len; ++i) {
    std::uint64_t const hi = gen();
    std::uint64_t const lo = gen();
    auto const j = static_cast<std::size_t>(((hi << 32) | lo) % (static_cast<std::uint64_t>(i) + 1));
    p[i] = p[j];
    p[j] = i;
  }
  return p;
}

/// The shuffled order of epoch `epoch`: a permutation of 0..len-1 drawn from seed + epoch
/// (modulo 2^64) as `order` says. The same on every rank, compiler and platform.
inline std::vector<std::size_t> epoch_permutation(std::size_t len, std::uint64_t seed, std::uint64_t epoch,
                                                  shuffle_order order) {
  return order == shuffle_order::torch ? torch_randperm(len, seed + epoch) : splitmix_permutation(len, seed + epoch);
}

}  // namespace detail

/// Where a sampler stands: its epoch and how many of this rank's indices of that epoch have been
/// consumed (the next sample to read is sampler.indices()[index]), and the shuffle order those
/// indices follow (sampler_options::order), without which the position names other samples.
struct sampler_position {
  /// The sampler's epoch.
  std::uint64_t epoch = 0;
  /// How many of this rank's indices of that epoch have been consumed.
  std::uint64_t index = 0;
  /// The permutation the sampler's shuffled epochs follow (sampler_options::order's default).
  shuffle_order order = shuffle_order::torch;
  friend constexpr bool operator==(sampler_position, sampler_position) = default;
};

/// The samples of one rank, epoch by epoch (torch.utils.data.DistributedSampler).
///
///   dparallel::distributed_sampler sampler(dataset.size(), rank, {.shuffle = true, .seed = 42});
///   for (std::uint64_t epoch = 0; epoch < epochs; ++epoch) {
///     sampler.set_epoch(epoch);             // same epoch on every rank, before iterating
///     for (std::size_t i : sampler) use(dataset[i]);
///   }
///
/// Every rank holds size() indices, the same count on all ranks, so all ranks run the same number
/// of steps. The indices of the current epoch are computed when the sampler is made and when
/// set_epoch() changes the epoch; iterators stay valid until then.
class distributed_sampler {
 public:
  /// A dataset index.
  using value_type = std::size_t;
  /// Iterates this rank's indices of the current epoch.
  using const_iterator = std::vector<std::size_t>::const_iterator;
  /// Iterates this rank's indices of the current epoch (read-only).
  using iterator = const_iterator;

  /// Rank `rank` of `num_replicas` over a dataset of `dataset_size` samples. Throws
  /// invalid_argument when num_replicas < 1 or rank is outside [0, num_replicas).
  distributed_sampler(std::size_t dataset_size, int num_replicas, int rank, sampler_options options = {})
      : dataset_size_(dataset_size), num_replicas_(num_replicas), rank_(rank), options_(options) {
    detail::require(num_replicas >= 1, "distributed_sampler: expected num_replicas >= 1, found " +
                                           std::to_string(num_replicas) +
                                           "; pass the number of ranks in the group (its world size)");
    detail::require(rank >= 0 && rank < num_replicas,
                    "distributed_sampler: expected a rank in [0, " + std::to_string(num_replicas - 1) +
                        "] for num_replicas = " + std::to_string(num_replicas) + ", found rank " +
                        std::to_string(rank) + "; pass this process's rank within the group");
    auto const n = static_cast<std::size_t>(num_replicas);
    num_samples_ = options_.drop_last ? dataset_size / n : dataset_size / n + (dataset_size % n != 0 ? 1 : 0);
    compute_indices();
    detail::sampler_epoch_note() = 1;  // epoch 0
  }

  /// Rank and number of ranks taken from `r` (r.rank(), r.world_size()).
  template <rank_source R>
  distributed_sampler(std::size_t dataset_size, R const& r, sampler_options options = {})
      : distributed_sampler(dataset_size, static_cast<int>(r.world_size()), static_cast<int>(r.rank()), options) {}

  /// Selects the epoch whose order is used (seed + epoch seeds the shuffle). Call it with the
  /// same value on every rank before each epoch; without it every epoch has the same order.
  void set_epoch(std::uint64_t epoch) {
    detail::sampler_epoch_note() = epoch + 1;  // DDP compares it across ranks under desync detection
    if (epoch == epoch_) return;
    epoch_ = epoch;
    start_ = 0;
    compute_indices();
  }
  /// Continues where a checkpoint's position stands (checkpoint::progress().sampler): selects
  /// p.epoch and skips the p.index indices of it that were consumed, so that iterating the sampler
  /// yields the rest of that epoch; a later set_epoch of another epoch starts that one whole (a
  /// set_epoch of the same epoch, as a loop makes at each epoch's top, keeps the position). Throws
  /// invalid_argument when the position was taken in another shuffle order or lies past the epoch.
  void resume(sampler_position const& p) {
    detail::require(p.order == options_.order, [&] {
      return std::string("distributed_sampler::resume: the position was taken in shuffle order '") +
             std::string(name_of(p.order)) + "', this sampler shuffles in '" + std::string(name_of(options_.order)) +
             "'; build the sampler with .order = the checkpoint's progress().sampler.order";
    });
    detail::require(p.index <= num_samples_, [&] {
      return "distributed_sampler::resume: expected a position within the epoch's " + std::to_string(num_samples_) +
             " indices of this rank, found index " + std::to_string(p.index) +
             " (a checkpoint of another dataset size or world size?)";
    });
    set_epoch(p.epoch);
    start_ = static_cast<std::size_t>(p.index);
  }
  /// Where this rank stands after consuming `consumed` indices of the current epoch (what a
  /// checkpoint keeps as progress().sampler; resume() continues from it).
  [[nodiscard]] sampler_position position_after(std::size_t consumed) const noexcept {
    return {epoch_, consumed, options_.order};
  }
  /// How many indices of the current epoch iteration skips (resume()'s position; 0 after set_epoch).
  [[nodiscard]] std::size_t start() const noexcept { return start_; }
  /// The epoch set by set_epoch() (0 at first).
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// Indices this rank reads per epoch (DistributedSampler's num_samples, len(sampler)).
  [[nodiscard]] std::size_t size() const noexcept { return num_samples_; }
  /// Indices all ranks read together per epoch: size() * num_replicas().
  [[nodiscard]] std::size_t total_size() const noexcept {
    return num_samples_ * static_cast<std::size_t>(num_replicas_);
  }
  /// This rank's indices for the current epoch, in order.
  [[nodiscard]] std::vector<std::size_t> const& indices() const noexcept { return indices_; }
  /// This rank's first index of the current epoch not yet consumed (the first one, unless resume()
  /// said otherwise).
  [[nodiscard]] const_iterator begin() const noexcept { return indices_.begin() + static_cast<std::ptrdiff_t>(start_); }
  /// Past this rank's last index of the current epoch.
  [[nodiscard]] const_iterator end() const noexcept { return indices_.end(); }

  /// Number of ranks sharing the dataset.
  [[nodiscard]] int num_replicas() const noexcept { return num_replicas_; }
  /// This sampler's rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of samples in the dataset.
  [[nodiscard]] std::size_t dataset_size() const noexcept { return dataset_size_; }
  /// The options the sampler was made with.
  [[nodiscard]] sampler_options const& options() const noexcept { return options_; }

 private:
  // Entry k of this rank is padded[rank + k * n], where padded[i] = order[i % len]: padding
  // repeats the order from its start, and with drop_last total_size <= len so no entry wraps.
  void compute_indices() {
    indices_.assign(num_samples_, 0);
    if (num_samples_ == 0) return;  // also covers dataset_size_ == 0
    auto const n = static_cast<std::size_t>(num_replicas_);
    auto const r = static_cast<std::size_t>(rank_);
    if (options_.shuffle) {
      std::vector<std::size_t> const order =
          detail::epoch_permutation(dataset_size_, options_.seed, epoch_, options_.order);
      for (std::size_t k = 0; k < num_samples_; ++k) indices_[k] = order[(r + k * n) % dataset_size_];
    } else {
      for (std::size_t k = 0; k < num_samples_; ++k) indices_[k] = (r + k * n) % dataset_size_;
    }
  }

  std::size_t dataset_size_;
  int num_replicas_;
  int rank_;
  sampler_options options_;
  std::uint64_t epoch_ = 0;
  std::size_t start_ = 0;  // resume()'s position in the epoch
  std::size_t num_samples_ = 0;
  std::vector<std::size_t> indices_;
};

DPARALLEL_NAMESPACE_END

#pragma once
// loader: batches made ahead of time by worker threads, handed out in order (the num_workers /
// prefetch_factor part of PyTorch's torch.utils.data.DataLoader, as a C++ type).
//
// A loader holds one epoch's batches, each described by a list of sample indices (a sampler's
// indices cut into batches of batch_size, or lists given directly), and a user callable
// make(std::span<std::size_t const> indices) -> Batch that builds one batch.
//
//   dparallel::loader batches(sampler, 64, make_batch, {.num_workers = 2});
//   for (auto& batch : batches) train_step(batch);
//
// - num_workers = 0: next() makes the batch on the calling thread; no thread is started.
// - num_workers = N > 0: N worker threads (fewer when there are fewer batches) make batches in
//   index order, ahead of the consumer.
//   Batch k is not started before batch k - bound has been handed out (bound = N * prefetch),
//   so at most `bound` batches are made, or being made, and not yet handed out.
// - Batches are handed out in their input order whatever num_workers is: batch k is always
//   make(indices of batch k), so results never depend on the number of workers.
// - An exception thrown while making batch k is rethrown by the next() (or iterator increment)
//   that would return batch k, after batches 0..k-1 were handed out, as a loader_error naming k
//   with the original exception nested (std::rethrow_if_nested recovers it). The same for every
//   num_workers. The loader stays usable: the following next() returns batch k + 1.
// - The destructor stops the workers: they finish the batch they are making (user code is not
//   interrupted), make no further batch, and are joined. A loader dropped mid-epoch, or
//   destroyed by an exception unwinding, never hangs.
// - One loader is one pass over its batches (one epoch); make a new one for the next epoch
//   (after sampler.set_epoch(epoch)), as a DataLoader without persistent_workers does.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Options of loader; the defaults are DataLoader's (num_workers = 0, prefetch_factor = 2,
/// drop_last = false).
struct loader_options {
  /// Worker threads that make batches ahead; 0 makes each batch inside next().
  std::size_t num_workers = 0;
  /// Batches each worker may have ready ahead of the consumer (DataLoader's prefetch_factor):
  /// at most num_workers * prefetch batches are made, or being made, and not yet handed out.
  /// Must be >= 1 (also with num_workers = 0, where it has no effect).
  std::size_t prefetch = 2;
  /// When indices are cut into batches of batch_size: drop a last, incomplete batch instead of
  /// making a smaller one. Has no effect on batches given as explicit index lists.
  bool drop_last = false;
};

/// The default Stage of a loader: hands the made batch on unchanged.
struct identity_stage {
  /// Returns the batch as it is.
  template <class B>
  [[nodiscard]] std::remove_cvref_t<B> operator()(B&& batch) const {
    return std::forward<B>(batch);
  }
};

/// An exception thrown while making (or staging) a batch, as the consumer sees it.
/// `batch_index()` is the batch's position in the epoch; the original exception is nested.
class loader_error : public error {
 public:
  /// Making batch `batch_index` (of `batches`) failed with message `what`.
  loader_error(std::size_t batch_index, std::size_t batches, std::string const& what)
      : error("dparallel: loader: making batch " + std::to_string(batch_index) + " (of " + std::to_string(batches) +
              ", counting from 0) failed: " + what),
        batch_index_(batch_index) {}
  /// Index of the batch whose making failed.
  [[nodiscard]] std::size_t batch_index() const noexcept { return batch_index_; }

 private:
  std::size_t batch_index_;
};

namespace detail {

/// The batch type make returns (void when make cannot be called as the loader calls it).
template <class Make>
struct loader_batch {
  using type = void;
};
template <class Make>
  requires std::invocable<Make const&, std::span<std::size_t const>>
struct loader_batch<Make> {
  using type = std::remove_cvref_t<std::invoke_result_t<Make const&, std::span<std::size_t const>>>;
};

/// The type the consumer receives: Stage's result (void when Stage cannot take the batch).
template <class Stage, class Batch>
struct loader_staged {
  using type = void;
};
template <class Stage, class Batch>
  requires(!std::is_void_v<Batch> && std::invocable<Stage const&, Batch &&>)
struct loader_staged<Stage, Batch> {
  using type = std::remove_cvref_t<std::invoke_result_t<Stage const&, Batch&&>>;
};

}  // namespace detail

/// A prefetching batch loader over one epoch (see the top of this header for the semantics).
///
/// Make is called as `make(std::span<std::size_t const> indices)` on a const object and returns
/// the batch (any move-constructible type). With num_workers > 1 it is called concurrently from
/// several threads, so it must be safe to call concurrently: a lambda that reads shared data, or
/// writes only to the batch it returns, is.
///
/// Stage is the extension point for backends: after a worker made a batch it calls
/// `stage(std::move(batch))` on the same worker thread (on the calling thread with
/// num_workers = 0), and the consumer receives stage's result (value_type), which may be a
/// different type. It runs ahead of the consumer like make, so it is the place for work that
/// should overlap training: the CUDA backend uses it to copy the batch into pinned memory and
/// start an asynchronous copy to the device. Called concurrently like make, on a const object;
/// per-thread resources (a stream per worker) can be thread_local. An exception from stage is
/// reported like one from make. The default, identity_stage, returns the batch unchanged.
///
/// The consumer side (next(), begin(), the wait times) belongs to one thread at a time.
template <class Make, class Stage = identity_stage>
class loader {
  static_assert(std::invocable<Make const&, std::span<std::size_t const>>,
                "dparallel::loader: the make function must be callable on a const object as "
                "make(std::span<std::size_t const> indices) and return one batch");
  using made_type = typename detail::loader_batch<Make>::type;
  static_assert(!std::is_void_v<made_type>, "dparallel::loader: the make function returns void; it must return the batch");
  static_assert(std::move_constructible<made_type>, "dparallel::loader: the batch type must be move-constructible");
  static_assert(std::invocable<Stage const&, made_type&&>,
                "dparallel::loader: the Stage must be callable on a const object as stage(Batch&&) with the "
                "batch the make function returns");

 public:
  /// What the consumer receives: the batch after Stage (with identity_stage: make's result).
  using value_type = typename detail::loader_staged<Stage, made_type>::type;
  static_assert(!std::is_void_v<value_type>, "dparallel::loader: the Stage returns void; it must return the batch");
  static_assert(std::move_constructible<value_type>,
                "dparallel::loader: the type the Stage returns must be move-constructible");

  /// Batches of `batch_size` consecutive entries of `indices` (a distributed_sampler, a
  /// std::vector<std::size_t>, ...; copied, so the sampler may change afterwards). The last batch
  /// is smaller when batch_size does not divide the count, or dropped with options.drop_last.
  /// Throws invalid_argument when batch_size is 0 or the options are invalid (see check).
  template <class R>
    requires std::ranges::input_range<R const> &&
             std::convertible_to<std::ranges::range_reference_t<R const>, std::size_t>
  loader(R const& indices, std::size_t batch_size, Make make, loader_options options = {}, Stage stage = {})
      : make_(std::move(make)), stage_(std::move(stage)), options_(options) {
    check_options();
    detail::require(batch_size >= 1, "loader: expected a batch size >= 1, found 0");
    for (auto&& i : indices) indices_.push_back(static_cast<std::size_t>(i));
    std::size_t const whole = indices_.size() / batch_size;
    bool const partial = indices_.size() % batch_size != 0 && !options_.drop_last;
    offsets_.reserve(whole + 2);
    for (std::size_t b = 0; b <= whole; ++b) offsets_.push_back(b * batch_size);
    if (partial) offsets_.push_back(indices_.size());
    indices_.resize(offsets_.back());
    start();
  }

  /// One batch per index list, in the order given (a batch sampler's output). Every list must
  /// hold at least one index; options.drop_last has no effect here.
  loader(std::vector<std::vector<std::size_t>> const& batches, Make make, loader_options options = {},
         Stage stage = {})
      : make_(std::move(make)), stage_(std::move(stage)), options_(options) {
    check_options();
    offsets_.reserve(batches.size() + 1);
    offsets_.push_back(0);
    for (std::size_t b = 0; b < batches.size(); ++b) {
      detail::require(!batches[b].empty(), "loader: expected every batch to hold at least one index, found batch " +
                                               std::to_string(b) + " of " + std::to_string(batches.size()) +
                                               " empty");
      indices_.insert(indices_.end(), batches[b].begin(), batches[b].end());
      offsets_.push_back(indices_.size());
    }
    start();
  }

  loader(loader const&) = delete;
  loader& operator=(loader const&) = delete;

  /// Stops the workers (each finishes the batch it is making) and joins them.
  ~loader() { stop(); }

  /// Number of batches in the epoch (DataLoader's len()).
  [[nodiscard]] std::size_t size() const noexcept { return offsets_.size() - 1; }
  /// The sample indices of batch k (k < size()).
  [[nodiscard]] std::span<std::size_t const> batch_indices(std::size_t k) const {
    detail::require(k < size(), "loader: expected a batch index below " + std::to_string(size()) + ", found " +
                                    std::to_string(k));
    return span_of(k);
  }
  /// The options the loader was made with.
  [[nodiscard]] loader_options const& options() const noexcept { return options_; }
  /// Batches handed out so far (the index of the batch the next call to next() returns).
  [[nodiscard]] std::size_t position() const noexcept { return position_; }

  /// The next batch in order, or std::nullopt after the last one. Blocks until it is made (with
  /// num_workers = 0: makes it). Rethrows the failure of making it as a loader_error.
  [[nodiscard]] std::optional<value_type> next() {
    if (position_ == size()) {
      last_wait_ = std::chrono::nanoseconds{0};
      return std::nullopt;
    }
    auto const t0 = std::chrono::steady_clock::now();
    std::optional<value_type> batch;
    std::exception_ptr failure;
    if (workers_.empty()) {
      produce(position_++, batch, failure);
    } else {
      {
        std::unique_lock lock(m_);
        slot& s = slots_[position_ % slots_.size()];
        ready_cv_.wait(lock, [&] { return s.ready; });
        batch = std::move(s.value);
        failure = s.failure;
        s.value.reset();
        s.failure = nullptr;
        s.ready = false;
        ++position_;
      }
      work_cv_.notify_one();  // room for one more batch
    }
    last_wait_ = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
    total_wait_ += last_wait_;
    if (failure) std::rethrow_exception(failure);
    return batch;
  }

  /// How long the last next() blocked (with num_workers = 0: the time it took to make the batch).
  [[nodiscard]] std::chrono::nanoseconds last_wait() const noexcept { return last_wait_; }
  /// The sum of every next()'s wait: the time the consumer spent waiting for data.
  [[nodiscard]] std::chrono::nanoseconds total_wait() const noexcept { return total_wait_; }

  /// Input iterator over the remaining batches: `for (auto& batch : loader)`. begin() fetches
  /// the next batch (so it may block or throw like next()); the batch the iterator points to
  /// lives in the loader until the iterator is incremented. Single pass: a second begin()
  /// continues after the batches already handed out.
  class iterator {
   public:
    /// A batch.
    using value_type = loader::value_type;
    /// Iterator distance type.
    using difference_type = std::ptrdiff_t;

    iterator() = default;
    /// The current batch.
    [[nodiscard]] value_type& operator*() const { return *owner_->current_; }
    /// The current batch.
    value_type* operator->() const { return &*owner_->current_; }
    /// Moves to the next batch (waiting for it when it is not made yet).
    iterator& operator++() {
      owner_->advance();
      return *this;
    }
    /// Moves to the next batch.
    void operator++(int) { ++*this; }
    [[nodiscard]] friend bool operator==(iterator const& it, std::default_sentinel_t) noexcept {
      return it.at_end();
    }

   private:
    friend class loader;
    explicit iterator(loader* owner) : owner_(owner) {}
    [[nodiscard]] bool at_end() const noexcept { return owner_ == nullptr || !owner_->current_.has_value(); }
    loader* owner_ = nullptr;
  };

  /// Starts the epoch: the first batch.
  [[nodiscard]] iterator begin() {
    advance();
    return iterator(this);
  }
  /// The end of the epoch.
  [[nodiscard]] std::default_sentinel_t end() const noexcept { return {}; }

 private:
  struct slot {
    std::optional<value_type> value;
    std::exception_ptr failure;
    bool ready = false;
  };

  void check_options() const {
    detail::require(options_.prefetch >= 1, "loader: expected prefetch >= 1 (batches ready ahead per worker), found 0");
    detail::require(options_.num_workers <= std::numeric_limits<std::size_t>::max() / options_.prefetch,
                    "loader: expected num_workers * prefetch to fit in std::size_t, found num_workers = " +
                        std::to_string(options_.num_workers) + ", prefetch = " + std::to_string(options_.prefetch));
  }

  [[nodiscard]] std::span<std::size_t const> span_of(std::size_t k) const noexcept {
    return std::span<std::size_t const>(indices_).subspan(offsets_[k], offsets_[k + 1] - offsets_[k]);
  }

  // Makes and stages batch k into `out`, or leaves the failure, wrapped as a loader_error, in
  // `failure`.
  void produce(std::size_t k, std::optional<value_type>& out, std::exception_ptr& failure) const noexcept {
    try {
      try {
        made_type made = make_(span_of(k));
        out.emplace(stage_(std::move(made)));
      } catch (std::exception const& ex) {
        std::throw_with_nested(loader_error(k, size(), ex.what()));
      } catch (...) {
        std::throw_with_nested(loader_error(k, size(), "an exception not derived from std::exception"));
      }
    } catch (...) {
      out.reset();
      failure = std::current_exception();
    }
  }

  void advance() {
    current_.reset();
    if (auto b = next()) current_.emplace(std::move(*b));
  }

  void start() {
    if (options_.num_workers == 0 || size() == 0) return;
    slots_ = std::vector<slot>(options_.num_workers * options_.prefetch);
    std::size_t const count = options_.num_workers < size() ? options_.num_workers : size();
    try {
      workers_.reserve(count);
      for (std::size_t w = 0; w < count; ++w) workers_.emplace_back([this] { work(); });
    } catch (...) {
      stop();
      throw;
    }
  }

  void stop() noexcept {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }

  // A worker: claims the next batch in order while there is room (batch k needs k < position_ +
  // bound, which also keeps its slot k % bound free), makes it unlocked, stores it.
  void work() {
    std::size_t const bound = slots_.size();
    std::unique_lock lock(m_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stopping_ || next_claim_ == size() || next_claim_ < position_ + bound; });
      if (stopping_ || next_claim_ == size()) return;
      std::size_t const k = next_claim_++;
      if (next_claim_ == size()) work_cv_.notify_all();  // nothing left: let idle workers exit
      lock.unlock();
      std::optional<value_type> batch;
      std::exception_ptr failure;
      produce(k, batch, failure);
      lock.lock();
      slot& s = slots_[k % bound];
      s.value = std::move(batch);
      s.failure = failure;
      s.ready = true;
      if (k == position_) ready_cv_.notify_one();
    }
  }

  Make make_;
  Stage stage_;
  loader_options options_;
  std::vector<std::size_t> indices_;  // every batch's indices, back to back
  std::vector<std::size_t> offsets_;  // batch k is indices_[offsets_[k], offsets_[k + 1])

  // Consumer side.
  std::optional<value_type> current_;  // the batch an iterator points to
  std::chrono::nanoseconds last_wait_{0};
  std::chrono::nanoseconds total_wait_{0};

  // Shared with the workers, under m_ (position_ is written only by the consumer, under m_ when
  // there are workers).
  std::mutex m_;
  std::condition_variable work_cv_;   // workers: room for another batch, or stop
  std::condition_variable ready_cv_;  // consumer: the batch at position_ is ready
  std::vector<slot> slots_;           // batch k in slots_[k % bound]
  std::size_t position_ = 0;          // batches handed out
  std::size_t next_claim_ = 0;        // the next batch a worker starts
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

DPARALLEL_NAMESPACE_END

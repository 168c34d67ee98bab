#pragma once
// A timeline of a wrapper's steps, written as a Chrome trace event file (the JSON object format
// with "traceEvents": Perfetto and chrome://tracing load it), one file per wrapper and rank.
//
// On with options::trace (a directory), or without recompiling with the environment variable
// DPARALLEL_TRACE=<dir>: each wrapper writes <dir>/dparallel.rank<r>.<pid>.<k>.trace.json when it
// is destroyed (or at flush_trace()), k counting the traced wrappers of the process.
// scripts/merge-traces puts the files of every rank into one timeline: one process per rank, the
// clocks aligned at the moment the wrapper was constructed (for DDP the end of the constructor's
// collectives, which every rank leaves together; the files say it as "aligned_at_us").
//
// Events (timestamps and durations in microseconds; `cat` one of step, compute, comm, wait, data):
//   step         cat step     the whole step() call; args: step (counting from 0), batch
//   data wait    cat data     the loop's wait for the batch, as told by note_data_wait()
//   scatter      cat step     planning the shards
//   replicate    cat comm     until the first step function starts (DP's parameter copies)
//   reduce wait  cat wait     from the last step function's end until every stream drained: the
//                             communication the step function did not hide
//   gather       cat step     joining the outputs
//   step function cat compute one per device or rank, on its own track (tid 1 + device index)
//   grad ready   cat compute  DDP: an instant when the step function marks a gradient ready
//                             (step_context::grad_ready); args: param
//   bucket       cat comm     DDP: a bucket's collective, from its launch until the step saw it
//                             complete, on track 1000; args: bucket, bytes, op
// The step's phases are those of core/profile.hpp's step_profile, from the same time points.
#include <dparallel/config.hpp>
#include <dparallel/core/profile.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <unistd.h>

DPARALLEL_NAMESPACE_BEGIN

/// The directory a wrapper traces to: `dir` when given, else DPARALLEL_TRACE, else none (empty).
inline std::string trace_directory(std::string const& dir) {
  if (!dir.empty()) return dir;
  char const* env = std::getenv("DPARALLEL_TRACE");
  return env != nullptr ? std::string(env) : std::string();
}

/// Where a traced wrapper's events go: the open file's events, a stable object (policies keep a
/// pointer to it: replica_set::trace). Thread-safe.
class trace_log {
 public:
  /// The events go to `path`, as rank `rank` of `world`; times count from `aligned`.
  trace_log(std::string path, int rank, int world, profile_clock::time_point aligned)
      : path_(std::move(path)), rank_(rank), world_(world), aligned_(aligned) {}
  /// The file written.
  [[nodiscard]] std::string const& path() const noexcept { return path_; }
  /// A complete event (ph "X") on track `tid`; `args`: JSON members without braces, or empty.
  void span(char const* name, char const* cat, int tid, profile_clock::time_point begin,
            profile_clock::time_point end, std::string const& args) {
    std::lock_guard lock(m_);
    add(name, cat, "X", tid, begin, end, args);
  }
  /// An instant event (ph "i", on its thread) at `t`.
  void instant(char const* name, char const* cat, int tid, std::string const& args,
               profile_clock::time_point t = profile_clock::now()) {
    std::lock_guard lock(m_);
    add(name, cat, "i", tid, t, t, args);
  }
  /// A step's events (see step_trace::record).
  template <class Active>
  void step(profile_clock::time_point entered, profile_clock::time_point planned, profile_clock::time_point first,
            profile_clock::time_point last, profile_clock::time_point drained, profile_clock::time_point returned,
            profile_duration waited, std::size_t batch, std::span<profile_clock::time_point const> started,
            std::span<profile_clock::time_point const> ended, Active&& active) {
    std::lock_guard lock(m_);
    std::uint64_t const n = steps_++;
    if (waited.count() > 0)
      add("data wait", "data", "X", 0, entered - std::chrono::duration_cast<profile_clock::duration>(waited), entered, "");
    add("step", "step", "X", 0, entered, returned, "\"step\":" + std::to_string(n) + ",\"batch\":" + std::to_string(batch));
    add("scatter", "step", "X", 0, entered, planned, "");
    add("replicate", "comm", "X", 0, planned, first, "");
    add("reduce wait", "wait", "X", 0, last, drained, "");
    add("gather", "step", "X", 0, drained, returned, "");
    for (std::size_t i = 0; i < started.size(); ++i)
      if (active(i))
        add("step function", "compute", "X", static_cast<int>(i) + 1, started[i], ended[i], "\"device\":" + std::to_string(i));
  }
  /// Writes the file (to a temporary file, then renamed over it: a reader never sees half of it).
  void write() {
    std::lock_guard lock(m_);
    std::string const tmp = path_ + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f << "{\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"rank\":" << rank_ << ",\"world_size\":" << world_
        << ",\"aligned_at_us\":0},\n\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank_
        << ",\"args\":{\"name\":\"rank " << rank_ << "\"}}" << (events_.empty() ? "" : ",\n") << events_ << "\n]}\n";
      if (!f)
        throw std::filesystem::filesystem_error("dparallel: could not write the trace", tmp,
                                                std::make_error_code(std::errc::io_error));
    }
    std::filesystem::rename(tmp, path_);
  }

 private:
  void add(char const* name, char const* cat, char const* ph, int tid, profile_clock::time_point begin,
           profile_clock::time_point end, std::string const& args) {
    if (end < begin) end = begin;
    char head[256];
    std::snprintf(head, sizeof head, "{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f",
                  name, cat, ph, rank_, tid, std::chrono::duration<double, std::micro>(begin - aligned_).count());
    if (!events_.empty()) events_ += ",\n";
    events_ += head;
    if (ph[0] == 'X') {
      std::snprintf(head, sizeof head, ",\"dur\":%.3f", std::chrono::duration<double, std::micro>(end - begin).count());
      events_ += head;
    } else {
      events_ += ",\"s\":\"t\"";
    }
    if (!args.empty()) events_ += ",\"args\":{" + args + "}";
    events_ += "}";
  }

  std::string path_;
  int rank_, world_;
  profile_clock::time_point aligned_;
  std::mutex m_;
  std::string events_;
  std::uint64_t steps_ = 0;
};

/// One wrapper's timeline (see the top of core/trace.hpp). Off until open(); then record() adds
/// a step's events and the destructor writes the file. Movable (the wrapper is; the log stays).
class step_trace {
 public:
  step_trace() = default;
  /// Takes over `o`'s timeline.
  step_trace(step_trace&&) noexcept = default;
  /// Writes this timeline's file, then takes over `o`'s.
  step_trace& operator=(step_trace&& o) noexcept {
    if (this != &o) {
      close();
      log_ = std::move(o.log_);
    }
    return *this;
  }
  ~step_trace() { close(); }

  /// Traces to `dir` (created when missing) as rank `rank` of `world` ranks; the time of this
  /// call is the alignment point of the ranks' clocks. Does nothing when `dir` is empty.
  void open(std::string const& dir, int rank, int world) {
    if (dir.empty()) return;
    static std::atomic<int> counter{0};
    std::filesystem::create_directories(dir);
    std::string const name = "dparallel.rank" + std::to_string(rank) + "." +
                             std::to_string(static_cast<long long>(::getpid())) + "." +
                             std::to_string(counter.fetch_add(1)) + ".trace.json";
    log_ = std::make_unique<trace_log>((std::filesystem::path(dir) / name).string(), rank, world, profile_clock::now());
  }
  /// Whether this wrapper traces.
  [[nodiscard]] bool on() const noexcept { return log_ != nullptr; }
  /// The log (null when off): stable while this object lives, also across moves.
  [[nodiscard]] trace_log* log() const noexcept { return log_.get(); }
  /// The file it writes (empty when off).
  [[nodiscard]] std::string path() const { return log_ ? log_->path() : std::string(); }

  /// A step's events from its time points: entered step(), shards planned, the first step
  /// function's start and the last one's end, streams drained, returned; `waited` before it; each
  /// device's step function start and end (for the devices where `active(i)`).
  template <class Active>
  void record(profile_clock::time_point entered, profile_clock::time_point planned, profile_clock::time_point first,
              profile_clock::time_point last, profile_clock::time_point drained, profile_clock::time_point returned,
              profile_duration waited, std::size_t batch, std::span<profile_clock::time_point const> started,
              std::span<profile_clock::time_point const> ended, Active&& active) {
    if (log_) log_->step(entered, planned, first, last, drained, returned, waited, batch, started, ended, active);
  }

  /// Writes the file now (it is written again, with the later steps, at destruction).
  void flush() {
    if (log_) log_->write();
  }

 private:
  void close() noexcept {
    if (!log_) return;
    try {
      log_->write();
    } catch (std::exception const& e) {
      std::fprintf(stderr, "dparallel: the trace %s was not written: %s\n", log_->path().c_str(), e.what());
    }
    log_.reset();
  }

  std::unique_ptr<trace_log> log_;
};

DPARALLEL_NAMESPACE_END

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
#include <unistd.h>

DPARALLEL_NAMESPACE_BEGIN

/// The directory a wrapper traces to: `dir` when given, else DPARALLEL_TRACE, else none (empty).
inline std::string trace_directory(std::string const& dir) {
  if (!dir.empty()) return dir;
  char const* env = std::getenv("DPARALLEL_TRACE");
  return env != nullptr ? std::string(env) : std::string();
}

/// One wrapper's timeline (see the top of core/trace.hpp). Off until open(); then record() adds
/// a step's events and the destructor writes the file. Movable (the wrapper is).
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
    auto l = std::make_unique<log>();
    l->path = (std::filesystem::path(dir) / ("dparallel.rank" + std::to_string(rank) + "." +
                                             std::to_string(static_cast<long long>(::getpid())) + "." +
                                             std::to_string(counter.fetch_add(1)) + ".trace.json"))
                  .string();
    l->rank = rank;
    l->world = world;
    l->aligned = profile_clock::now();
    log_ = std::move(l);
  }
  /// Whether this wrapper traces.
  [[nodiscard]] bool on() const noexcept { return log_ != nullptr; }
  /// The file it writes (empty when off).
  [[nodiscard]] std::string path() const { return log_ ? log_->path : std::string(); }

  /// A step's events from its time points: entered step(), shards planned, the first step
  /// function's start and the last one's end, streams drained, returned; `waited` before it; each
  /// device's step function start and end (for the devices where `active(i)`).
  template <class Active>
  void record(profile_clock::time_point entered, profile_clock::time_point planned, profile_clock::time_point first,
              profile_clock::time_point last, profile_clock::time_point drained, profile_clock::time_point returned,
              profile_duration waited, std::size_t batch, std::span<profile_clock::time_point const> started,
              std::span<profile_clock::time_point const> ended, Active&& active) {
    if (!log_) return;
    log& l = *log_;
    std::lock_guard lock(l.m);
    std::uint64_t const step = l.steps++;
    if (waited.count() > 0)
      l.event("data wait", "data", 0, entered - std::chrono::duration_cast<profile_clock::duration>(waited), entered, "");
    l.event("step", "step", 0, entered, returned, "\"step\":" + std::to_string(step) + ",\"batch\":" + std::to_string(batch));
    l.event("scatter", "step", 0, entered, planned, "");
    l.event("replicate", "comm", 0, planned, first, "");
    l.event("reduce wait", "wait", 0, last, drained, "");
    l.event("gather", "step", 0, drained, returned, "");
    for (std::size_t i = 0; i < started.size(); ++i)
      if (active(i))
        l.event("step function", "compute", static_cast<int>(i) + 1, started[i], ended[i],
                "\"device\":" + std::to_string(i));
  }

  /// Writes the file now (it is written again, with the later steps, at destruction).
  void flush() {
    if (!log_) return;
    std::lock_guard lock(log_->m);
    log_->write();
  }

 private:
  struct log {
    std::string path;
    int rank = 0, world = 1;
    profile_clock::time_point aligned;
    std::mutex m;
    std::string events;
    std::uint64_t steps = 0;

    [[nodiscard]] double us(profile_clock::time_point t) const {
      return std::chrono::duration<double, std::micro>(t - aligned).count();
    }
    void event(char const* name, char const* cat, int tid, profile_clock::time_point begin,
               profile_clock::time_point end, std::string const& args) {
      if (end < begin) end = begin;
      char head[256];
      std::snprintf(head, sizeof head,
                    "{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f", name,
                    cat, rank, tid, us(begin), std::chrono::duration<double, std::micro>(end - begin).count());
      if (!events.empty()) events += ",\n";
      events += head;
      if (!args.empty()) events += ",\"args\":{" + args + "}";
      events += "}";
    }
    // Written to a temporary file, then renamed over the file: a reader never sees half of it.
    void write() const {
      std::string const tmp = path + ".tmp";
      {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        f << "{\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"rank\":" << rank << ",\"world_size\":" << world
          << ",\"aligned_at_us\":0},\n\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank
          << ",\"args\":{\"name\":\"rank " << rank << "\"}}" << (events.empty() ? "" : ",\n") << events << "\n]}\n";
        if (!f)
          throw std::filesystem::filesystem_error("dparallel: could not write the trace", tmp,
                                                  std::make_error_code(std::errc::io_error));
      }
      std::filesystem::rename(tmp, path);
    }
  };

  void close() noexcept {
    if (!log_) return;
    try {
      std::lock_guard lock(log_->m);
      log_->write();
    } catch (std::exception const& e) {
      std::fprintf(stderr, "dparallel: the trace %s was not written: %s\n", log_->path.c_str(), e.what());
    }
    log_.reset();
  }

  std::unique_ptr<log> log_;
};

DPARALLEL_NAMESPACE_END

#pragma once
// The process-wide MPI engine (see <dparallel/comm/mpi.hpp>, "Threads" and "Failures never
// hang"): MPI's initialisation and finalisation, and the one progress thread that drives every
// MPI communicator of the process.

#include <dparallel/config.hpp>
#include <dparallel/comm/mpi/detail/common.hpp>
#include <dparallel/comm/mpi/detail/state.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// The process-wide MPI engine: initialises MPI when needed, owns the progress thread, ends the
/// job cleanly (MPI_Finalize) or, after a failure with collectives in flight, with MPI_Abort.
class mpi_engine {
 public:
  mpi_engine() {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized != 0)
      throw error("dparallel: mpi: MPI was already finalised in this process; MPI cannot be initialised again");
    int provided = MPI_THREAD_SINGLE;
    if (initialized == 0) {
      int const rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) throw error("dparallel: mpi: MPI_Init_thread failed: " + mpi_error_text(rc));
      initialized_here_ = true;
      // Errors MPI raises on MPI_COMM_WORLD (Open MPI 4.1 reports some failures of requests on
      // dparallel's own communicators there) must reach dparallel as codes, never end the rank
      // through the default fatal handler. A program that initialised MPI keeps its own handler.
      MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      std::string const msg = "dparallel: mpi: expected MPI with MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE "
                              "(dparallel calls MPI from its progress thread), found " +
                              thread_level_name(provided) +
                              (initialized_here_ ? std::string("; this MPI library does not support threads")
                                                 : std::string("; initialise MPI with MPI_Init_thread(&argc, &argv, "
                                                               "MPI_THREAD_MULTIPLE, &provided)"));
      if (initialized_here_) MPI_Finalize();
      throw error(msg);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    // Stop the progress thread when the program (or we) call MPI_Finalize.
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &mpi_engine::on_finalize, &keyval_, nullptr);
    MPI_Comm_set_attr(MPI_COMM_SELF, keyval_, this);
    thread_ = std::thread([this] { loop(); });
  }
  mpi_engine(mpi_engine const&) = delete;
  mpi_engine& operator=(mpi_engine const&) = delete;
  ~mpi_engine() { shutdown(true); }

  /// The engine of this process, made (and MPI initialised) on first use.
  static std::shared_ptr<mpi_engine> instance() {
    auto& h = holder();
    std::lock_guard lock(h.m);
    if (h.engine) return h.engine;
    if (h.shut_down)
      throw error("dparallel: mpi: MPI was finalised (dparallel::mpi::finalize, MPI_Finalize or the end of the "
                  "program); a process cannot use MPI again after that");
    h.engine = std::make_shared<mpi_engine>();
    return h.engine;
  }

  /// Ends dparallel's use of MPI: see mpi::finalize().
  static void finalize_process() {
    std::shared_ptr<mpi_engine> e;
    {
      auto& h = holder();
      std::lock_guard lock(h.m);
      e = h.engine;
      h.shut_down = true;
    }
    if (e) e->shutdown(true);
  }

  /// Runs f() on the progress thread and waits for it (its exception is rethrown here).
  void call(std::function<void()> f) {
    std::promise<void> done;
    auto fut = done.get_future();
    {
      std::lock_guard lock(m_);
      if (stopping_) throw error("dparallel: mpi: MPI is being finalised; no new MPI work can start");
      calls_.push_back([&] {
        try {
          f();
          done.set_value();
        } catch (...) {
          done.set_exception(std::current_exception());
        }
      });
    }
    cv_.notify_all();
    fut.get();
  }

  void attach(std::shared_ptr<mpi_comm_state> s) {
    {
      std::lock_guard lock(m_);
      comms_.push_back(std::move(s));
    }
    cv_.notify_all();
  }
  void wake() {
    {
      std::lock_guard lock(m_);
      woken_ = true;
    }
    cv_.notify_all();
  }
  [[nodiscard]] bool stopped() {
    std::lock_guard lock(m_);
    return stopping_;
  }
  /// A reason to end the job with MPI_Abort at exit (the first one is kept). `lead`: this rank
  /// calls MPI_Abort at once; otherwise it gives a leading rank 5 s first.
  void must_abort(std::string why, bool lead = true) {
    std::lock_guard lock(m_);
    if (abort_reason_.empty()) abort_reason_ = std::move(why);
    lead_abort_ = lead_abort_ || lead;
  }
  /// Asked when the engine stops, before MPI_Finalize: a reason to end the job with MPI_Abort
  /// (passed to must_abort with whether this rank leads), or an empty string. For groups MPI does
  /// not run itself (the shared-memory switch), whose failures MPI_Finalize cannot see.
  void watch_exit(std::function<std::pair<std::string, bool>()> check) {
    std::lock_guard lock(m_);
    exit_checks_.push_back(std::move(check));
  }

 private:
  struct holder_t {
    std::mutex m;
    std::shared_ptr<mpi_engine> engine;
    bool shut_down = false;
    ~holder_t() {
      std::shared_ptr<mpi_engine> e;
      {
        std::lock_guard lock(m);
        e = engine;
        shut_down = true;
      }
      if (e) e->shutdown(true);  // at exit, whoever still holds the engine
    }
  };
  static holder_t& holder() {
    static holder_t h;
    return h;
  }

  static int on_finalize(MPI_Comm, int, void* attr, void*) {
    static_cast<mpi_engine*>(attr)->shutdown(false);
    return MPI_SUCCESS;
  }

  // Stops the progress thread (after the running collectives finished or failed and the exit
  // handshake of failed groups), then MPI_Abort or (when dparallel initialised MPI and `finalize`)
  // MPI_Finalize. Idempotent.
  void shutdown(bool finalize) {
    stop_and_settle();
    if (!finalize) return;
    std::lock_guard once(finalize_m_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized == 0 && !finalize_called_) {
      finalize_called_ = true;
      if (keyval_ != MPI_KEYVAL_INVALID) {
        MPI_Comm_delete_attr(MPI_COMM_SELF, keyval_);  // calls on_finalize: a no-op by now
        MPI_Comm_free_keyval(&keyval_);
      }
      if (initialized_here_) MPI_Finalize();
    }
  }

  void stop_and_settle() {
    std::lock_guard once(shutdown_m_);
    if (!shut_) {
      shut_ = true;
      {
        std::lock_guard lock(m_);
        stopping_ = true;
      }
      cv_.notify_all();
      if (thread_.joinable()) thread_.join();
      std::vector<std::shared_ptr<mpi_comm_state>> comms;
      {
        std::lock_guard lock(m_);
        comms = comms_;
      }
      std::vector<std::function<std::pair<std::string, bool>()>> checks;
      {
        std::lock_guard lock(m_);
        checks.swap(exit_checks_);
      }
      for (auto& check : checks) {
        auto [why, lead] = check();
        if (!why.empty()) must_abort(std::move(why), lead);
      }
      // A set-up that timed out, or a failed node group: no handshake to elect anyone.
      bool leader = lead_abort_;
      for (auto& c : comms) {
        c->mark_stopped();
        if (c->failed()) {
          if (auto p = c->exit_problem(); !p.empty()) {
            must_abort(p, false);
            leader = leader || c->abort_leader();
          }
        }
      }
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!abort_reason_.empty() && finalized == 0) {
        std::fflush(nullptr);
        std::fprintf(stderr, "dparallel: rank %d: the MPI job must end with MPI_Abort, because %s\n", world_rank_,
                     abort_reason_.c_str());
        std::fflush(stderr);
        // One rank ends the job (concurrent MPI_Aborts garble the launcher's report); the others
        // wait for it a little, then end it themselves.
        if (!leader) std::this_thread::sleep_for(std::chrono::seconds(5));
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      if (finalized == 0) {
        for (auto& c : comms) {
          c->fail_now("MPI is being finalised");
          c->free_comms();
        }
      }
      std::lock_guard lock(m_);
      comms_.clear();
    }
  }

  void loop() {
    int idle = 0;
    bool exit_started = false;
    for (;;) {
      std::vector<std::shared_ptr<mpi_comm_state>> comms;
      std::deque<std::function<void()>> calls;
      bool stop = false;
      {
        std::lock_guard lock(m_);
        comms = comms_;
        calls.swap(calls_);
        stop = stopping_;
        woken_ = false;
      }
      for (auto& f : calls) f();
      auto const now = mpi_clock::now();
      bool progressed = !calls.empty();
      bool active = false;
      for (auto& c : comms) {
        auto const t = c->progress(now);
        progressed |= t.progressed;
        active |= t.active;
      }
      {
        std::vector<std::shared_ptr<mpi_comm_state>> done;
        for (auto& c : comms)
          if (c->finished()) done.push_back(c);
        if (!done.empty()) {
          std::lock_guard lock(m_);
          std::erase_if(comms_, [&](auto const& c) { return std::find(done.begin(), done.end(), c) != done.end(); });
        }
      }
      if (stop) {
        // Let running collectives finish (or fail at their timeout), then the exit handshake.
        bool busy = false;
        for (auto& c : comms) busy |= c->busy();
        if (!busy) {
          if (!exit_started) {
            exit_started = true;
            for (auto& c : comms)
              if (c->failed()) c->start_exit(now + c->opts().exit_grace);
            continue;
          }
          bool done = true;
          for (auto& c : comms) done &= c->exit_done(mpi_clock::now());
          if (done) return;
        }
      }
      if (progressed) {
        idle = 0;
        continue;
      }
      if (active || stop) {
        // Poll the running collective; back off so that a waiting rank leaves the cores to compute.
        ++idle;
        if (idle < 64) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(idle < 512 ? 20 : 100));
        continue;
      }
      std::unique_lock lock(m_);
      // Idle: new collectives wake the thread at once; control messages are read every 5 ms.
      cv_.wait_for(lock, std::chrono::milliseconds(5), [&] { return woken_ || !calls_.empty() || stopping_; });
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<mpi_comm_state>> comms_;
  std::deque<std::function<void()>> calls_;
  bool woken_ = false;
  bool stopping_ = false;
  std::string abort_reason_;
  bool lead_abort_ = false;
  std::vector<std::function<std::pair<std::string, bool>()>> exit_checks_;

  std::mutex shutdown_m_;  // stop_and_settle
  std::mutex finalize_m_;  // the MPI_Finalize part of shutdown (MPI_Comm_delete_attr re-enters shutdown)
  bool shut_ = false;
  bool finalize_called_ = false;
  bool initialized_here_ = false;
  int world_rank_ = 0;
  int keyval_ = MPI_KEYVAL_INVALID;
  std::thread thread_;
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

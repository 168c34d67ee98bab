// Failure scenarios of DDP over MPI, each run as a real MPI job by run_mpi_fault.cmake, which
// checks the job's exit status, its output and its duration:
//   mpi_fault kill <timeout_ms>     rank 1 kills itself (SIGKILL) in its 4th DDP step
//   mpi_fault throw <timeout_ms>    rank 1's step function throws in its 4th DDP step
//   mpi_fault missing <timeout_ms>  the last rank skips one all_reduce and then sleeps
//   mpi_fault early <timeout_ms>    the last rank's group ends (destroyed) after 3 all_reduces and
//                                  the rank sleeps; the others fail their 4th at once, naming it
//   mpi_fault avg|count|kind <timeout_ms>  rank 1's third all_reduce differs from rank 0's (avg
//                                  instead of sum, 999 instead of 1000 elements, a broadcast)
//   mpi_fault stop <timeout_ms>     over shared memory (the MPI engine's node group): rank 1 stops
//                                  itself (SIGSTOP) before its 4th all_reduce; the survivors time
//                                  out and the job must end (MPI_Abort), not wait in MPI_Finalize
// Every surviving rank prints the error it caught, with the rank the error names:
//   mpi_fault: rank R: caught comm_error naming rank F: <message>
// and, when that error is a timeout_error, the line `mpi_fault: rank R: the error is a timeout_error`.
// The group keeps MPI's data path (mpi::options::shared_memory = false): these are the MPI
// engine's failure paths; the shared-memory engine's are in tests/test_shm.cpp. Scenario `stop`
// takes the shared-memory switch: how a failure of the node group ends the MPI job.
#include "../models.hpp"

#include <dparallel/comm/mpi.hpp>
#include <dparallel/dparallel.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace dpl = dparallel;
using model = test::chunked<float>;

namespace {

/// The comm_error inside `e` (DDP reports a collective's failure as a device_error with the
/// comm_error nested), or null.
dpl::comm_error const* find_comm_error(std::exception const& e) {
  if (auto const* c = dynamic_cast<dpl::comm_error const*>(&e)) return c;
  try {
    std::rethrow_if_nested(e);
  } catch (std::exception const& inner) {
    return find_comm_error(inner);
  } catch (...) {
  }
  return nullptr;
}

void ddp_training(dpl::process_group const& group, std::string const& scenario) {
  int const rank = group.rank();
  model m;
  dpl::distributed_data_parallel<model> ddp(
      m, group, {.bucket_cap_mb = 8.0 / (1024 * 1024), .first_bucket_cap_mb = 4.0 / (1024 * 1024)});
  for (int step = 0; step < 400; ++step) {
    auto const data = test::dataset<float>::make(4 * static_cast<std::size_t>(group.size()), m.dim,
                                                 static_cast<std::uint64_t>(step), false);
    auto const first = static_cast<std::size_t>(rank) * 4;
    ddp.step(dpl::slice_batch(data.all(), first, first + 4),
             [&](model& r, test::samples<float> s, dpl::step_context& ctx) {
               if (rank == 1 && step == 3) {
                 if (scenario == "kill") std::raise(SIGKILL);
                 if (scenario == "throw") throw std::runtime_error("injected failure on rank 1");
               }
               return r.forward_backward(s, &ctx);
             });
    ddp.module().sgd(0.01f);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void missing_collective(dpl::process_group const& group) {
  int const last = group.size() - 1;
  for (int k = 0; k < 10; ++k) {
    if (group.rank() == last && k == 3) {
      std::this_thread::sleep_for(std::chrono::seconds(120));  // never calls collective #4
      return;
    }
    std::vector<float> v(100, 1.0f);
    group.all_reduce(dpl::view(v)).wait();
  }
}

/// The last rank ends its group (as a rank whose loop ran out of batches destroys its wrapper and
/// group) after 3 all_reduces, then stays alive; the others' 4th all_reduce fails at once with a
/// comm_error naming it (as on thread ranks and shared memory), not a timeout_error at the timeout.
void early_end(std::chrono::milliseconds timeout) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  {
    auto const g = dpl::mpi::make_group(MPI_COMM_WORLD, timeout, {.shared_memory = false});
    for (int k = 0; k < 10; ++k) {
      if (rank == size - 1 && k == 3) break;
      std::vector<float> v(100, 1.0f);
      g.all_reduce(dpl::view(v)).wait();
    }
  }
  if (rank == size - 1) std::this_thread::sleep_for(std::chrono::seconds(120));  // ended by the others' MPI_Abort
}

/// Rank 1's third collective differs from the others' (unchecked: sum vs avg gave mixed data,
/// 1000 vs 999 elements ended a rank through Open MPI's fatal handler, all_reduce vs broadcast
/// hung one rank): every rank must fail with the same comm_error naming rank 1.
void mismatched_collective(dpl::process_group const& group, std::string const& scenario) {
  for (int k = 0; k < 5; ++k) {
    bool const odd = group.rank() == 1 && k == 2;
    std::vector<float> v(odd && scenario == "count" ? 999 : 1000, 1.0f);
    if (odd && scenario == "kind") group.broadcast(dpl::view(v), 0).wait();
    else group.all_reduce(dpl::view(v), odd && scenario == "avg" ? dpl::reduce_op::avg : dpl::reduce_op::sum).wait();
  }
}

/// Rank 1 stops (SIGSTOP: alive, never exits, never answers) before its 4th all_reduce.
void stopped_peer(dpl::process_group const& group) {
  for (int k = 0; k < 10; ++k) {
    if (group.rank() == 1 && k == 3) std::raise(SIGSTOP);
    std::vector<float> v(100, 1.0f);
    group.all_reduce(dpl::view(v)).wait();
  }
}

/// A failure inside a subgroup: parent ranks {1, 0} (group ranks 0 and 1; any further ranks form
/// another subgroup); parent rank 1 aborts its subgroup, whose members fail naming group rank 0
/// as parent rank 1.
void subgroup_failure(dpl::process_group const& group) {
  int const p = group.rank();
  auto const sub = group.split(p < 2 ? 0 : 1, -p);
  if (p == 1) sub.abort("injected failure on parent rank 1");
  std::vector<float> v(1000, 1.0f);
  sub.all_reduce(dpl::view(v)).wait();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: mpi_fault kill|throw|missing|early|avg|count|kind|subgroup|stop <timeout_ms>\n");
    return 2;
  }
  std::string const scenario = argv[1];
  auto const timeout = std::chrono::milliseconds(std::atoi(argv[2]));
  int rank = -1;
  try {
    auto const group = dpl::mpi::init_process_group(
        {.timeout = timeout}, {.probe_window = std::chrono::seconds(1),
                               .exit_grace = std::chrono::seconds(3),
                               .shared_memory = scenario == "stop"});
    rank = group.rank();
    if (scenario == "missing") missing_collective(group);
    else if (scenario == "early") early_end(timeout);
    else if (scenario == "subgroup") subgroup_failure(group);
    else if (scenario == "stop") stopped_peer(group);
    else if (scenario == "avg" || scenario == "count" || scenario == "kind") mismatched_collective(group, scenario);
    else ddp_training(group, scenario);
    std::printf("mpi_fault: rank %d: finished without error\n", rank);
    return 0;
  } catch (std::exception const& e) {
    if (auto const* c = find_comm_error(e)) {
      std::fprintf(stderr, "mpi_fault: rank %d: caught comm_error naming rank %d: %s\n", rank, c->rank(), c->what());
      if (dynamic_cast<dpl::timeout_error const*>(c) != nullptr)
        std::fprintf(stderr, "mpi_fault: rank %d: the error is a timeout_error\n", rank);
    } else {
      std::fprintf(stderr, "mpi_fault: rank %d: caught: %s\n", rank, e.what());
    }
    return 1;
  }
}

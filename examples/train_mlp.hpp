// train_mlp's shared declarations: the options (config), what a run starts from and reports, and
// the functions of its parts:
//   train_mlp.cpp          main: the process set-up, the run, the summary (text and JSON)
//   train_mlp_options.cpp  the command line (parse_command_line, print_usage, apply_world)
//   train_mlp_files.cpp    --init, --resume, --save, --save-checkpoint
//   train_mlp_loop.hpp     the data plan, batches, the optimizer step, evaluation and the training loop
//   train_mlp_modes.cpp    the modes: single, dp, ddp (threads, MPI), and --backend cuda
#pragma once

#include "fashion_mnist.hpp"
#include "mlp.hpp"

#include <dparallel/dparallel.hpp>
#include <dparallel/io/checkpoint.hpp>
#if DPARALLEL_EXAMPLE_CUDA
#include <dparallel/comm/process_group_init.hpp>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace example {

// ------------------------------------------------------------------------------------------------
// Options

struct config {
  std::string mode = "single";
  std::string backend = "auto";  // host, cuda, or auto (resolved by parse_command_line: cuda when a GPU is visible)
  std::string backend_reason;    // why --backend auto chose the backend it did (empty when given)
  int gpus = 0;                  // visible GPUs (counted when the backend may be cuda)
  std::string comm = "thread";   // ddp: thread ranks, MPI processes, or NCCL processes (--backend cuda)
  int devices = 0;  // 0 = the mode's default
  int epochs = 5;
  std::size_t global_batch = 128;
  double lr = 0.1;
  std::uint64_t seed = 1;
  int sampler_replicas = 0;  // 0 = the mode's default (single, dp: 1; ddp: --devices)
  // --block: samples per forward/backward pass of the host model (mlp::blocking::block); 0 until
  // parse_command_line / apply_world set it to the shard, global batch / max(devices, replicas).
  std::size_t block = 0;
  bool block_given = false;
  std::string part_sum = "pairwise";  // --part-sum: how single sums its parts (mlp::blocking)
  bool json = false;
  bool help = false;
  std::string data = fashion_mnist::default_dir;
  std::size_t train_samples = 0;  // 0 = the whole training set
  std::size_t workers = 0;        // --workers: loader threads making batches ahead (0: on the training thread)
  bool profile = false;           // --profile: print where the step time went at the end
  std::string comm_hook = "none";  // --comm-hook: ddp's communication hook (none, fp16, bf16, powersgd)
  std::size_t powersgd_rank = 2;   // --powersgd-rank: the rank of --comm-hook powersgd
  bool seed_given = false;
  // Stop after this many optimizer steps in total, counting those before --resume.
  std::uint64_t steps = std::numeric_limits<std::uint64_t>::max();
  std::string init;             // --init: a state dict to start from
  std::string resume;           // --resume: a checkpoint to continue from
  std::string save;             // --save: the trained model's state dict
  std::string save_checkpoint;  // --save-checkpoint: the training state at the end
  // The update after each step (train_mlp_loop.hpp's make_update). The defaults are plain SGD, the
  // same bits as before these options existed. --zero 1 picks the sharded form (ZeRO-1).
  std::string optimizer = "sgd";  // --optimizer: sgd, momentum (0.9), adam or adamw
  double weight_decay = -1;       // --weight-decay; -1: the optimizer's default (0; adamw: 0.01)
  double clip_grad_norm = 0;      // --clip-grad-norm: max total 2-norm of the gradients (0: no clipping)
  bool lr_given = false;          // --lr given (adam, adamw: default 1e-3 instead of 0.1)
  int zero = 0;                   // --zero 1: ddp_zero1 + zero_redundancy_optimizer (ZeRO stage 1)
  bool zero_gathered = false;     // --zero-save gathered: rank 0 writes the whole state (default: sharded)
  bool uneven = false;            // --uneven: rank r drops its last r batches of each epoch, then join()s
  bool bucket_view = false;       // --bucket-view: ddp's options::gradient_as_bucket_view
};

/// A bad command line: reported with exit code 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct training_data {
  fashion_mnist::dataset train, test;
};

/// Where training starts: the model (seeded, or read from --init or --resume) and the progress
/// (zero with --seed, or the checkpoint's). Read once per process, before any wrapper or rank
/// exists; every mode starts from a copy of `model`.
struct start_point {
  mlp model;
  dparallel::training_progress progress{};
  bool resumed = false;
};

/// Sum and L2 norm of all parameters, accumulated in double in parameters() order.
struct fingerprint {
  double sum = 0;
  double l2 = 0;
};

/// Optimizer steps after which result::early is taken.
constexpr std::size_t early_steps = 20;

/// What a run reports.
struct result {
  int devices = 1;
  double train_loss = 0;     // mean loss over the batches of the last epoch run (sample-weighted)
  double test_accuracy = 0;  // after the last epoch
  double samples_per_s = 0;  // training samples / training wall time, all epochs
  double train_seconds = 0;  // training wall time, all epochs, evaluation excluded
  double rate_spread = 0;    // how steady samples/s was over 20-step stretches (0.05: +-5%)
  fingerprint params;        // of the trained parameters
  // Of the parameters after the first `early_steps` optimizer steps (at the end if the run stopped
  // before them or resumed after them): equal to the bit between modes whose gradients are
  // (example_check compares them).
  std::size_t early_steps = 0;
  fingerprint early;
  std::uint64_t start_step = 0;  // optimizer steps done before this run (--resume)
  std::uint64_t steps = 0;       // optimizer steps done at the end, start_step included
  double data_wait_seconds = 0;  // time the training loop waited for its batches (the loader's)
};

// ------------------------------------------------------------------------------------------------
// Processes (set by main)

/// This process's rank under --comm mpi or nccl (-1: the ranks, if any, are threads).
inline int process_rank = -1;
#if DPARALLEL_EXAMPLE_MPI
/// The MPI process group of --comm mpi (set by main; under --comm nccl, NCCL's bootstrap). Only in
/// builds with MPI: without, nothing sets it and GCC rightly flags its use as a null dereference.
inline dparallel::process_group const* mpi_group = nullptr;
#endif
#if DPARALLEL_EXAMPLE_CUDA
/// The NCCL process group of --comm nccl (set by main).
inline dparallel::distributed_group const* nccl_group = nullptr;
#endif

// ------------------------------------------------------------------------------------------------
// Files (train_mlp_files.cpp)

start_point load_start(config const& cfg);
void check_outputs_writable(config const& cfg);
void check_resume(config const& cfg, start_point const& start, training_data const& data);
void save_outputs(config const& cfg, training_data const& data, dparallel::training_progress const& progress, mlp& m,
                  std::function<void(dparallel::checkpoint&)> const& add_optimizer_state = {});

// ------------------------------------------------------------------------------------------------
// Modes (train_mlp_modes.cpp)

result run_single(config const& cfg, training_data const& data, start_point const& start);
result run_dp(config const& cfg, training_data const& data, start_point const& start);
result run_ddp(config const& cfg, training_data const& data, start_point const& start);
#if DPARALLEL_EXAMPLE_CUDA
result run_cuda(config const& cfg, training_data const& data, start_point const& start);
#endif

struct mode {
  std::string_view name;
  result (*run)(config const&, training_data const&, start_point const&);
  std::string_view help;
};
inline constexpr std::array modes{
    mode{"single", &run_single, "one device runs every batch"},
    mode{"dp", &run_dp, "DataParallel over --devices logical devices (host threads, or GPUs / lanes of one GPU)"},
    mode{"ddp", &run_ddp,
         "DistributedDataParallel over --devices thread ranks, or MPI / NCCL processes (--comm mpi / nccl)"},
};

inline mode const* find_mode(std::string_view name) {
  for (auto const& m : modes)
    if (m.name == name) return &m;
  return nullptr;
}

// ------------------------------------------------------------------------------------------------
// Command line (train_mlp_options.cpp)

void print_usage(std::FILE* out);
config parse_command_line(int argc, char** argv);
#if DPARALLEL_EXAMPLE_MPI || DPARALLEL_EXAMPLE_NCCL
void apply_world(config& cfg, int world);
#endif
/// The shard: samples per device or rank of a full global batch, ceil(B / max(devices, replicas)).
std::size_t shard_size(config const& cfg);
/// The model's blocking for the run: single cuts each batch into --sampler-replicas parts (the
/// shards of the devices or ranks it reproduces); a device or rank computes its shard as one part.
mlp::blocking model_blocking(config const& cfg);

}  // namespace example

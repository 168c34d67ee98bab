// train_mlp's command line: the options, their checks, --help, and --backend auto.
#include "train_mlp.hpp"
#if DPARALLEL_EXAMPLE_CUDA
#include "train_mlp_cuda.hpp"
#endif

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <system_error>
#include <thread>

namespace example {

// ------------------------------------------------------------------------------------------------
// Command line

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: train_mlp [options]\n"
               "Trains the 784-512-ReLU-10 MLP on Fashion-MNIST with SGD and reports test accuracy and throughput.\n"
               "\n"
               "  --mode M       ");
  for (std::size_t i = 0; i < modes.size(); ++i)
    std::fprintf(out, "%s%.*s", i == 0 ? "" : "|", static_cast<int>(modes[i].name.size()), modes[i].name.data());
  std::fprintf(out, " (default: single)\n");
  for (auto const& m : modes)
    std::fprintf(out, "                   %.*s: %.*s\n", static_cast<int>(m.name.size()), m.name.data(),
                 static_cast<int>(m.help.size()), m.help.data());
  std::fprintf(out,
               "  --backend K    host, cuda or auto (default: auto: cuda when a GPU is visible, else host;\n"
               "                 it prints which). cuda %s\n"
               "  --devices N    dp: logical devices, ddp: thread ranks (default: the hardware threads, %u\n"
               "                 here, one core each; cuda: the GPUs; dp on fewer GPUs puts lanes on GPU 0,\n"
               "                 ddp on cuda needs N GPUs); single: 1; ddp --comm mpi|nccl: the processes\n"
               "  --comm C       ddp only: thread (ranks are threads, default), mpi (ranks are MPI processes:\n"
               "                 mpirun -np N train_mlp --mode ddp --comm mpi) or nccl (ranks are processes,\n"
               "                 one GPU each, under mpirun or torchrun-style MASTER_ADDR/MASTER_PORT)\n"
               "                 mpi: %s; nccl: %s\n"
               "  --comm-hook H  ddp on the host only: none (default), fp16 or bf16 (gradients averaged as\n"
               "                 16-bit values: fp16_compress / bf16_compress) or powersgd (rank-R\n"
               "                 approximations after 10 plain steps, error feedback, warm start; see\n"
               "                 docs/comm-hooks.md)\n"
               "  --powersgd-rank R  the rank of --comm-hook powersgd (default: 2)\n"
               "  --uneven       ddp only: rank r drops the last r batches of every epoch, so the ranks run\n"
               "                 different numbers of steps; each calls join() when its epoch's data ran out\n"
               "                 and gradients are averaged by samples (docs/join.md); the train_loss printed\n"
               "                 is rank 0's own\n"
               "  --bucket-view  ddp on the host only: DDP all-reduces the model's gradient buffer in place\n"
               "                 (options::gradient_as_bucket_view: no copies into bucket storage and back;\n"
               "                 the same bits; docs/policies.md); with --comm mpi on one node the gradients\n"
               "                 live in the group's memory and every process's are reduced in place\n"
               "  --epochs E     passes over the 60000 training images (default: 5)\n"
               "  --batch B      global batch size, split across the devices in dp (default: 128)\n"
               "  --lr LR        learning rate (default: 0.1; adam, adamw: 0.001)\n"
               "  --optimizer O  sgd (default), momentum (SGD with momentum 0.9), adam or adamw: PyTorch's update\n"
               "                 rules (dparallel::optim); on every mode, host backend only\n"
               "  --weight-decay X  weight decay (default: 0; adamw: 0.01): L2 for sgd, momentum and adam,\n"
               "                 decoupled for adamw\n"
               "  --clip-grad-norm X  before each update, scale the gradients to a total 2-norm of at most X\n"
               "                 (dparallel::optim::clip_grad_norm; default: no clipping)\n"
               "  --zero Z       ddp only: 1 shards the optimizer state over the ranks (ZeRO stage 1:\n"
               "                 dparallel::ddp_zero1 and zero_redundancy_optimizer; the same parameters as\n"
               "                 without it); 0: every rank holds the whole state (default). With\n"
               "                 --save-checkpoint C the optimizer state goes beside C (C's name + .optim,\n"
               "                 see --zero-save); --resume C reads it on any number of ranks\n"
               "  --zero-save M  sharded: every rank writes its shard (default); gathered: rank 0 writes\n"
               "                 the whole state in one file, as optim::save_state names it\n"
               "  --seed S       seeds the initialisation and the per-epoch shuffles (default: 1; --init\n"
               "                 replaces the initialisation, --resume brings the checkpoint's seed)\n"
               "  --sampler-replicas R  order the samples as DDP with R ranks reads them: global batch j is\n"
               "                 the concatenation of the R ranks' batch j (default: 1; ddp: --devices)\n"
               "  --block N      host model: samples per forward/backward pass (default: the shard, --batch /\n"
               "                 max(devices, sampler replicas): one pass per device or rank, the largest\n"
               "                 GEMMs); must divide the shard. single cuts each batch into --sampler-replicas\n"
               "                 parts and computes each as a device would, so single, dp and ddp with the\n"
               "                 same --block and --sampler-replicas (2 or 4) train the same model bit for bit\n"
               "  --part-sum S   single: how the parts' gradients are summed: pairwise (default; dp's\n"
               "                 reduction) or in-order (ddp's all-reduce over thread ranks); the same for up\n"
               "                 to 3 parts\n"
               "  --data DIR     folder of the gzip'ed IDX files (default: %s)\n"
               "  --train-samples N  train on the first N training images only (quick runs; default: all)\n"
               "  --steps K      stop after K optimizer steps in total, counting those before --resume\n"
               "                 (default: no limit; --epochs still ends the run)\n"
               "  --workers N    N loader threads make each rank's batches ahead of training (default: 0,\n"
               "                 made on the training thread; dp: each device copies its shard's rows);\n"
               "                 the batches, hence the results, are the same\n"
               "  --profile      at the end, print where the mean step's time went (scatter, replicate,\n"
               "                 compute, reduce, gather, data wait; ddp: rank 0's); single: the data wait\n"
               "Files (safetensors; every process reads --init and --resume, rank 0 alone writes):\n"
               "  --init FILE    start from the model in FILE (a state dict as --save writes it) instead of\n"
               "                 the seeded initialisation; every name and shape must match\n"
               "  --save FILE    at the end, save the trained model to FILE as a state dict (tensors w1, b1,\n"
               "                 w2, b2; dp: the master model, ddp: rank 0's replica)\n"
               "  --save-checkpoint FILE  at the end (after the last epoch or at --steps), save the training\n"
               "                 state to FILE: model, epoch, step, sampler position, seed\n"
               "  --resume FILE  continue the run a --save-checkpoint FILE stopped, in any mode: its model,\n"
               "                 seed and position; --batch, --sampler-replicas and --train-samples must be\n"
               "                 those it was written with, --epochs and --steps count from the run's start\n"
               "Output and help:\n"
               "  --json         end with one line holding a JSON object of the results\n"
               "  --help         this text\n",
#if DPARALLEL_EXAMPLE_CUDA
               "is available in this build",
#else
               "is not available: this build found no CUDA",
#endif
               std::max(1u, std::thread::hardware_concurrency()),
#if DPARALLEL_EXAMPLE_MPI
               "available in this build",
#else
               "not available: this build found no MPI",
#endif
#if DPARALLEL_EXAMPLE_NCCL
               "available in this build",
#else
               "not available: this build found no NCCL",
#endif
               fashion_mnist::default_dir);
}

template <class Int>
Int parse_int(std::string_view option, std::string_view text, Int min, Int max) {
  Int v{};
  auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range ||
      (ec == std::errc{} && end == text.data() + text.size() && (v < min || v > max)))
    throw usage_error(std::string(option) + ": expected an integer from " + std::to_string(min) + " to " +
                      std::to_string(max) + ", found '" + std::string(text) + "'");
  if (ec != std::errc{} || end != text.data() + text.size())
    throw usage_error(std::string(option) + ": expected an integer, found '" + std::string(text) + "'");
  return v;
}

/// A finite number > 0 (or >= 0 with `zero_ok`) from `text`, else a usage error naming `option`.
double parse_number(std::string_view option, std::string_view text, bool zero_ok) {
  std::string const s(text);
  char* end = nullptr;
  double const v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || !(zero_ok ? v >= 0 : v > 0))
    throw usage_error(std::string(option) + (zero_ok ? ": expected a number >= 0, found '" : ": expected a positive number, found '") + s + "'");
  return v;
}
double parse_positive(std::string_view option, std::string_view text) { return parse_number(option, text, false); }
double parse_non_negative(std::string_view option, std::string_view text) { return parse_number(option, text, true); }

/// Resolves --backend auto: CUDA when this build has it and a GPU is visible (and the ranks are not
/// MPI processes, whose engine reduces host memory), else the host. Returns why auto chose what it
/// chose (empty for an explicit --backend); sets cfg.gpus. Throws std::runtime_error (exit status
/// 1, not a usage error: the command is right, the machine lacks a GPU) for --backend cuda or
/// --comm nccl without a GPU.
std::string resolve_backend(config& cfg) {
  std::string why;
#if DPARALLEL_EXAMPLE_CUDA
  if (cfg.backend == "host") return why;
  cfg.gpus = train_mlp_cuda::device_count();
  std::string const none = cfg.gpus == 0 ? train_mlp_cuda::no_device_reason() : std::string();
  if (cfg.backend == "auto") {
    if (cfg.comm == "mpi") {
      cfg.backend = "host";
      why = "--comm mpi reduces host memory";
    } else if (cfg.gpus > 0) {
      cfg.backend = "cuda";
      why = std::to_string(cfg.gpus) + (cfg.gpus == 1 ? " GPU is" : " GPUs are") + " visible";
    } else {
      cfg.backend = "host";
      why = "no CUDA device: " + none;
    }
  }
  if (cfg.comm == "nccl" && cfg.gpus == 0)
    throw std::runtime_error("--comm nccl: NCCL runs on GPUs, and there is none (" + none +
                             "); on the host use --comm thread or mpi");
  if (cfg.backend == "cuda" && cfg.gpus == 0)
    throw std::runtime_error("--backend cuda: no CUDA device to run on (" + none +
                             "); use --backend host, or --backend auto (the host when there is no GPU)");
#else
  if (cfg.backend == "auto") {
    cfg.backend = "host";
    why = "this build of train_mlp has no CUDA";
  }
#endif
  return why;
}

/// --block: the shard when not given, else checked to divide it (every pass then has the same
/// size: the shard is whole blocks). Once devices and sampler replicas are known.
void set_block(config& cfg) {
  std::size_t const shard = shard_size(cfg);
  if (!cfg.block_given) {
    cfg.block = shard;
    return;
  }
  if (shard % cfg.block != 0)
    throw usage_error("--block " + std::to_string(cfg.block) + ": expected a divisor of the shard, " +
                      std::to_string(shard) + " samples (--batch " + std::to_string(cfg.global_batch) + " over max(" +
                      std::to_string(cfg.devices) + " devices, " + std::to_string(cfg.sampler_replicas) +
                      " sampler replicas)), so that every pass is a whole block; leave --block out for one pass "
                      "per shard");
}

config parse_command_line(int argc, char** argv) {
  config cfg;
  bool devices_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    std::string_view value;
    bool has_value = false;
    if (auto const eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto flag = [&] {
      if (has_value) throw usage_error(std::string(arg) + " takes no value");
    };
    auto next = [&]() -> std::string_view {
      if (has_value) return value;
      if (i + 1 >= argc) throw usage_error(std::string(arg) + ": expected a value after it");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      flag();
      cfg.help = true;
    } else if (arg == "--json") {
      flag();
      cfg.json = true;
    } else if (arg == "--mode") {
      cfg.mode = std::string(next());
      if (find_mode(cfg.mode) == nullptr) {
        std::string known;
        for (auto const& m : modes) known += (known.empty() ? "" : ", ") + std::string(m.name);
        throw usage_error("--mode: expected one of " + known + ", found '" + cfg.mode + "'");
      }
    } else if (arg == "--devices") {
      cfg.devices = parse_int<int>(arg, next(), 1, 1024);
      devices_given = true;
    } else if (arg == "--epochs") {
      cfg.epochs = parse_int<int>(arg, next(), 1, 100000);
    } else if (arg == "--batch") {
      cfg.global_batch = parse_int<std::size_t>(arg, next(), 1, 60000);
    } else if (arg == "--lr") {
      cfg.lr = parse_positive(arg, next());
      cfg.lr_given = true;
    } else if (arg == "--optimizer") {
      cfg.optimizer = std::string(next());
      if (cfg.optimizer != "sgd" && cfg.optimizer != "momentum" && cfg.optimizer != "adam" && cfg.optimizer != "adamw")
        throw usage_error("--optimizer: expected sgd, momentum, adam or adamw, found '" + cfg.optimizer + "'");
    } else if (arg == "--weight-decay") {
      cfg.weight_decay = parse_non_negative(arg, next());
    } else if (arg == "--zero") {
      cfg.zero = parse_int<int>(arg, next(), 0, 1);
    } else if (arg == "--zero-save") {
      std::string const m(next());
      if (m != "sharded" && m != "gathered")
        throw usage_error("--zero-save: expected sharded or gathered, found '" + m + "'");
      cfg.zero_gathered = m == "gathered";
    } else if (arg == "--clip-grad-norm") {
      cfg.clip_grad_norm = parse_positive(arg, next());
    } else if (arg == "--seed") {
      cfg.seed = parse_int<std::uint64_t>(arg, next(), 0, UINT64_MAX);
      cfg.seed_given = true;
    } else if (arg == "--sampler-replicas") {
      cfg.sampler_replicas = parse_int<int>(arg, next(), 1, 1024);
    } else if (arg == "--block") {
      cfg.block = parse_int<std::size_t>(arg, next(), 1, 60000);
      cfg.block_given = true;
    } else if (arg == "--part-sum") {
      cfg.part_sum = std::string(next());
      if (cfg.part_sum != "pairwise" && cfg.part_sum != "in-order")
        throw usage_error("--part-sum: expected pairwise or in-order, found '" + cfg.part_sum + "'");
    } else if (arg == "--backend") {
      cfg.backend = std::string(next());
      if (cfg.backend != "host" && cfg.backend != "cuda" && cfg.backend != "auto")
        throw usage_error("--backend: expected host, cuda or auto, found '" + cfg.backend + "'");
#if !DPARALLEL_EXAMPLE_CUDA
      if (cfg.backend == "cuda")
        throw usage_error("--backend cuda: this build of train_mlp has no CUDA (CMake found no CUDA toolkit; install "
                          "it, e.g. under /usr/local/cuda, then reconfigure)");
#endif
    } else if (arg == "--comm") {
      cfg.comm = std::string(next());
      if (cfg.comm != "thread" && cfg.comm != "mpi" && cfg.comm != "nccl")
        throw usage_error("--comm: expected thread, mpi or nccl, found '" + cfg.comm + "'");
#if !DPARALLEL_EXAMPLE_MPI
      if (cfg.comm == "mpi")
        throw usage_error("--comm mpi: this build of train_mlp has no MPI (CMake found none; Debian: apt-get install "
                          "libopenmpi-dev openmpi-bin, then reconfigure)");
#endif
#if !DPARALLEL_EXAMPLE_NCCL
      if (cfg.comm == "nccl")
        throw usage_error("--comm nccl: this build of train_mlp has no NCCL (CMake found no CUDA toolkit or no NCCL; "
                          "set NCCL_ROOT, then reconfigure)");
#endif
    } else if (arg == "--comm-hook") {
      cfg.comm_hook = std::string(next());
      if (cfg.comm_hook != "none" && cfg.comm_hook != "fp16" && cfg.comm_hook != "bf16" && cfg.comm_hook != "powersgd")
        throw usage_error("--comm-hook: expected none, fp16, bf16 or powersgd, found '" + cfg.comm_hook + "'");
    } else if (arg == "--powersgd-rank") {
      cfg.powersgd_rank = parse_int<std::size_t>(arg, next(), 1, 1u << 20);
    } else if (arg == "--data") {
      cfg.data = std::string(next());
      if (cfg.data.empty()) throw usage_error("--data: expected a folder, found an empty string");
    } else if (arg == "--train-samples") {
      cfg.train_samples = parse_int<std::size_t>(arg, next(), 1, std::numeric_limits<std::uint32_t>::max());
    } else if (arg == "--workers") {
      cfg.workers = parse_int<std::size_t>(arg, next(), 0, 256);
    } else if (arg == "--uneven") {
      flag();
      cfg.uneven = true;
    } else if (arg == "--bucket-view") {
      flag();
      cfg.bucket_view = true;
    } else if (arg == "--profile") {
      flag();
      cfg.profile = true;
    } else if (arg == "--steps") {
      cfg.steps = parse_int<std::uint64_t>(arg, next(), 0, std::numeric_limits<std::uint64_t>::max() - 1);
    } else if (arg == "--init" || arg == "--resume" || arg == "--save" || arg == "--save-checkpoint") {
      std::string& file = arg == "--init" ? cfg.init
                          : arg == "--resume" ? cfg.resume
                          : arg == "--save"   ? cfg.save
                                              : cfg.save_checkpoint;
      file = std::string(next());
      if (file.empty()) throw usage_error(std::string(arg) + ": expected a file name, found an empty string");
    } else {
      throw usage_error("unknown option '" + std::string(argv[i]) + "'");
    }
  }
  if (!cfg.init.empty() && !cfg.resume.empty())
    throw usage_error("--init " + cfg.init + " --resume " + cfg.resume +
                      ": a checkpoint holds the model already; pass one of them");
  if (!cfg.save.empty() && cfg.save == cfg.save_checkpoint)
    throw usage_error("--save and --save-checkpoint: expected two files, found " + cfg.save + " twice");
  if (!cfg.lr_given && (cfg.optimizer == "adam" || cfg.optimizer == "adamw")) cfg.lr = 1e-3;
  if (cfg.zero != 0 && (cfg.mode != "ddp" || cfg.backend == "cuda" || cfg.comm == "nccl"))
    throw usage_error("--zero 1: ZeRO-1 shards DDP's optimizer state over host ranks; expected --mode ddp on the "
                      "host backend (--comm thread or mpi), found --mode " + cfg.mode + " --backend " + cfg.backend +
                      " --comm " + cfg.comm);
  if (cfg.zero != 0 && cfg.comm_hook != "none")
    throw usage_error("--zero 1 with --comm-hook " + cfg.comm_hook +
                      ": a communication hook reduces whole buckets, ZeRO-1 reduce-scatters them; choose one");
  if (cfg.comm == "mpi" && cfg.mode != "ddp")
    throw usage_error("--comm mpi: only --mode ddp runs over MPI processes, found --mode " + cfg.mode);
  if (cfg.comm == "nccl" && cfg.mode != "ddp")
    throw usage_error("--comm nccl: only --mode ddp runs over NCCL processes, found --mode " + cfg.mode);
  if (cfg.comm == "mpi" && cfg.backend == "cuda")
    throw usage_error("--comm mpi --backend cuda: the MPI engine reduces host memory; on GPUs use --comm nccl "
                      "(under mpirun, MPI carries NCCL's unique id)");
  if (cfg.comm == "nccl" && cfg.backend == "host")
    throw usage_error("--comm nccl --backend host: NCCL reduces GPU memory; on the host use --comm thread or mpi");
  if (cfg.comm_hook != "none" && cfg.mode != "ddp")
    throw usage_error("--comm-hook " + cfg.comm_hook + ": only --mode ddp has communication hooks, found --mode " +
                      cfg.mode);
  if (cfg.bucket_view && (cfg.mode != "ddp" || cfg.zero != 0))
    throw usage_error("--bucket-view: DDP's buckets as views of the gradients; expected --mode ddp without --zero "
                      "(ZeRO-1 reduce-scatters into shards of its own), found --mode " + cfg.mode +
                      (cfg.zero != 0 ? " --zero " + std::to_string(cfg.zero) : std::string()));
  if (cfg.uneven && cfg.mode != "ddp")
    throw usage_error("--uneven: only --mode ddp has ranks that can run out of data, found --mode " + cfg.mode);
  if (cfg.uneven && (cfg.zero != 0 || cfg.steps != std::numeric_limits<std::uint64_t>::max() || !cfg.resume.empty() ||
                     !cfg.save_checkpoint.empty()))
    throw usage_error("--uneven with --zero, --steps, --resume or --save-checkpoint: the ranks' step counts differ "
                      "under --uneven, so a step limit or a checkpoint position would differ too, and ZeRO-1's "
                      "reduce-scatter has no join; leave them out");
  if (cfg.uneven && cfg.optimizer != "sgd")
    throw usage_error("--uneven --optimizer " + cfg.optimizer + ": a rank that has joined runs no update, so its "
                      "optimizer state would fall behind; use --optimizer sgd (stateless)");
  if (!cfg.help) cfg.backend_reason = resolve_backend(cfg);  // throws std::runtime_error (exit 1) without a GPU
  if (cfg.backend == "cuda" && (cfg.optimizer != "sgd" || cfg.weight_decay > 0 || cfg.clip_grad_norm > 0))
    throw usage_error("--optimizer, --weight-decay and --clip-grad-norm: this example runs them on the host "
                      "backend only; add --backend host");
  if (cfg.bucket_view && cfg.backend == "cuda")
    throw usage_error("--bucket-view: the GPU model keeps its gradients apart; add --backend host");
  if (cfg.uneven && cfg.backend == "cuda")
    throw usage_error("--uneven: this example joins ranks on the host backend (--comm thread or mpi); add --backend host");
  if (cfg.comm_hook != "none" && cfg.backend == "cuda")
    throw usage_error("--comm-hook " + cfg.comm_hook + ": the built-in hooks convert on the host; use --backend host");
  if (cfg.block_given && cfg.backend == "cuda")
    throw usage_error("--block " + std::to_string(cfg.block) +
                      ": the GPU model computes each shard in one pass; --block applies to the host backend");
  if (cfg.part_sum != "pairwise" && cfg.mode != "single")
    throw usage_error("--part-sum " + cfg.part_sum + ": only --mode single sums parts of a batch (a device or rank "
                      "computes its shard as one part), found --mode " + cfg.mode);
  // The world size, hence devices and sampler replicas, come from the launch: see main.
  if (cfg.comm == "mpi" || cfg.comm == "nccl") return cfg;
  if (cfg.mode == "single") {
    if (devices_given && cfg.devices != 1)
      throw usage_error("--devices " + std::to_string(cfg.devices) +
                        ": --mode single runs on one device; use --mode dp for several");
    cfg.devices = 1;
  } else if (!devices_given) {
    cfg.devices = cfg.backend == "cuda" ? std::max(1, cfg.gpus)
                                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  if (cfg.mode == "ddp") {
    if (cfg.sampler_replicas != 0 && cfg.sampler_replicas != cfg.devices)
      throw usage_error("--sampler-replicas " + std::to_string(cfg.sampler_replicas) +
                        ": --mode ddp reads the data as its " + std::to_string(cfg.devices) + " ranks do");
    cfg.sampler_replicas = cfg.devices;
  } else if (cfg.sampler_replicas == 0) {
    cfg.sampler_replicas = 1;
  }
  if (cfg.global_batch % static_cast<std::size_t>(cfg.sampler_replicas) != 0)
    throw usage_error("--batch " + std::to_string(cfg.global_batch) + ": expected a multiple of the " +
                      std::to_string(cfg.sampler_replicas) + " sampler replicas (ranks), which share it equally");
  set_block(cfg);
  return cfg;
}

std::size_t shard_size(config const& cfg) {
  auto const n = static_cast<std::size_t>(std::max(cfg.devices, cfg.sampler_replicas));
  return (cfg.global_batch + n - 1) / n;
}

mlp::blocking model_blocking(config const& cfg) {
  return {.parts = cfg.mode == "single" ? static_cast<std::size_t>(cfg.sampler_replicas) : std::size_t{1},
          .block = cfg.block,
          .parts_in_order = cfg.part_sum == "in-order"};
}

#if DPARALLEL_EXAMPLE_MPI || DPARALLEL_EXAMPLE_NCCL
/// --comm mpi or nccl: the ranks are the processes of the launch. Checks --devices and
/// --sampler-replicas against the world size and the batch's divisibility, as parse_command_line
/// does for thread ranks.
void apply_world(config& cfg, int world) {
  if (cfg.devices != 0 && cfg.devices != world)
    throw usage_error("--devices " + std::to_string(cfg.devices) + ": under --comm " + cfg.comm +
                      " the ranks are the " + std::to_string(world) +
                      " processes of the launch (mpirun -np, torchrun --nproc-per-node); leave --devices out");
  if (cfg.sampler_replicas != 0 && cfg.sampler_replicas != world)
    throw usage_error("--sampler-replicas " + std::to_string(cfg.sampler_replicas) +
                      ": --mode ddp reads the data as its " + std::to_string(world) + " ranks do");
  cfg.devices = world;
  cfg.sampler_replicas = world;
  if (cfg.global_batch % static_cast<std::size_t>(world) != 0)
    throw usage_error("--batch " + std::to_string(cfg.global_batch) + ": expected a multiple of the " +
                      std::to_string(world) + " sampler replicas (ranks), which share it equally");
  set_block(cfg);
}
#endif

}  // namespace example

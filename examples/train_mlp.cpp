// train_mlp: trains the 784-512-ReLU-10 MLP on Fashion-MNIST, on one device (--mode single) or
// with DataParallel over host logical devices (--mode dp --devices N), and reports the test
// accuracy, the throughput and a fingerprint of the trained parameters.
//
// Every mode shares the data, the batch order, the batch gathering, the optimizer and the
// evaluation; a mode only says how one global batch becomes a loss and the gradient of the mean
// loss on the master model (see `modes` below). With the same seed, the modes visit the same
// batches in the same order. The model sums per-block gradients with the same pairwise tree as
// dparallel's reductions (see mlp::forward_backward), so with global batch 128 on 2 or 4 devices
// every full batch gives bitwise the one-device gradient, and the runs differ only through the
// epoch's last, partial batch (result::early, taken after 20 steps, is bitwise equal).
//
// --mode ddp --comm mpi runs the ranks as MPI processes instead of threads (built when MPI was
// found): `mpirun -np 2 train_mlp --mode ddp --comm mpi ...`. Rank 0 alone prints; the MPI
// communicator reduces in rank order, so the result is bitwise that of --comm thread.
//
// Files (dparallel/io): --save writes the trained model as a safetensors state dict, --init starts
// from one instead of the seeded initialisation, --save-checkpoint writes the whole training state
// (model, epoch, step, sampler position, seed; the optimizer's state for momentum, adam, adamw) and --resume
// continues from one: a run stopped after k steps (--steps) and resumed gives bitwise the
// parameters of a run that never stopped. Every rank reads --init and --resume; rank 0 alone
// writes (the master model in dp, rank 0's replica in ddp: all replicas are equal).
//
// --backend cuda (built when CMake found CUDA) trains the same model on GPUs: mlp_cuda.cuh, driven
// through train_mlp_cuda.hpp by the same loop, so the batches, the order and the files are those of
// the host backend; --backend auto (the default) takes CUDA when a GPU is visible, else the host.
// ddp on CUDA runs over NCCL: thread ranks need one GPU each; --comm nccl makes the ranks the
// processes of an mpirun or torchrun-style launch.

//
// The program's parts: train_mlp.hpp lists them.

#include "blas_info.hpp"
#include "train_mlp.hpp"
#if DPARALLEL_EXAMPLE_CUDA
#include "train_mlp_cuda.hpp"
#endif
#if DPARALLEL_EXAMPLE_MPI
#include <dparallel/comm/mpi.hpp>
#endif

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <optional>
#include <system_error>

namespace {

using namespace example;

// ------------------------------------------------------------------------------------------------
// Output

/// The shortest text that reads back as `v` (JSON null when not finite).
std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  char s[64];
  auto const [end, ec] = std::to_chars(s, s + sizeof s, v);
  return ec == std::errc{} ? std::string(s, end) : "null";
}
/// `v` with 17 significant digits (JSON null when not finite).
std::string exact(double v) {
  if (!std::isfinite(v)) return "null";
  char s[64];
  std::snprintf(s, sizeof s, "%.17g", v);
  return s;
}

std::string to_json(config const& cfg, result const& r, training_data const& data, blas_info::report const& blas) {
  return "{\"mode\":\"" + cfg.mode + "\",\"backend\":\"" + cfg.backend + "\"" +
         (cfg.mode == "ddp" ? ",\"comm\":\"" + cfg.comm + "\"" : std::string()) +
         (cfg.zero != 0 ? ",\"zero\":" + std::to_string(cfg.zero) : std::string()) +
         (cfg.uneven ? std::string(",\"uneven\":true") : std::string()) +
         (cfg.bucket_view ? std::string(",\"bucket_view\":true") : std::string()) +
         ",\"devices\":" + std::to_string(r.devices) +
         ",\"epochs\":" + std::to_string(cfg.epochs) + ",\"global_batch\":" + std::to_string(cfg.global_batch) +
         ",\"lr\":" + number(cfg.lr) + ",\"seed\":" + std::to_string(cfg.seed) +
         ",\"sampler_replicas\":" + std::to_string(cfg.sampler_replicas) +
         (cfg.backend == "cuda" ? std::string() : ",\"block\":" + std::to_string(cfg.block)) +
         ",\"train_samples\":" + std::to_string(data.train.size()) +
         ",\"test_samples\":" + std::to_string(data.test.size()) + ",\"test_accuracy\":" + number(r.test_accuracy) +
         ",\"train_loss\":" + number(r.train_loss) + ",\"samples_per_s\":" + number(r.samples_per_s) +
         ",\"train_seconds\":" + number(r.train_seconds) + ",\"rate_spread\":" + number(r.rate_spread) + ",\"param_sum\":" + exact(r.params.sum) +
         ",\"param_l2\":" + exact(r.params.l2) + ",\"early_steps\":" + std::to_string(r.early_steps) +
         ",\"early_param_sum\":" + exact(r.early.sum) + ",\"early_param_l2\":" + exact(r.early.l2) +
         ",\"start_step\":" + std::to_string(r.start_step) + ",\"steps\":" + std::to_string(r.steps) + "," + blas_info::json_fields(blas) + "}";
}

}  // namespace

int main(int argc, char** argv) {
  config cfg;
  try {
    cfg = parse_command_line(argc, argv);
  } catch (usage_error const& e) {
    std::fprintf(stderr, "train_mlp: %s\nRun train_mlp --help for the options.\n", e.what());
    return 2;
  } catch (std::exception const& e) {  // a right command on a machine that cannot run it (no GPU)
    std::fprintf(stderr, "train_mlp: error: %s\n", e.what());
    return 1;
  }
  if (cfg.help) {
    print_usage(stdout);
    return 0;
  }

  // One device is one core: OpenBLAS must not start threads of its own under dparallel's.
  openblas_set_num_threads(1);
  blas_info::report const blas = blas_info::detect();

#if DPARALLEL_EXAMPLE_MPI
  // --comm mpi: this process is one rank of the MPI job; the world size is the number of ranks.
  // --comm nccl under mpirun (no MASTER_ADDR): the MPI group carries NCCL's unique id.
  std::optional<dparallel::distributed_group> world;
  if (cfg.comm == "mpi" || (cfg.comm == "nccl" && std::getenv("MASTER_ADDR") == nullptr)) {
    try {
      world = dparallel::mpi::init_process_group();
      mpi_group = &*world;
      process_rank = world->rank();
      if (cfg.comm == "mpi") apply_world(cfg, world->size());
    } catch (usage_error const& e) {
      if (process_rank <= 0) std::fprintf(stderr, "train_mlp: %s\nRun train_mlp --help for the options.\n", e.what());
      return 2;
    } catch (std::exception const& e) {
      std::fprintf(stderr, "train_mlp: error: %s\n", e.what());
      return 1;
    }
  }
#endif
#if DPARALLEL_EXAMPLE_NCCL
  // --comm nccl: this process is one rank of an NCCL group over the launch's processes (rank 0's
  // unique id through MPI as above, else through the TCP rendezvous at MASTER_ADDR:MASTER_PORT).
  std::optional<dparallel::distributed_group> nccl_world;
  if (cfg.comm == "nccl") {
    try {
#if DPARALLEL_EXAMPLE_MPI
      dparallel::process_group const bootstrap = world ? dparallel::process_group(*world) : dparallel::process_group{};
#else
      dparallel::process_group const bootstrap;  // none: the TCP rendezvous (env://)
#endif
      nccl_world = train_mlp_cuda::init_nccl_process_group(bootstrap);
      nccl_group = &*nccl_world;
      process_rank = nccl_world->rank();
      apply_world(cfg, nccl_world->size());
    } catch (usage_error const& e) {
      if (process_rank <= 0) std::fprintf(stderr, "train_mlp: %s\nRun train_mlp --help for the options.\n", e.what());
      return 2;
    } catch (std::exception const& e) {
      std::fprintf(stderr, "train_mlp: error: %s\n", e.what());
      return 1;
    }
  }
#endif
  bool const prints = process_rank <= 0;  // with process ranks, rank 0 alone reports
  std::string const who = process_rank < 0 ? std::string() : "rank " + std::to_string(process_rank) + ": ";

  try {
    check_outputs_writable(cfg);
    start_point const start = load_start(cfg);  // before the data: a bad file fails fast
    cfg.seed = start.progress.seed;              // --resume: the checkpoint's
    training_data const data{
        fashion_mnist::load(cfg.data, "train",
                            cfg.train_samples == 0 ? std::numeric_limits<std::size_t>::max() : cfg.train_samples),
        fashion_mnist::load(cfg.data, "t10k")};
    if (cfg.train_samples > data.train.size())
      throw usage_error("--train-samples " + std::to_string(cfg.train_samples) + ": expected at most the " +
                        std::to_string(data.train.size()) + " images of the training set");
    check_resume(cfg, start, data);
    if (prints) {
      if (auto const w = blas_info::warning(blas); !w.empty()) std::fprintf(stderr, "train_mlp: %s\n", w.c_str());
      if (!cfg.backend_reason.empty())
        std::printf("train_mlp: backend auto chose %s (%s)\n", cfg.backend.c_str(), cfg.backend_reason.c_str());
      if (process_rank < 0)
        std::printf("train_mlp: mode %s on %d %s device%s, %zu training / %zu test images from %s\n",
                    cfg.mode.c_str(), cfg.devices, cfg.backend.c_str(), cfg.devices == 1 ? "" : "s",
                    data.train.size(), data.test.size(), cfg.data.c_str());
      else
        std::printf("train_mlp: mode %s over %d %s processes, %zu training / %zu test images from %s\n",
                    cfg.mode.c_str(), cfg.devices, cfg.comm == "nccl" ? "NCCL" : "MPI", data.train.size(),
                    data.test.size(), cfg.data.c_str());
      std::printf("train_mlp: %d epoch%s, global batch %zu, lr %s, seed %llu\n", cfg.epochs,
                  cfg.epochs == 1 ? "" : "s", cfg.global_batch, number(cfg.lr).c_str(),
                  static_cast<unsigned long long>(cfg.seed));
      if (cfg.backend != "cuda") {
        mlp::blocking const split = model_blocking(cfg);
        std::printf("train_mlp: passes of %zu samples (--block), %zu part%s per batch%s\n", cfg.block, split.parts,
                    split.parts == 1 ? "" : "s",
                    split.parts > 3 ? (split.parts_in_order ? ", summed in order" : ", summed pairwise") : "");
      }
      if (!cfg.init.empty()) std::printf("train_mlp: starting from the model in %s\n", cfg.init.c_str());
      if (start.resumed)
        std::printf("train_mlp: resuming %s at epoch %llu, step %llu\n", cfg.resume.c_str(),
                    static_cast<unsigned long long>(start.progress.epoch),
                    static_cast<unsigned long long>(start.progress.step));
      std::fflush(stdout);
    }

#if DPARALLEL_EXAMPLE_CUDA
    result const r = cfg.backend == "cuda" ? run_cuda(cfg, data, start) : find_mode(cfg.mode)->run(cfg, data, start);
#else
    result const r = find_mode(cfg.mode)->run(cfg, data, start);
#endif

    if (prints) {
      std::printf("train_mlp: test_accuracy %.4f  train_loss %.4f  samples/s %.0f  param_sum %s  param_l2 %s\n",
                  r.test_accuracy, r.train_loss, r.samples_per_s, exact(r.params.sum).c_str(),
                  exact(r.params.l2).c_str());
      if (cfg.uneven)
        std::printf("train_mlp: uneven inputs: rank r skipped the last r batches of each epoch (rank %d: %d "
                    "fewer steps per epoch); every rank join()ed at each epoch's end and the run completed "
                    "(%llu steps on rank 0)\n",
                    r.devices - 1, r.devices - 1, static_cast<unsigned long long>(r.steps));
      std::printf("train_mlp: %s\n", blas_info::summary(blas).c_str());
      if (cfg.json) std::printf("%s\n", to_json(cfg, r, data, blas).c_str());
      std::fflush(stdout);
    }
  } catch (std::exception const& e) {
    std::fflush(stdout);
    // A device_error's text names the device, a comm_error's the rank at fault.
    std::fprintf(stderr, "train_mlp: %serror: %s\n", who.c_str(), e.what());
    return 1;
  }
  return 0;
}

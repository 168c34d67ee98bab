// train_mlp's modes: one function each (single, dp, ddp over threads or MPI processes, and the
// GPU runners of --backend cuda), all through the one training loop of train_mlp_loop.hpp.
#include "train_mlp_loop.hpp"

#include <dparallel/policy/powersgd.hpp>
#if DPARALLEL_EXAMPLE_MPI
#include <dparallel/comm/mpi.hpp>
#endif

#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

namespace example {

// ------------------------------------------------------------------------------------------------
// The modes: one function each, sharing everything above.

/// --profile in single mode: the loop's total wait for its batches (no wrapper, no step profile).
void print_single_profile(config const& cfg, result const& r) {
  if (!cfg.profile) return;
  std::printf("train_mlp: profile: data wait %.3f ms in total over %llu steps (--mode single has no wrapper, "
              "so no step profile)\n",
              r.data_wait_seconds * 1e3, static_cast<unsigned long long>(r.steps - r.start_step));
}

/// One device: the model runs the whole global batch itself. No wrapper, so no step profile:
/// --profile prints only the loop's total wait for its batches.
result run_single(config const& cfg, training_data const& data, start_point const& start) {
  mlp model = start.model;
  result r = train(cfg, data, start, model, -1, [&](gathered_batch const& b, std::chrono::nanoseconds) {
    return static_cast<double>(model.forward_backward(b.view()));
  });
  r.devices = 1;
  print_single_profile(cfg, r);
  return r;
}

/// --profile: the wrapper's table of its mean step (rank 0 alone prints under DDP).
template <class Wrapper>
void print_profile(config const& cfg, Wrapper const& wrapper) {
  if (!cfg.profile) return;
  std::printf("%s", dparallel::format_profile(wrapper.profile()).c_str());
  std::fflush(stdout);
}

/// DataParallel over `cfg.devices` host logical devices: each step splits the global batch into
/// shards (torch.chunk), copies the master's parameters to the replicas, runs forward/backward on
/// every shard concurrently and reduces the shard-weighted gradients onto the master.
result run_dp(config const& cfg, training_data const& data, start_point const& start) {
  mlp model = start.model;
  dparallel::data_parallel<mlp> dp(model, dparallel::host::devices(cfg.devices));
  auto const step = [&](gathered_batch const& b, std::chrono::nanoseconds waited) {
    dp.note_data_wait(waited);
    // The step scatters the samples' ids; each device copies its shard's rows on its own thread
    // (unless --workers made the rows already) and computes on them.
    std::vector<float> const losses = dp.step(
        std::span<std::size_t const>(b.ids), [&](mlp& m, std::span<std::size_t const> ids, dparallel::step_context& ctx) {
          if (!b.images.empty()) {  // the loader's workers copied the rows: this shard's, as views
            std::size_t const first = ctx.shard_offset();
            return m.forward_backward(dparallel::batch_traits<batch>::slice(b.view(), first, first + ids.size()));
          }
          gathered_batch const shard = gather(data.train, ids);
          return m.forward_backward(shard.view());
        });
    // One mean loss per device that received a shard, in device order: weight each by its size.
    double sum = 0;
    std::size_t k = 0;
    for (std::size_t size : dp.last_shard_sizes())
      if (size != 0) sum += static_cast<double>(losses[k++]) * static_cast<double>(size);
    return sum / static_cast<double>(b.samples());
  };
  // The optimizer steps the wrapper: the devices' threads share the update of the master.
  result r = train(cfg, data, start, dp.module(), -1, step, make_update(cfg, dp.module(), dp), {}, {},
                   batch_making::ids);
  r.devices = cfg.devices;
  print_profile(cfg, dp);
  return r;
}

#if DPARALLEL_EXAMPLE_MPI
result run_ddp_mpi(config const& cfg, training_data const& data, start_point const& start);
#endif

/// --comm-hook: registers the chosen communication hook on `ddp` (nothing for none).
template <class Ddp>
void use_comm_hook(config const& cfg, Ddp& ddp) {
  if (cfg.comm_hook == "fp16") ddp.reducer().register_comm_hook(dparallel::compress_state{}, dparallel::fp16_compress);
  if (cfg.comm_hook == "bf16") ddp.reducer().register_comm_hook(dparallel::compress_state{}, dparallel::bf16_compress);
  if (cfg.comm_hook == "powersgd")
    ddp.reducer().register_comm_hook(dparallel::powersgd_state{.rank = cfg.powersgd_rank, .start_iter = 10, .seed = cfg.seed},
                                     dparallel::powersgd);
}

/// DistributedDataParallel over `cfg.devices` thread ranks (dparallel::spawn): every rank holds a
/// replica, reads its own part of each global batch (distributed_sampler), and DDP averages the
/// gradients over the ranks with a bucketed all-reduce; every rank then runs the same SGD step.
/// A step returns the rank's own mean loss; train() sums the epoch's losses over the ranks once, at
/// the epoch's end (sum_over).
/// With --comm mpi, run_ddp_mpi does the same with one rank per MPI process.
/// With --zero 1 the wrapper is parallel<mlp, ddp_zero1> and the update make_zero_update's.
template <class Bundle>
updater update_for(config const& cfg, dparallel::parallel<mlp, Bundle>& w) {
  if constexpr (std::is_same_v<Bundle, dparallel::ddp_zero1>) return make_zero_update(cfg, w);
  else return {};  // train() makes the usual one
}

/// DDP's options: --bucket-view all-reduces the gradient buffer in place; with --uneven, ranks may run out of data (options::uneven_inputs, join()) and
/// gradients are averaged by the samples each rank saw (docs/join.md).
dparallel::options ddp_options(config const& cfg) {
  dparallel::options o;
  o.gradient_as_bucket_view = cfg.bucket_view;  // DDP lays the gradients out (mlp::bind_gradients)
  if (cfg.uneven) {
    o.uneven_inputs = true;
    o.average = dparallel::average_mode::samples;
  }
  return o;
}

/// What train() calls at an epoch's end to add the ranks' loss sums: one all-reduce over `group`.
inline std::function<void(std::array<double, 2>&)> sum_over(dparallel::process_group const& group) {
  return [&group](std::array<double, 2>& sums) { group.all_reduce(dparallel::view(sums)).wait(); };
}

/// --uneven: what train() calls when this rank's epoch ran out of batches: `ddp`'s join().
template <class Ddp>
std::function<void()> join_at_epoch_end(config const& cfg, Ddp& ddp) {
  if (!cfg.uneven) return {};
  return [&ddp] { ddp.join(); };
}

template <class Bundle>
result run_ddp_as(config const& cfg, training_data const& data, start_point const& start) {
  result out;
  dparallel::spawn(cfg.devices, [&](dparallel::rank_context& rank) {
    mlp model = start.model;
    dparallel::parallel<mlp, Bundle> ddp(model, rank.group(), ddp_options(cfg));
    if constexpr (!std::is_same_v<Bundle, dparallel::ddp_zero1>) use_comm_hook(cfg, ddp);
    result r = train(cfg, data, start, ddp.module(), rank.rank(), [&](gathered_batch const& made, std::chrono::nanoseconds waited) {
      batch const b = made.view();
      ddp.note_data_wait(waited);
      return static_cast<double>(
          ddp.step(b, [](mlp& m, batch shard, dparallel::step_context&) { return m.forward_backward(shard); }));
    }, update_for(cfg, ddp), join_at_epoch_end(cfg, ddp), sum_over(rank.group()));
    if (rank.rank() == 0) {
      out = r;
      print_profile(cfg, ddp);
    }
  });
  out.devices = cfg.devices;
  return out;
}

result run_ddp(config const& cfg, training_data const& data, start_point const& start) {
#if DPARALLEL_EXAMPLE_MPI
  if (cfg.comm == "mpi") return run_ddp_mpi(cfg, data, start);
#endif
  return cfg.zero != 0 ? run_ddp_as<dparallel::ddp_zero1>(cfg, data, start) : run_ddp_as<dparallel::ddp>(cfg, data, start);
}

#if DPARALLEL_EXAMPLE_MPI
/// DDP with one rank per MPI process: the same training as run_ddp, over the MPI group; each
/// process reads its own part of every global batch. Returns rank 0's result on rank 0.
template <class Bundle>
result run_ddp_mpi_as(config const& cfg, training_data const& data, start_point const& start) {
  dparallel::process_group const& group = *mpi_group;
  mlp model = start.model;
  // --bucket-view: DDP moves the gradients into the group's memory (mlp::bind_gradients), which on
  // one node the all-reduces read and write in place in every process (ordinary memory across nodes).
  dparallel::parallel<mlp, Bundle> ddp(model, group, ddp_options(cfg));
  if constexpr (!std::is_same_v<Bundle, dparallel::ddp_zero1>) use_comm_hook(cfg, ddp);
  result r = train(cfg, data, start, ddp.module(), group.rank(), [&](gathered_batch const& made, std::chrono::nanoseconds waited) {
    batch const b = made.view();
    ddp.note_data_wait(waited);
    return static_cast<double>(
        ddp.step(b, [](mlp& m, batch shard, dparallel::step_context&) { return m.forward_backward(shard); }));
  }, update_for(cfg, ddp), join_at_epoch_end(cfg, ddp), sum_over(group));
  r.devices = group.size();
  if (group.rank() == 0) print_profile(cfg, ddp);
  return r;
}

result run_ddp_mpi(config const& cfg, training_data const& data, start_point const& start) {
  return cfg.zero != 0 ? run_ddp_mpi_as<dparallel::ddp_zero1>(cfg, data, start)
                       : run_ddp_mpi_as<dparallel::ddp>(cfg, data, start);
}
#endif

#if DPARALLEL_EXAMPLE_CUDA
/// The training loop with a GPU runner as the master (rank as train() takes it).
/// `group`: the DDP ranks' group (the epoch's losses are summed over it), or none.
result train_on_gpu(config const& cfg, training_data const& data, start_point const& start,
                    train_mlp_cuda::runner& run, int rank, dparallel::process_group const* group = nullptr) {
  gpu_master master{&run, start.model};
  return train(cfg, data, start, master, rank,
               [&run](gathered_batch const& b, std::chrono::nanoseconds waited) { return run.step(b.view(), waited); }, {}, {},
               group != nullptr ? sum_over(*group) : std::function<void(std::array<double, 2>&)>());
}

/// --profile: a GPU runner's wrapper table (rank 0 alone prints under DDP).
void print_gpu_profile(config const& cfg, train_mlp_cuda::runner const& run) {
  if (!cfg.profile) return;
  std::printf("%s", run.profile().c_str());
  std::fflush(stdout);
}

/// --backend cuda: the mode's runner (train_mlp_cuda.hpp) on the GPUs, through the same loop as the
/// host backend. ddp: thread ranks need one GPU each (NCCL); --comm nccl runs one rank per process.
result run_cuda(config const& cfg, training_data const& data, start_point const& start) {
  auto const announce = [](train_mlp_cuda::runner const& run) {
    std::printf("train_mlp: logical devices %s\n", run.devices().c_str());
    std::fflush(stdout);
  };
  if (cfg.mode == "single") {
    auto const run = train_mlp_cuda::make_single(start.model);
    announce(*run);
    result r = train_on_gpu(cfg, data, start, *run, -1);
    r.devices = 1;
    print_single_profile(cfg, r);
    return r;
  }
  if (cfg.mode == "dp") {
    auto const run = train_mlp_cuda::make_dp(start.model, cfg.devices);
    announce(*run);
    result r = train_on_gpu(cfg, data, start, *run, -1);
    r.devices = cfg.devices;
    print_gpu_profile(cfg, *run);
    return r;
  }
  if (cfg.comm == "nccl") {  // this process is one rank
    dparallel::distributed_group const& group = *nccl_group;
    auto const run = train_mlp_cuda::make_ddp(start.model, group, train_mlp_cuda::gpu_of(group));
    result r = train_on_gpu(cfg, data, start, *run, group.rank(), &group);
    r.devices = group.size();
    if (group.rank() == 0) print_gpu_profile(cfg, *run);
    return r;
  }
  // Thread ranks, one GPU each. A rank that fails aborts its group, so the others fail at once
  // instead of at the timeout; the first failure is reported.
  std::vector<dparallel::process_group> groups = train_mlp_cuda::make_nccl_groups(cfg.devices);
  result out;
  std::mutex m;
  std::exception_ptr first;
  std::vector<std::thread> ranks;
  for (int r = 0; r < cfg.devices; ++r) {
    ranks.emplace_back([&, r] {
      dparallel::process_group const& group = groups[static_cast<std::size_t>(r)];
      try {
        auto const run = train_mlp_cuda::make_ddp(start.model, group, r);
        result mine = train_on_gpu(cfg, data, start, *run, r, &group);
        if (r == 0) {
          out = mine;
          print_gpu_profile(cfg, *run);
        }
      } catch (std::exception const& e) {
        {
          std::lock_guard lock(m);
          if (!first) first = std::current_exception();
        }
        group.abort("rank " + std::to_string(r) + " failed: " + e.what());
      }
    });
  }
  for (auto& t : ranks) t.join();
  if (first) std::rethrow_exception(first);
  out.devices = cfg.devices;
  return out;
}
#endif

}  // namespace example

// Which GPU each rank takes (comm/detail/launch_gpu.hpp) over the launch layouts clusters use, and
// DDP's default device: the group's own GPU (process_group::bound_device), never rank % GPUs.
// Each layout is simulated as the ranks of every node with what each process sees; the checks are
// that the ranks of one host hold distinct GPUs where the hardware allows it, that one visible GPU
// per rank is accepted, that a real duplicate ends in a message naming the fix, and that DDP's
// default equals the communicator's GPU where rank % GPUs would not.

#include "models.hpp"

#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/detail/launch_gpu.hpp>
#include <dparallel/comm/host.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace dpl = dparallel;
using dpl::detail::choose_rank_gpu;
using dpl::detail::rank_gpu_inputs;

namespace {

// One process of a layout: its node and what it sees.
struct process {
  int node = 0;
  rank_gpu_inputs in;
};

// `nodes` nodes of `gpus` GPUs, `per_node` ranks on each; rank r goes to node placement(r) with
// the next local rank there; `visible(local_rank)` is what that process sees (all the node's
// GPUs, or its own one) and CUDA_VISIBLE_DEVICES as the launcher set it.
template <class Place>
std::vector<process> layout(int nodes, int per_node, int visible, std::optional<std::string> (*cvd)(int), Place place) {
  std::vector<process> out;
  std::vector<int> next(static_cast<std::size_t>(nodes), 0);
  for (int r = 0; r < nodes * per_node; ++r) {
    process p;
    p.node = place(r);
    p.in.rank = r;
    p.in.local_rank = next[static_cast<std::size_t>(p.node)]++;
    p.in.local_world_size = per_node;
    p.in.local_source = "LOCAL_RANK, LOCAL_WORLD_SIZE";
    p.in.visible = visible;
    p.in.cuda_visible_devices = cvd(p.in.local_rank);
    out.push_back(p);
  }
  return out;
}

std::optional<std::string> unset(int) { return std::nullopt; }
std::optional<std::string> own_gpu(int local_rank) { return std::to_string(local_rank); }

// The physical GPU a process holds: its choice among all the node's GPUs, or the one it was given.
int physical(process const& p, int chosen) {
  return p.in.cuda_visible_devices ? std::stoi(*p.in.cuda_visible_devices) : chosen;
}

// Every rank's choice: distinct physical GPUs per node, NCCL's GPU equal to DDP's default.
// Returns how many ranks rank % visible would have put on another GPU than their communicator's.
int check_layout(std::vector<process> const& procs, bool expect_may_share) {
  std::set<std::pair<int, int>> held;  // (node, physical GPU)
  int old_rule_wrong = 0;
  for (auto const& p : procs) {
    auto const chosen = choose_rank_gpu(p.in);
    CHECK(chosen.may_share == expect_may_share);
    CHECK(held.emplace(p.node, physical(p, chosen.gpu)).second);  // no two ranks of a host on one GPU
    dpl::device const comm_gpu{dpl::device_kind::cuda, chosen.gpu, 0};
    CHECK(dpl::detail::default_rank_device(comm_gpu, dpl::device_kind::cuda, p.in.rank, p.in.visible) == comm_gpu);
    if (p.in.rank % p.in.visible != chosen.gpu) ++old_rule_wrong;
  }
  return old_rule_wrong;
}

}  // namespace

TEST_CASE("torchrun --nproc_per_node below the GPUs per node: GPU local_rank, DDP on the same GPU", "[launch]") {
  // 2 nodes of 8 GPUs, 2 ranks each (torchrun numbers node 0's ranks first).
  auto const procs = layout(2, 2, 8, unset, [](int r) { return r / 2; });
  CHECK(check_layout(procs, false) == 2);  // ranks 2 and 3: rank % 8 names GPUs 2 and 3, NCCL uses 0 and 1
}

TEST_CASE("srun --gpus-per-task=1 and per-rank CUDA_VISIBLE_DEVICES: one visible GPU per rank is accepted", "[launch]") {
  // 2 nodes, 4 ranks each, every process sees exactly its own GPU as GPU 0.
  auto const procs = layout(2, 4, 1, own_gpu, [](int r) { return r / 4; });
  CHECK(check_layout(procs, true) == 0);
  for (auto const& p : procs) CHECK(choose_rank_gpu(p.in).gpu == 0);
}

TEST_CASE("round-robin placement and mpirun --map-by node: the GPU follows the local rank", "[launch]") {
  // Rank r on node r % 2 (srun --distribution=cyclic, mpirun --map-by node), 4 GPUs, 4 ranks each.
  auto const procs = layout(2, 4, 4, unset, [](int r) { return r % 2; });
  CHECK(check_layout(procs, false) == 6);  // rank % 4 disagrees with the local rank on 6 of 8 ranks
  CHECK(choose_rank_gpu(procs[5].in).gpu == 2);  // rank 5: node 1's third rank
}

TEST_CASE("two ranks that really share a GPU get NCCL's refusal explained with the fix", "[launch]") {
  // 8 ranks on a host whose 4 GPUs all see: local ranks 1 and 5 both take GPU 1.
  auto const procs = layout(1, 8, 4, unset, [](int) { return 0; });
  auto const a = choose_rank_gpu(procs[1].in);
  auto const b = choose_rank_gpu(procs[5].in);
  CHECK(a.gpu == b.gpu);
  CHECK(b.may_share);
  std::string const nccl = "Duplicate GPU detected : rank 5 and rank 1 both on CUDA device 1b000";
  REQUIRE(dpl::detail::names_duplicate_gpu(nccl));
  CHECK_FALSE(dpl::detail::names_duplicate_gpu("remote process exited or there was a network error"));
  std::string const m = dpl::detail::shared_gpu_message(procs[5].in, b, nccl);
  CHECK_THAT(m, Catch::Contains("rank 5: another rank of this job uses GPU 1"));
  CHECK_THAT(m, Catch::Contains("local rank 5 % 4 visible GPU(s)"));
  CHECK_THAT(m, Catch::Contains("8 ranks on this host"));
  CHECK_THAT(m, Catch::Contains("--gpus-per-task=1"));
  CHECK_THAT(m, Catch::Contains(nccl));

  // Two ranks on a machine with one GPU, each seeing it: both on GPU 0, NCCL refuses.
  auto const one = layout(1, 2, 1, unset, [](int) { return 0; });
  CHECK(choose_rank_gpu(one[0].in).gpu == choose_rank_gpu(one[1].in).gpu);
  CHECK(choose_rank_gpu(one[1].in).may_share);

  // An explicit gpu given twice: the message says so.
  rank_gpu_inputs given = procs[3].in;
  given.explicit_gpu = 2;
  auto const g = choose_rank_gpu(given);
  CHECK(g.gpu == 2);
  CHECK_FALSE(g.may_share);
  CHECK_THAT(dpl::detail::shared_gpu_message(given, g, nccl), Catch::Contains("given GPU 2 explicitly"));
}

TEST_CASE("an explicit gpu wins; no visible GPU is refused with the reason", "[launch]") {
  rank_gpu_inputs in;
  in.rank = 3;
  in.local_rank = 1;
  in.local_world_size = 2;
  in.visible = 0;
  in.cuda_visible_devices = "";
  CHECK_THROWS_WITH(choose_rank_gpu(in, "cudaErrorNoDevice"),
                    Catch::Contains("rank 3: no GPU visible") && Catch::Contains("cudaErrorNoDevice") &&
                        Catch::Contains("CUDA_VISIBLE_DEVICES=''"));
  in.explicit_gpu = 1;
  CHECK(choose_rank_gpu(in).gpu == 1);
  in.explicit_gpu = -1;
  CHECK_THROWS_AS(choose_rank_gpu(in), dpl::invalid_argument);
}

TEST_CASE("make_groups({cuda:1, cuda:0}): distinct GPUs pass, DDP's default is each rank's own GPU", "[launch]") {
  CHECK_FALSE(dpl::detail::check_group_gpus({1, 0}, false, 22809, std::nullopt));
  dpl::device const rank0{dpl::device_kind::cuda, 1, 0};
  CHECK(dpl::detail::default_rank_device(rank0, dpl::device_kind::cuda, 0, 2) == rank0);
  // Without a bound device (a host group over CUDA memory): round-robin by rank.
  CHECK(dpl::detail::default_rank_device(std::nullopt, dpl::device_kind::cuda, 3, 2) ==
        dpl::device{dpl::device_kind::cuda, 1, 0});
  // A bound device of another kind is not the backend's: host device `rank`, as before.
  CHECK(dpl::detail::default_rank_device(rank0, dpl::device_kind::host, 2, std::nullopt) ==
        dpl::device{dpl::device_kind::host, 2, 0});
}

TEST_CASE("make_groups refuses a shared GPU unless a test opts in on an NCCL that can share", "[launch]") {
  CHECK_THROWS_WITH(dpl::detail::check_group_gpus({0, 1, 0}, false, 23000, "1"),
                    Catch::Contains("found ranks 0 and 2 on GPU 0") && Catch::Contains("copy/kernel path"));
  CHECK_THROWS_WITH(dpl::detail::check_group_gpus({0, 0}, true, 22809, std::nullopt),
                    Catch::Contains("NCCL 2.28.9 cannot put two ranks") && Catch::Contains("NCCL_HOSTID"));
  CHECK_THROWS_WITH(dpl::detail::check_group_gpus({0, 0}, true, 23000, std::nullopt),
                    Catch::Contains("NCCL_MULTI_RANK_GPU_ENABLE=1, found it unset"));
  CHECK_THROWS_WITH(dpl::detail::check_group_gpus({0, 0}, true, 23001, "0"), Catch::Contains("found '0'"));
  CHECK(dpl::detail::check_group_gpus({0, 0}, true, 23001, "1"));
  CHECK_THROWS_AS(dpl::detail::check_group_gpus({}, true, 23001, "1"), dpl::invalid_argument);
}

TEST_CASE("processes sharing one GPU: the environment each needs, by NCCL version", "[launch]") {
  auto const old0 = dpl::detail::shared_gpu_environment(22809, 0);
  auto const old1 = dpl::detail::shared_gpu_environment(22809, 1);
  REQUIRE(old0.size() == 3);
  CHECK(old0[0].name == "NCCL_HOSTID");
  CHECK(old0[0].value != old1[0].value);  // each process a host of its own
  CHECK(old0[1].name == "NCCL_SOCKET_IFNAME");
  CHECK(old0[1].value == "lo");
  CHECK(old0[2].name == "NCCL_IB_DISABLE");
  auto const now = dpl::detail::shared_gpu_environment(23000, 1);
  REQUIRE(now.size() == 1);
  CHECK(now[0].name == "NCCL_MULTI_RANK_GPU_ENABLE");
  CHECK(now[0].value == "1");
  CHECK(dpl::detail::nccl_version_string(23004) == "2.30.4");
}

namespace {
// A host group's communicator that says it is bound to a device, as the NCCL engine says gpu().
struct bound_comm {
  dpl::process_group inner;
  dpl::device dev;
  [[nodiscard]] int rank() const { return inner.rank(); }
  [[nodiscard]] int size() const { return inner.size(); }
  [[nodiscard]] dpl::device gpu() const { return dev; }
  dpl::work all_reduce(dpl::tensor_ref t, dpl::reduce_op op) { return inner.all_reduce(t, op); }
  dpl::work reduce(dpl::tensor_ref t, int root, dpl::reduce_op op) { return inner.reduce(t, root, op); }
  dpl::work broadcast(dpl::tensor_ref t, int root) { return inner.broadcast(t, root); }
  dpl::work reduce_scatter(dpl::tensor_ref o, dpl::tensor_ref i, dpl::reduce_op op) { return inner.reduce_scatter(o, i, op); }
  dpl::work all_gather(dpl::tensor_ref o, dpl::tensor_ref i) { return inner.all_gather(o, i); }
  dpl::work barrier() { return inner.barrier(); }
  void abort(std::string why) { inner.abort(std::move(why)); }
};
}  // namespace

TEST_CASE("DDP takes the group's bound device as its default, through the desync wrapper too", "[launch][ddp]") {
  std::vector<dpl::device> chosen(2), plain(2), checked(2);
  std::vector<std::optional<dpl::device>> of_host(2);
  std::vector<std::string> refused(2);  // Catch2's assertions are not thread-safe: ranks record, the test checks
  dpl::spawn(2, [&](dpl::rank_context& ctx) {
    auto const r = static_cast<std::size_t>(ctx.rank());
    of_host[r] = ctx.group().bound_device();
    // Rank r bound to host device 5 - r: not rank r, so the default must come from the group.
    dpl::process_group const bound(
        std::make_shared<bound_comm>(bound_comm{ctx.group(), dpl::device{dpl::device_kind::host, 5 - ctx.rank(), 0}}));
    {
      test::linreg<double> m;
      dpl::distributed_data_parallel<test::linreg<double>> ddp(m, bound);
      chosen[r] = ddp.devices().at(0);
    }
    {
      test::linreg<double> m;
      dpl::distributed_data_parallel<test::linreg<double>> ddp(m, dpl::with_desync_detection(bound));
      checked[r] = ddp.devices().at(0);
    }
    {
      // An explicit local_device other than the group's device is refused before any collective
      // (every rank refuses, so none waits for the others' broadcast).
      test::linreg<double> m;
      dpl::options const elsewhere{.local_device = dpl::device{dpl::device_kind::host, 9, 0}};
      try {
        dpl::distributed_data_parallel<test::linreg<double>> refused_ddp(m, bound, elsewhere);
      } catch (dpl::error const& e) {
        refused[r] = e.what();
      }
    }
    test::linreg<double> m;
    dpl::distributed_data_parallel<test::linreg<double>> ddp(m, ctx.group());
    plain[r] = ddp.devices().at(0);
  });
  for (int r = 0; r < 2; ++r) {
    auto const i = static_cast<std::size_t>(r);
    CHECK_FALSE(of_host[i].has_value());  // host groups are bound to no device
    CHECK(chosen[i] == dpl::device{dpl::device_kind::host, 5 - r, 0});
    CHECK(checked[i] == chosen[i]);
    CHECK(plain[i] == dpl::device{dpl::device_kind::host, r, 0});  // host behaviour unchanged
    CHECK_THAT(refused[i], Catch::Contains("device of the group's communicator, host:" + std::to_string(5 - r)) &&
                               Catch::Contains("found host:9"));
  }
}

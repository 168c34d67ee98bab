// Hierarchical process groups over thread ranks (comm/hierarchical.hpp): the all_reduce equals the
// serial reference of the documented order, bit for bit (2 x 2, 2 x 3, 3 x 2, and nodes that are
// not consecutive ranks); DDP over it equals DDP over a group adding in that order; one node, and
// one rank per node, equal the flat group; nodes of different sizes fail alike on every rank.
#include "hierarchical_checks.hpp"

#include <dparallel/comm/hierarchical.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/spawn.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace dp = dparallel;
namespace hc = hierarchical_checks;

TEST_CASE("hierarchical: all_reduce equals the documented-order reference, bit for bit", "[host][comm]") {
  struct layout {
    int world, per_node;
  };
  for (auto const l : {layout{4, 2}, layout{6, 2}, layout{6, 3}}) {
    int const world = l.world, per_node = l.per_node;  // (clang 14 cannot capture structured bindings)
    std::vector<std::string> errors(static_cast<std::size_t>(world));
    dp::spawn(world, [&](dp::rank_context& ctx) {
      auto const h = dp::make_hierarchical(ctx.group(), {.ranks_per_node = per_node});
      auto const nodes = hc::consecutive(world, per_node);
      std::string e = hc::check_all_reduce(h, nodes, ctx.rank());
      if (e.empty()) e = hc::check_ddp(h, ctx.group(), nodes);
      errors[static_cast<std::size_t>(ctx.rank())] = e;
    });
    for (int r = 0; r < world; ++r) {
      INFO(world << " ranks, " << per_node << " per node, rank " << r);
      CHECK(errors[static_cast<std::size_t>(r)] == "");
    }
  }
}

TEST_CASE("hierarchical: nodes given by node_id need not be consecutive ranks", "[host][comm]") {
  std::vector<std::string> errors(6);
  std::vector<int> node(6), local(6);
  dp::spawn(6, [&](dp::rank_context& ctx) {
    int const p = ctx.rank();
    // Nodes by their first rank: node 0 = {0, 3, 4} (id 9), node 1 = {1, 2, 5} (id 2).
    int const id = (p == 0 || p == 3 || p == 4) ? 9 : 2;
    auto const comm = std::make_shared<dp::hierarchical_communicator>(ctx.group(), dp::hierarchical_options{.node_id = id});
    node[static_cast<std::size_t>(p)] = comm->node();
    local[static_cast<std::size_t>(p)] = comm->local_rank();
    errors[static_cast<std::size_t>(p)] = hc::check_all_reduce(dp::process_group(comm), {{0, 3, 4}, {1, 2, 5}}, p);
  });
  CHECK(node == std::vector<int>{0, 1, 1, 0, 0, 1});
  CHECK(local == std::vector<int>{0, 0, 1, 1, 2, 2});
  for (auto const& e : errors) CHECK(e == "");
}

TEST_CASE("hierarchical: one node, or one rank per node, equals the flat group", "[host][comm]") {
  for (int per_node : {0, 1, 4}) {  // 0: by host name (thread ranks share one)
    std::vector<std::vector<float>> flat(4), hier(4);
    dp::spawn(4, [&](dp::rank_context& ctx) {
      auto const h = dp::make_hierarchical(ctx.group(), {.ranks_per_node = per_node});
      auto x = hc::input<float>(ctx.rank(), 10'001, 5);
      auto y = x;
      ctx.group().all_reduce(dp::view(x), dp::reduce_op::avg).wait();
      h.all_reduce(dp::view(y), dp::reduce_op::avg).wait();
      flat[static_cast<std::size_t>(ctx.rank())] = x;
      hier[static_cast<std::size_t>(ctx.rank())] = y;
    });
    INFO("ranks per node " << per_node);
    CHECK(hier == flat);
  }
}

TEST_CASE("hierarchical: the other collectives are the parent's", "[host][comm]") {
  std::vector<std::string> errors(4);
  dp::spawn(4, [&](dp::rank_context& ctx) {
    auto const h = dp::make_hierarchical(ctx.group(), {.ranks_per_node = 2});
    int const p = ctx.rank();
    auto b = hc::input<float>(p, 33, 1);
    h.broadcast(dp::view(b), 3).wait();
    auto in = hc::input<float>(p, 4 * 9, 2), out = std::vector<float>(9);
    auto in_flat = in, out_flat = out;
    h.reduce_scatter(dp::view(out), dp::view(in)).wait();
    ctx.group().reduce_scatter(dp::view(out_flat), dp::view(in_flat)).wait();
    std::vector<float> all(4 * 5), mine = hc::input<float>(p, 5, 3);
    h.all_gather(dp::view(all), dp::view(mine)).wait();
    h.barrier().wait();
    std::string e;
    if (b != hc::input<float>(3, 33, 1)) e = "broadcast";
    if (out != out_flat) e = "reduce_scatter";
    for (int j = 0; j < 4; ++j) {
      if (!std::equal(all.begin() + 5 * j, all.begin() + 5 * j + 5, hc::input<float>(j, 5, 3).begin())) e = "all_gather";
    }
    errors[static_cast<std::size_t>(p)] = e;
  });
  for (auto const& e : errors) CHECK(e == "");
}

TEST_CASE("hierarchical: nodes of different sizes fail alike on every rank", "[host][comm]") {
  std::vector<std::string> what(5);
  dp::spawn(5, [&](dp::rank_context& ctx) {
    // Nodes {0, 1}, {2, 3}, {4}.
    what[static_cast<std::size_t>(ctx.rank())] =
        subgroup_checks::thrown_by([&] { (void)dp::make_hierarchical(ctx.group(), {.ranks_per_node = 2}); });
    // The parent is still usable.
    std::vector<float> x(3, 1.0f);
    ctx.group().all_reduce(dp::view(x)).wait();
    if (x != std::vector<float>(3, 5.0f)) what[static_cast<std::size_t>(ctx.rank())] += " (parent broken)";
  });
  for (int r = 0; r < 5; ++r) {
    INFO(what[static_cast<std::size_t>(r)]);
    CHECK(what[static_cast<std::size_t>(r)] ==
          "invalid_argument: dparallel: make_hierarchical on rank " + std::to_string(r) +
              ": expected every node to have the same number of ranks, found node 0 with 2 (parent ranks [0, 1]) "
              "and node 2 with 1 (parent ranks [4]); launch as many ranks on every node, or set "
              "hierarchical_options (node_id, ranks_per_node) or DPARALLEL_RANKS_PER_NODE so that every node gets "
              "the same number");
  }
}

TEST_CASE("hierarchical: an abort on one rank fails every rank's all_reduce, naming the cause", "[host][comm]") {
  std::vector<std::string> what(4);
  dp::spawn(4, [&](dp::rank_context& ctx) {
    auto h = dp::make_hierarchical(ctx.group(), {.ranks_per_node = 2});
    h.set_timeout(std::chrono::seconds(20));  // a rank that waited this long would report a timeout, not the abort
    if (ctx.rank() == 3) {
      h.abort("stop");
      return;
    }
    std::vector<float> x(1001, 1.0f);
    try {
      h.all_reduce(dp::view(x)).wait();
      what[static_cast<std::size_t>(ctx.rank())] = "no failure";
    } catch (dp::comm_error const& e) {
      what[static_cast<std::size_t>(ctx.rank())] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r << ": " << what[static_cast<std::size_t>(r)]);
    CHECK(what[static_cast<std::size_t>(r)].find("stop") != std::string::npos);
  }
}

namespace {

// A group whose tensors are labelled as GPU memory though they lie in host memory: it forwards
// every collective to a host group, relabelled as host memory. Over it the hierarchical
// all_reduce takes its device-memory path (no padding, no scaling of its own), so that path is
// checked here on the host, against its own documented order.
class labelled_device {
 public:
  explicit labelled_device(dp::process_group inner) : inner_(std::move(inner)) {}
  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  dp::work all_reduce(dp::tensor_ref t, dp::reduce_op op) { return inner_.all_reduce(host(t), op); }
  dp::work reduce(dp::tensor_ref t, int root, dp::reduce_op op) { return inner_.reduce(host(t), root, op); }
  dp::work broadcast(dp::tensor_ref t, int root) { return inner_.broadcast(host(t), root); }
  dp::work reduce_scatter(dp::tensor_ref o, dp::tensor_ref i, dp::reduce_op op) {
    return inner_.reduce_scatter(host(o), host(i), op);
  }
  dp::work all_gather(dp::tensor_ref o, dp::tensor_ref i) { return inner_.all_gather(host(o), host(i)); }
  dp::work barrier() { return inner_.barrier(); }
  void abort(std::string const& why) { inner_.abort(why); }
  dp::process_group subgroup(dp::detail::subgroup_plan const& plan) {
    dp::process_group g = dp::detail::make_subgroup(inner_, plan);
    if (g.valid()) ++subgroups;
    return g.valid() ? dp::process_group(std::make_shared<labelled_device>(std::move(g))) : g;
  }
  int subgroups = 0;

 private:
  static dp::tensor_ref host(dp::tensor_ref t) { return {t.data(), t.size(), t.dtype(), dp::host_memory}; }
  dp::process_group inner_;
};

dp::device const labelled_gpu{dp::device_kind::cuda, 0, 0};

// The device path's documented order: each node's sum in parent-rank order (avg: times 1/L, as
// the engine's avg), then the node results in node order (avg: times 1/nodes).
template <class T>
std::vector<T> device_path_reference(hc::nodes_t const& nodes, std::size_t len, unsigned salt, dp::reduce_op op) {
  std::vector<T> total;
  for (auto const& node : nodes) {
    hc::nodes_t const one{node};
    auto const part = hc::reference<T>(one, [&](int j) { return hc::input<T>(j, len, salt); }, op);
    if (total.empty()) {
      total = part;
    } else {
      for (std::size_t i = 0; i < len; ++i) total[i] += part[i];
    }
  }
  if (op == dp::reduce_op::avg) {
    for (auto& v : total) v *= T(1) / static_cast<T>(nodes.size());
  }
  return total;
}

}  // namespace

TEST_CASE("hierarchical: on device memory nothing is padded or scaled here; sum keeps the documented order",
          "[host][comm]") {
  // 2 x 2 and 3 x 2 (nodes x ranks per node), lengths below, at and above the node size,
  // divisible by it or not: the sum equals the documented order bit for bit (the tail, all-reduced
  // in the node and then across nodes, adds in that order too); avg is the engine's avg in the
  // node, then across nodes.
  for (int const world : {4, 6}) {
    std::vector<std::string> errors(static_cast<std::size_t>(world));
    dp::spawn(world, [&](dp::rank_context& ctx) {
      auto const wrapped = std::make_shared<labelled_device>(ctx.group());
      auto const h = dp::make_hierarchical(dp::process_group(wrapped), {.ranks_per_node = 2});
      auto const nodes = hc::consecutive(world, 2);
      std::string e;
      if (wrapped->subgroups != 2) e = "expected the node and cross groups split from the wrapped parent";
      unsigned salt = 40;
      for (std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{10'001}}) {
        for (auto op : {dp::reduce_op::sum, dp::reduce_op::avg}) {
          ++salt;
          auto x = hc::input<float>(ctx.rank(), len, salt);
          h.all_reduce(dp::tensor_ref(x.data(), len, dp::dtype::f32, labelled_gpu), op).wait();
          auto const want = op == dp::reduce_op::sum
                                ? hc::reference<float>(nodes, [&](int j) { return hc::input<float>(j, len, salt); }, op)
                                : device_path_reference<float>(nodes, len, salt, op);
          if (x != want && e.empty())
            e = "all_reduce (" + std::string(dp::name_of(op)) + ") of " + std::to_string(len) + " floats differs";
        }
      }
      errors[static_cast<std::size_t>(ctx.rank())] = e;
    });
    for (int r = 0; r < world; ++r) {
      INFO(world << " ranks, rank " << r);
      CHECK(errors[static_cast<std::size_t>(r)] == "");
    }
  }
}

#pragma once
// Contracts of hierarchical process groups (comm/hierarchical.hpp), run on every rank of a parent
// group whatever its engine: the hierarchical all_reduce equals a serial reference that adds in
// the documented order (inside each node in parent-rank order, then the node sums in node order,
// then the avg scaling), bit for bit; DDP over the hierarchical group equals DDP over a reference
// group whose all_reduce gathers every rank's buffer and adds it in that same order. Each check
// returns a description of the first failure (empty when all hold).
#include "subgroup_checks.hpp"

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/hierarchical.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace hierarchical_checks {

namespace dp = dparallel;
using nodes_t = std::vector<std::vector<int>>;  // every node's parent ranks, ascending; by first rank

/// The serial reference: of(j) is parent rank j's input; the result of the documented order.
template <class T, class F>
std::vector<T> reference(nodes_t const& nodes, F const& of, dp::reduce_op op) {
  std::vector<T> total;
  int world = 0;
  for (auto const& node : nodes) {
    std::vector<T> sum = of(node[0]);
    for (std::size_t k = 1; k < node.size(); ++k) {
      auto const x = of(node[k]);
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += x[i];
    }
    if (total.empty()) {
      total = sum;
    } else {
      for (std::size_t i = 0; i < sum.size(); ++i) total[i] += sum[i];
    }
    world += static_cast<int>(node.size());
  }
  if (op == dp::reduce_op::avg) {
    for (auto& v : total) v *= T(1) / static_cast<T>(world);
  }
  return total;
}

/// Parent rank j's input of `len` elements (float sums round, so the order shows in the bits).
template <class T>
std::vector<T> input(int j, std::size_t len, unsigned salt) {
  auto const f = subgroup_checks::input(j, len, salt);
  return std::vector<T>(f.begin(), f.end());
}

/// g's all_reduce (sum and avg; f32 and f64; lengths below, at and above the node size, divisible
/// by it or not) against the reference over `nodes`. `p`: this rank's parent rank.
inline std::string check_all_reduce(dp::process_group const& g, nodes_t const& nodes, int p) {
  auto const one = [&](auto zero, std::size_t len, dp::reduce_op op, unsigned salt) -> std::string {
    using T = decltype(zero);
    auto x = input<T>(p, len, salt);
    g.all_reduce(dp::view(x), op).wait();
    auto const want = reference<T>(nodes, [&](int j) { return input<T>(j, len, salt); }, op);
    if (x != want)
      return "all_reduce of " + std::to_string(len) + (sizeof(T) == 4 ? " floats" : " doubles") + " (" +
             std::string(dp::name_of(op)) + ") differs from the documented-order reference";
    return {};
  };
  unsigned salt = 0;
  for (std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{12'288}, std::size_t{100'003}}) {
    for (auto op : {dp::reduce_op::sum, dp::reduce_op::avg}) {
      if (auto e = one(float{}, len, op, ++salt); !e.empty()) return e;
      if (auto e = one(double{}, len, op, ++salt); !e.empty()) return e;
    }
  }
  return {};
}

/// A reference communicator over `parent`: all_reduce gathers every rank's buffer and adds it in
/// the documented hierarchical order over `nodes` (f32 and f64); the rest is the parent's.
class ordered_reference {
 public:
  ordered_reference(dp::process_group parent, nodes_t nodes) : parent_(std::move(parent)), nodes_(std::move(nodes)) {}
  [[nodiscard]] int rank() const { return parent_.rank(); }
  [[nodiscard]] int size() const { return parent_.size(); }
  dp::work all_reduce(dp::tensor_ref t, dp::reduce_op op) {
    if (t.dtype() == dp::dtype::f64) return sum<double>(t, op);
    return sum<float>(t, op);
  }
  dp::work reduce(dp::tensor_ref t, int root, dp::reduce_op op) { return parent_.reduce(t, root, op); }
  dp::work broadcast(dp::tensor_ref t, int root) { return parent_.broadcast(t, root); }
  dp::work reduce_scatter(dp::tensor_ref o, dp::tensor_ref i, dp::reduce_op op) { return parent_.reduce_scatter(o, i, op); }
  dp::work all_gather(dp::tensor_ref o, dp::tensor_ref i) { return parent_.all_gather(o, i); }
  dp::work barrier() { return parent_.barrier(); }
  void abort(std::string const& why) { parent_.abort(why); }

 private:
  template <class T>
  dp::work sum(dp::tensor_ref t, dp::reduce_op op) {
    auto x = t.as<T>();
    std::vector<T> all(x.size() * static_cast<std::size_t>(size()));
    parent_.all_gather(dp::tensor_ref(all.data(), all.size(), t.dtype(), t.device()), t).wait();  // t's device
    auto const of = [&](int j) {
      auto const b = all.begin() + static_cast<std::ptrdiff_t>(x.size() * static_cast<std::size_t>(j));
      return std::vector<T>(b, b + static_cast<std::ptrdiff_t>(x.size()));
    };
    auto const r = reference<T>(nodes_, of, op);
    for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = r[i];
    return {};
  }
  dp::process_group parent_;
  nodes_t nodes_;
};

/// DDP (subgroup_checks::ddp_after_steps) over the hierarchical group `h` equals DDP over the
/// ordered reference of `parent`, bit for bit.
inline std::string check_ddp(dp::process_group const& h, dp::process_group const& parent, nodes_t const& nodes) {
  auto const got = subgroup_checks::ddp_after_steps(h);
  auto const want = subgroup_checks::ddp_after_steps(
      dp::process_group(std::make_shared<ordered_reference>(parent, nodes)));
  return got == want ? std::string{} : "DDP over the hierarchical group differs from DDP over the ordered reference";
}

/// Nodes of `per_node` consecutive parent ranks.
inline nodes_t consecutive(int world, int per_node) {
  nodes_t nodes(static_cast<std::size_t>(world / per_node));
  for (int j = 0; j < world; ++j) nodes[static_cast<std::size_t>(j / per_node)].push_back(j);
  return nodes;
}

}  // namespace hierarchical_checks

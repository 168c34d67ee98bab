#pragma once
// Subgroup contracts run on every rank of a parent process_group, whatever its engine (thread
// ranks, shared-memory processes, MPI): each subgroup's collectives equal the serial reference
// over its members in group order, bit for bit; the ranks of split / new_group are where the
// documented order puts them; mismatched requests throw the same invalid_argument everywhere and
// leave the parent usable. Each function returns a description of the first failed check (empty
// when all hold), so that process-based tests can report it from any rank.
#include "models.hpp"

#include <dparallel/comm/communicator.hpp>
#include <dparallel/dparallel.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace subgroup_checks {

namespace dp = dparallel;

/// Parent rank p's input: values whose float sums round (so the order shows in the bits).
inline std::vector<float> input(int p, std::size_t n, unsigned salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = 0.1f * static_cast<float>(p + 1) + 1e-3f * static_cast<float>((i * 7 + salt) % 101) +
           static_cast<float>(p % 3) * 1e4f;
  return v;
}

/// Checks every collective of `g` (this rank is parent rank `p`; `members`: g's parent ranks in
/// group order) against the serial reference. Empty on success.
inline std::string check_collectives(dp::process_group const& g, std::vector<int> const& members, int p,
                                     unsigned salt) {
  auto const n = static_cast<int>(members.size());
  int const me = static_cast<int>(std::find(members.begin(), members.end(), p) - members.begin());
  if (!g.valid()) return "parent rank " + std::to_string(p) + " got no subgroup";
  if (g.size() != n || g.rank() != me)
    return "parent rank " + std::to_string(p) + ": expected rank " + std::to_string(me) + " of " + std::to_string(n) +
           ", found rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size());
  for (std::size_t len : {std::size_t{7}, std::size_t{100'003}}) {
    for (auto op : {dp::reduce_op::sum, dp::reduce_op::avg}) {
      // The serial reference over the members' inputs `of(k)`, in group order.
      auto const reference = [&](auto const& of) {
        std::vector<float> acc = of(0);
        for (int k = 1; k < n; ++k) {
          auto const next = of(k);
          for (std::size_t i = 0; i < len; ++i) acc[i] += next[i];
        }
        if (op == dp::reduce_op::avg) {
          for (auto& v : acc) v *= 1.0f / static_cast<float>(n);
        }
        return acc;
      };
      auto const want = reference([&](int k) { return input(members[static_cast<std::size_t>(k)], len, salt); });
      auto x = input(p, len, salt);
      g.all_reduce(dp::view(x), op).wait();
      if (x != want) return "all_reduce over parent ranks differs from the serial reference";
      // reduce_scatter: block b of every member's `len * n` input.
      std::vector<float> in(len * static_cast<std::size_t>(n)), out(len);
      for (int b = 0; b < n; ++b) {
        auto const part = input(p * 10 + b, len, salt);
        std::copy(part.begin(), part.end(), in.begin() + static_cast<std::ptrdiff_t>(len * static_cast<std::size_t>(b)));
      }
      g.reduce_scatter(dp::view(out), dp::view(in), op).wait();
      if (out != reference([&](int k) { return input(members[static_cast<std::size_t>(k)] * 10 + me, len, salt); }))
        return "reduce_scatter differs from the serial reference";
    }
    auto b = input(p, len, salt + 1);
    g.broadcast(dp::view(b), n - 1).wait();
    if (b != input(members.back(), len, salt + 1)) return "broadcast from the last group rank differs";
    auto mine = input(p, len, salt + 2);
    std::vector<float> all(len * static_cast<std::size_t>(n));
    g.all_gather(dp::view(all), dp::view(mine)).wait();
    for (int k = 0; k < n; ++k) {
      auto const want = input(members[static_cast<std::size_t>(k)], len, salt + 2);
      if (!std::equal(want.begin(), want.end(), all.begin() + static_cast<std::ptrdiff_t>(len * static_cast<std::size_t>(k))))
        return "all_gather block " + std::to_string(k) + " is not group rank " + std::to_string(k) + "'s input";
    }
  }
  g.barrier().wait();
  return {};
}

/// A model's parameters and gradients after 3 DDP steps over `g` (each rank its slice of a batch
/// fixed by the group's size): equal for any two groups of one size, whatever their engine.
inline std::vector<double> ddp_after_steps(dp::process_group const& g) {
  using model = test::chunked<float>;
  std::size_t const b = 8;
  auto const data = test::dataset<float>::make(b * static_cast<std::size_t>(g.size()), model().dim, 42, false);
  model m({3, 5, 1, 8, 2, 4}, static_cast<std::uint64_t>(100 + g.rank()));  // rank 0's wins (broadcast)
  dp::distributed_data_parallel<model> ddp(m, g);
  auto const r = static_cast<std::size_t>(g.rank());
  for (int step = 0; step < 3; ++step)
    ddp.step(dp::slice_batch(data.all(), r * b, (r + 1) * b),
             [](model& x, test::samples<float> s, dp::step_context&) { return x.forward_backward(s); });
  return test::flat(m, true);
}

/// The message of the exception `fn` throws, prefixed "invalid_argument: " for that type; empty
/// when it throws nothing.
template <class F>
std::string thrown_by(F const& fn) {
  try {
    fn();
  } catch (dp::invalid_argument const& e) {
    return std::string("invalid_argument: ") + e.what();
  } catch (std::exception const& e) {
    return e.what();
  }
  return {};
}

/// The whole set on a parent of at least 3 ranks. Empty on success.
inline std::string check_all(dp::process_group const& parent) {
  int const p = parent.rank();
  int const n = parent.size();
  // split: colors by parity, keys reversed; the two subgroups run concurrently.
  {
    auto const g = parent.split(p % 2, -p);
    std::vector<int> members;
    for (int j = n - 1; j >= 0; --j) {
      if (j % 2 == p % 2) members.push_back(j);
    }
    if (auto e = check_collectives(g, members, p, 1); !e.empty()) return "split(parity, -rank): " + e;
  }
  // split with an excluded color: the last rank is in no group; equal keys keep parent order.
  {
    auto const g = parent.split(p == n - 1 ? dp::process_group::no_group : 5, 0);
    if (p == n - 1) {
      if (g.valid()) return "split: the rank passing no_group got a group";
    } else {
      std::vector<int> members;
      for (int j = 0; j + 1 < n; ++j) members.push_back(j);
      if (auto e = check_collectives(g, members, p, 2); !e.empty()) return "split(no_group for the last): " + e;
    }
  }
  // new_group with ranks out of order; rank 1 is left out.
  {
    std::vector<int> list{n - 1, 0};
    for (int j = 2; j + 1 < n; ++j) list.push_back(j);
    auto const g = parent.new_group(list);
    if (p == 1) {
      if (g.valid()) return "new_group: a rank not in the list got a group";
    } else if (auto e = check_collectives(g, list, p, 3); !e.empty()) {
      return "new_group(" + std::to_string(n - 1) + ", 0, ...): " + e;
    }
  }
  // Mismatched requests: the same invalid_argument on every rank, no hang, the parent still works.
  {
    std::vector<int> list{0, 1};
    if (p == 1) list = {1, 0};
    auto const what = thrown_by([&] { (void)parent.new_group(list); });
    if (what.find("invalid_argument: ") != 0 || what.find("rank 1 passed another rank list") == std::string::npos)
      return "new_group with rank 1's list different: expected invalid_argument naming rank 1, found '" + what + "'";
    auto const mixed = thrown_by([&] { (void)(p == 2 ? parent.new_group({0}) : parent.split(0)); });
    if (mixed.find("invalid_argument: ") != 0 || mixed.find("called") == std::string::npos)
      return "split on some ranks and new_group on rank 2: expected invalid_argument, found '" + mixed + "'";
    auto const color = thrown_by([&] { (void)parent.split(p == 0 ? -7 : 0); });
    if (color.find("rank 0 passed color -7") == std::string::npos)
      return "split with color -7 on rank 0: expected invalid_argument naming it, found '" + color + "'";
    std::vector<int> list_all;
    for (int j = 0; j < n; ++j) list_all.push_back(j);
    if (auto e = check_collectives(parent, list_all, p, 4); !e.empty()) return "the parent after the errors: " + e;
  }
  return {};
}

}  // namespace subgroup_checks

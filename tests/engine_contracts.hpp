#pragma once
// The contract every communication engine passes (docs/writing-engines.md), as cases each run on
// every rank of a fresh group: test_engine_contracts instantiates them for thread ranks and
// shared-memory processes, tests/mpi/test_mpi_contracts for MPI processes (as dp_contracts.hpp
// does for DataParallel over backends).
//
//  - every collective equals a reference computed on each rank from every rank's inputs, bit for
//    bit, per dtype (reductions in rank order; the 16-bit types summed in float and rounded once;
//    integers wrapping), at sizes on both sides of the engines' small-message paths;
//  - each invalid argument throws invalid_argument on the caller, naming the call, the rank and
//    the problem, and aborts the group so that the next collective fails;
//  - mismatched collectives fail every rank naming the rank at fault and both calls, by the
//    engine's own check and through with_desync_detection (which leaves the group healthy);
//  - a rank that stops (destroys its group) is named in its peers' next collective.
//
// A case returns what went wrong on its rank ("" when nothing did), so that the harness may run
// it on threads, in forked processes or under mpirun and check the reports where Catch2 runs.

#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/desync.hpp>
#include <dparallel/comm/work.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/half.hpp>
#include <dparallel/core/tensor_view.hpp>

#include "host_comm_checks.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace test::contracts {

namespace dpc = dparallel;

/// What the cases need to know of an engine.
struct engine_info {
  bool integer_sums = false;  ///< reduces I32, I64 and U8 (sum, wrapping)
  bool lists = false;         ///< has the *_coalesced collectives
  bool stops_cleanly = true;  ///< a rank may destroy its group while its peers go on (the case below)
  bool mismatch_ends_cleanly = true;  ///< a mismatch caught by the engine's own check leaves nothing in flight
};

/// One contract case: its name, and its body on one rank of a fresh group.
struct contract_case {
  std::string name;
  std::function<std::string(dpc::process_group& g, engine_info const& e)> body;
};

// --- references -----------------------------------------------------------------------------

template <class T>
constexpr bool is_half_v = std::is_same_v<T, dpc::f16> || std::is_same_v<T, dpc::bf16>;

/// Rank `rank`'s input of `n` elements under `salt`, the same on every rank that asks.
template <class T>
std::vector<T> input_of(unsigned salt, int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (is_half_v<T>) {
      v[i] = T(test::input<float>(salt, rank, i));
    } else {
      v[i] = test::input<T>(salt, rank, i);
    }
  }
  return v;
}

/// The reduction of elements [first, first + count) of every rank's input, in rank order: float
/// for the 16-bit types (rounded once), wrapping for integers, times 1/n for avg.
template <class T>
std::vector<T> reference(std::vector<std::vector<T>> const& all, std::size_t first, std::size_t count,
                         dpc::reduce_op op) {
  auto const n = all.size();
  std::vector<T> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (is_half_v<T>) {
      float acc = static_cast<float>(all[0][first + i]);
      for (std::size_t k = 1; k < n; ++k) acc += static_cast<float>(all[k][first + i]);
      if (op == dpc::reduce_op::avg) acc *= 1.0f / static_cast<float>(n);
      out[i] = T(acc);
    } else if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      U acc = static_cast<U>(all[0][first + i]);
      for (std::size_t k = 1; k < n; ++k) acc = static_cast<U>(acc + static_cast<U>(all[k][first + i]));
      out[i] = static_cast<T>(acc);
    } else {
      T acc = all[0][first + i];
      for (std::size_t k = 1; k < n; ++k) acc += all[k][first + i];
      if (op == dpc::reduce_op::avg) acc *= T(1) / static_cast<T>(n);
      out[i] = acc;
    }
  }
  return out;
}

template <class T>
bool bitwise_equal(std::vector<T> const& a, std::vector<T> const& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// `v` cut into tensors of `piece` elements (the last one shorter).
template <class T>
std::vector<dpc::tensor_ref> cut(std::vector<T>& v, std::size_t piece) {
  std::vector<dpc::tensor_ref> parts;
  for (std::size_t at = 0; at < v.size(); at += piece)
    parts.push_back(dpc::tensor_ref(dpc::view(v)).subview(at, std::min(piece, v.size() - at)));
  return parts;
}

/// Sizes on both sides of the engines' small-message paths (64 KiB per rank and below).
inline constexpr std::size_t contract_sizes[] = {0, 1, 7, 1000, 40000};

/// Every collective of `g` over T, each against the reference; what differed, or "".
template <class T>
std::string collectives_equal_reference(dpc::process_group& g, engine_info const& e) {
  int const r = g.rank();
  int const n = g.size();
  auto const un = static_cast<std::size_t>(n);
  auto const ur = static_cast<std::size_t>(r);
  bool const floating = std::is_floating_point_v<T> || is_half_v<T>;
  bool const reduces = floating || e.integer_sums;
  std::string const type(dpc::name_of(dpc::dtype_v<T>));
  std::string wrong;
  auto const expect = [&](bool ok, std::string const& what, std::size_t m) {
    if (!ok && wrong.empty())
      wrong = what + " of " + std::to_string(m) + " x " + type + " on rank " + std::to_string(r) + " of " +
              std::to_string(n) + " differs from the reference";
  };
  unsigned salt = 0;
  auto everyone = [&](std::size_t m) {
    std::vector<std::vector<T>> all;
    for (int j = 0; j < n; ++j) all.push_back(input_of<T>(salt, j, m));
    return all;
  };
  for (std::size_t m : contract_sizes) {
    ++salt;
    int const root = static_cast<int>(salt % un);
    if (reduces) {
      for (auto op : {dpc::reduce_op::sum, dpc::reduce_op::avg}) {
        if (op == dpc::reduce_op::avg && !floating) continue;
        char const* const opn = op == dpc::reduce_op::sum ? "(sum)" : "(avg)";
        auto const all = everyone(m);
        auto a = all[ur];
        g.all_reduce(dpc::view(a), op).wait();
        expect(bitwise_equal(a, reference(all, 0, m, op)), std::string("all_reduce") + opn, m);
        auto b = all[ur];
        g.reduce(dpc::view(b), root, op).wait();
        expect(bitwise_equal(b, r == root ? reference(all, 0, m, op) : all[ur]), std::string("reduce") + opn, m);
        auto const big = everyone(m * un);
        auto in = big[ur];
        std::vector<T> out(m);
        g.reduce_scatter(dpc::view(out), dpc::view(in), op).wait();
        auto const mine = reference(big, ur * m, m, op);
        expect(bitwise_equal(out, mine), std::string("reduce_scatter") + opn, m);
        auto in2 = big[ur];  // in place: out is in's block r
        g.reduce_scatter(dpc::tensor_ref(dpc::view(in2)).subview(ur * m, m), dpc::view(in2), op).wait();
        expect(bitwise_equal(std::vector<T>(in2.begin() + static_cast<std::ptrdiff_t>(ur * m),
                                            in2.begin() + static_cast<std::ptrdiff_t>(ur * m + m)),
                             mine),
               std::string("in-place reduce_scatter") + opn, m);
        if (e.lists && m != 0) {  // the same arrays cut into tensors, each rank its own way
          auto c = all[ur];
          g.all_reduce_coalesced(cut(c, 1 + m / (2 + ur)), op).wait();
          expect(bitwise_equal(c, a), std::string("all_reduce_coalesced") + opn, m);
          auto in3 = big[ur];
          std::vector<T> out3(m);
          g.reduce_scatter_coalesced(dpc::view(out3), cut(in3, 1 + m * un / (2 + ur)), op).wait();
          expect(bitwise_equal(out3, mine), std::string("reduce_scatter_coalesced") + opn, m);
        }
      }
    }
    auto const all = everyone(m);
    auto c = all[ur];
    g.broadcast(dpc::view(c), root).wait();
    expect(bitwise_equal(c, all[static_cast<std::size_t>(root)]), "broadcast", m);
    std::vector<T> gathered;
    for (auto const& x : all) gathered.insert(gathered.end(), x.begin(), x.end());
    auto mine = all[ur];
    std::vector<T> out(m * un);
    g.all_gather(dpc::view(out), dpc::view(mine)).wait();
    expect(bitwise_equal(out, gathered), "all_gather", m);
    std::vector<T> out2(m * un, T(0));  // in place: in is out's block r
    std::copy(mine.begin(), mine.end(), out2.begin() + static_cast<std::ptrdiff_t>(ur * m));
    g.all_gather(dpc::view(out2), dpc::tensor_ref(dpc::view(out2)).subview(ur * m, m)).wait();
    expect(bitwise_equal(out2, gathered), "in-place all_gather", m);
    if (e.lists && m != 0) {
      std::vector<T> out3(m * un, T(0));
      std::copy(mine.begin(), mine.end(), out3.begin() + static_cast<std::ptrdiff_t>(ur * m));
      g.all_gather_coalesced(cut(out3, 1 + m * un / (3 + ur))).wait();
      expect(bitwise_equal(out3, gathered), "all_gather_coalesced", m);
    }
  }
  // Several in flight, waited for in reverse order: each still its own reference.
  if (reduces) {
    std::vector<std::vector<std::vector<T>>> alls;
    std::vector<std::vector<T>> bufs;
    std::vector<dpc::work> works;
    for (std::size_t k = 0; k < 4; ++k) {
      ++salt;
      alls.push_back(everyone(100 + 997 * k));
      bufs.push_back(alls.back()[ur]);
    }
    for (auto& b : bufs) works.push_back(g.all_reduce(dpc::view(b)));
    for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
    for (std::size_t k = 0; k < bufs.size(); ++k)
      expect(bitwise_equal(bufs[k], reference(alls[k], 0, bufs[k].size(), dpc::reduce_op::sum)),
             "all_reduce in flight with others", bufs[k].size());
  }
  g.barrier().wait();
  return wrong;
}

// --- failures -------------------------------------------------------------------------------

/// What `f()` threw, as "<kind> <rank>: <what>" ("" when it returned).
template <class F>
std::string thrown_by(F&& f) {
  try {
    f();
  } catch (dpc::comm_error const& ex) {
    return std::string(dynamic_cast<dpc::timeout_error const*>(&ex) ? "timeout_error " : "comm_error ") +
           std::to_string(ex.rank()) + ": " + ex.what();
  } catch (dpc::invalid_argument const& ex) {
    return std::string("invalid_argument: ") + ex.what();
  } catch (std::exception const& ex) {
    return std::string("other: ") + ex.what();
  }
  return {};
}

/// "" when `got` starts with `start` and contains each of `parts`; else what was wrong.
inline std::string expect_text(std::string const& got, std::string const& start, std::vector<std::string> const& parts,
                               std::string const& context) {
  bool ok = got.rfind(start, 0) == 0;
  for (auto const& p : parts) ok = ok && got.find(p) != std::string::npos;
  if (ok) return {};
  std::string want = "'" + start + "...'";
  for (auto const& p : parts) want += " with '" + p + "'";
  return context + ": expected " + want + ", found '" + got + "'";
}

/// Every rank makes the mistake `call` (so that no rank is left inside a collective, which MPI
/// could not finish): invalid_argument on each, naming `kind`, its rank and `problem`; the group
/// is aborted, so the next barrier fails with the abort.
inline contract_case invalid_argument_case(std::string name, std::string kind,
                                           std::function<std::string(dpc::process_group&)> problem,
                                           std::function<void(dpc::process_group&)> call) {
  return {std::move(name), [kind, problem, call](dpc::process_group& g, engine_info const&) {
            std::string const r = std::to_string(g.rank());
            std::string const got = thrown_by([&] { call(g); });
            std::string bad = expect_text(got, "invalid_argument: ", {kind + " on rank " + r + ": ", problem(g)},
                                          "the invalid " + kind);
            if (!bad.empty()) return bad;
            return expect_text(thrown_by([&] { g.barrier().wait(); }), "comm_error ",
                               {"aborted the process group: invalid arguments to " + kind}, "the barrier after it");
          }};
}

inline std::vector<contract_case> argument_cases() {
  auto const n_of = [](dpc::process_group& g) { return static_cast<std::size_t>(g.size()); };
  std::vector<contract_case> out;
  out.push_back(invalid_argument_case(
      "a root outside the group", "broadcast",
      [](dpc::process_group& g) {
        return "expected a root in [0, " + std::to_string(g.size()) + "), found " + std::to_string(g.size());
      },
      [](dpc::process_group& g) {
        std::vector<float> v(4);
        g.broadcast(dpc::view(v), g.size()).wait();
      }));
  out.push_back(invalid_argument_case(
      "reduce_scatter's input of the wrong size", "reduce_scatter",
      [n_of](dpc::process_group& g) {
        return "expected `in` to hold size() * out.size() = " + std::to_string(n_of(g)) + " * 3";
      },
      [n_of](dpc::process_group& g) {
        std::vector<float> out(3), in(3 * n_of(g) + 1);
        g.reduce_scatter(dpc::view(out), dpc::view(in)).wait();
      }));
  out.push_back(invalid_argument_case(
      "all_gather's buffers of two dtypes", "all_gather",
      [](dpc::process_group&) { return std::string("expected `out` and `in` of the same dtype, found F64 and F32"); },
      [n_of](dpc::process_group& g) {
        std::vector<double> out(3 * n_of(g));
        std::vector<float> in(3);
        g.all_gather(dpc::view(out), dpc::view(in)).wait();
      }));
  out.push_back(invalid_argument_case(
      "in overlapping out other than as its block", "all_gather",
      [](dpc::process_group&) { return std::string("`in` overlaps `out` other than as its block"); },
      [n_of](dpc::process_group& g) {
        std::vector<float> buf(4 * n_of(g) + 1);
        dpc::tensor_ref const all(dpc::view(buf));
        g.all_gather(all.subview(0, 4 * n_of(g)), all.subview(1, 4)).wait();
      }));
  out.push_back(invalid_argument_case(
      "a null data pointer", "all_reduce",
      [](dpc::process_group&) { return std::string("`t` has 4 elements but a null data pointer"); },
      [](dpc::process_group& g) { g.all_reduce(dpc::tensor_ref(nullptr, 4, dpc::dtype::f32, dpc::device{})).wait(); }));
  out.push_back(invalid_argument_case(
      "device memory", "all_reduce",
      [](dpc::process_group&) { return std::string("expected `t` in host memory, found a view on "); },
      [](dpc::process_group& g) {
        std::vector<float> v(4);  // never dereferenced: refused first
        g.all_reduce(dpc::tensor_ref(v.data(), v.size(), dpc::dtype::f32, dpc::device{dpc::device_kind::cuda, 0, 0}))
            .wait();
      }));
  out.push_back(invalid_argument_case(
      "an average of integers", "all_reduce", [](dpc::process_group&) { return std::string("found I32"); },
      [](dpc::process_group& g) {
        std::vector<std::int32_t> v(4);
        g.all_reduce(dpc::view(v), dpc::reduce_op::avg).wait();
      }));
  return out;
}

/// The last rank calls all_reduce of 12 elements, the others of 10: every rank fails naming it.
inline std::string mismatch_named(dpc::process_group& g, bool through_detector) {
  int const n = g.size();
  if (n < 2) return {};
  dpc::process_group const h = through_detector ? dpc::with_desync_detection(g) : g;
  std::vector<float> v(g.rank() == n - 1 ? 12 : 10, 1.0f);
  std::string bad = expect_text(thrown_by([&] { h.all_reduce(dpc::view(v)).wait(); }),
                                "comm_error " + std::to_string(n - 1) + ": ",
                                {"all_reduce(10 x F32, sum)", "all_reduce(12 x F32, sum)"}, "mismatched all_reduce");
  if (!bad.empty() || !through_detector) return bad;
  // The detector stopped the mismatch before it reached the engine: the group is healthy.
  std::vector<float> w(3, 1.0f);
  g.all_reduce(dpc::view(w)).wait();
  if (w != std::vector<float>(3, static_cast<float>(n))) return "the group under the detector is not healthy";
  return {};
}

/// The last rank destroys its group after one collective; the others' next one fails naming it.
inline std::string stopped_rank_named(dpc::process_group& g, engine_info const& e) {
  int const n = g.size();
  if (n < 2 || !e.stops_cleanly) return {};
  std::vector<float> v(8, 1.0f);
  g.all_reduce(dpc::view(v)).wait();
  if (g.rank() == n - 1) {
    g = dpc::process_group{};
    return {};
  }
  std::string const got = thrown_by([&] { g.all_reduce(dpc::view(v)).wait(); });
  auto const named = [&](char const* kind) {
    return expect_text(got, std::string(kind) + " " + std::to_string(n - 1) + ": ", {}, "");
  };
  if (named("comm_error").empty() || named("timeout_error").empty()) return {};
  return "the collective after rank " + std::to_string(n - 1) + " stopped: expected an error naming it, found '" + got +
         "'";
}

/// The collectives, one case per dtype.
inline std::vector<contract_case> collective_cases() {
  return {
      {"F32 collectives equal the reference", collectives_equal_reference<float>},
      {"F64 collectives equal the reference", collectives_equal_reference<double>},
      {"F16 collectives equal the reference", collectives_equal_reference<dpc::f16>},
      {"BF16 collectives equal the reference", collectives_equal_reference<dpc::bf16>},
      {"I32 collectives equal the reference", collectives_equal_reference<std::int32_t>},
      {"I64 collectives equal the reference", collectives_equal_reference<std::int64_t>},
      {"U8 collectives equal the reference", collectives_equal_reference<std::uint8_t>},
  };
}

/// The failures: argument errors, mismatched collectives (the engine's check and the desync
/// detector), a rank that stops.
inline std::vector<contract_case> failure_cases() {
  std::vector<contract_case> out = argument_cases();
  out.push_back({"mismatched collectives name the rank at fault", [](dpc::process_group& g, engine_info const& e) {
                   return e.mismatch_ends_cleanly ? mismatch_named(g, false) : std::string();
                 }});
  out.push_back({"desync detection names the rank at fault and leaves the group healthy",
                 [](dpc::process_group& g, engine_info const&) { return mismatch_named(g, true); }});
  out.push_back({"a rank that stops is named", stopped_rank_named});
  return out;
}

}  // namespace test::contracts

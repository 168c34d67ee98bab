#pragma once
// The MPI engine's collective algorithms: how one collective becomes a list of nonblocking MPI
// steps (start + finish), host memory staged, long messages split, F32/F64/F16/BF16 reduced in rank order
// (see <dparallel/comm/mpi.hpp> for the algorithms and their determinism).

#include <dparallel/config.hpp>
#include <dparallel/comm/mpi/detail/common.hpp>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// Staging memory reused from one collective to the next (no allocation per bucket); the progress
/// thread's only.
class mpi_staging_cache {
 public:
  std::byte* take(mpi_running& r, std::size_t bytes) {
    if (bytes == 0) return nullptr;
    if (bytes_ >= bytes) {
      r.staging = std::move(block_);
      r.staging_bytes = bytes_;
      bytes_ = 0;
    } else {
      block_.reset();
      bytes_ = 0;
      r.staging = std::make_unique_for_overwrite<std::byte[]>(bytes);
      r.staging_bytes = bytes;
    }
    return r.staging.get();
  }
  void recycle(mpi_running& r) {
    if (r.staging && r.staging_bytes >= bytes_) {
      block_ = std::move(r.staging);
      bytes_ = r.staging_bytes;
    }
  }

 private:
  std::unique_ptr<std::byte[]> block_;
  std::size_t bytes_ = 0;
};

/// (P) Plans the MPI steps of collective `r` on rank `me` of `n` over `comm` (see the top of
/// <dparallel/comm/mpi.hpp> for the algorithms); host staging memory comes from `cache`.
inline void build_mpi_steps(mpi_running& r, int me, int n, MPI_Comm comm, mpi::options const& opts,
                            mpi_staging_cache& cache) {
  comm_call const& c = r.task.call;
  auto const un = static_cast<std::size_t>(n);
  std::size_t const esz = size_of(c.type);
  MPI_Datatype const type = mpi_type_of(c.type);
  bool const direct = r.task.a.device().kind != device_kind::host;
  bool const integer = c.type == dtype::i32 || c.type == dtype::i64 || c.type == dtype::u8;
  // F16/BF16 always: MPI has no 16-bit floating-point sum (they travel as 16-bit words).
  bool const rank_order = !direct && (integer || is_half(c.type) ||
                                      (opts.reduce == mpi::reduction::rank_order && host_reducible(c.type)));
  bool const scale = c.op == reduce_op::avg;
  std::size_t const limit = std::clamp<std::size_t>(opts.max_message_elements, 1,
                                                     static_cast<std::size_t>(INT_MAX) - un - 1);
  auto* const A = static_cast<std::byte*>(r.task.a.data());
  auto* const B = static_cast<std::byte*>(r.task.b.data());
  auto const ci = [](std::size_t v) { return static_cast<int>(v); };
  dtype const ty = c.type;
  auto const scale_avg = [ty, n](std::byte* p, std::size_t count) {
    dispatch_reducible(ty, [&](auto zero) {
      using T = decltype(zero);
      T* v = reinterpret_cast<T*>(p);
      auto const s = avg_scale<accumulator_t<T>>(n);
      for (std::size_t i = 0; i < count; ++i) v[i] = narrow<T>(widen(v[i]) * s);
    });
  };
  auto const count = c.count;
  std::size_t const cl_max = std::min(limit, count);
  r.c1.assign(un, 0);
  r.d1.assign(un, 0);
  r.c2.assign(un, 0);
  r.d2.assign(un, 0);
  auto const slice = [un](std::size_t len, std::size_t j) { return len * j / un; };

  // First step: every rank gathers every rank's descriptor of this collective and compares them,
  // so that mismatched calls never reach MPI (where they give mixed data, MPI_ERR_TRUNCATE or a
  // hang); every rank sees the same descriptors and reaches the same verdict.
  if (opts.check_collectives) {
    r.fp_mine = desync_fingerprint::encode(r.task.seq, c);
    r.fp_all.assign(un * desync_fingerprint::words, 0);
    r.steps.push_back({[comm](mpi_running& x, MPI_Request* q) {
                         constexpr int w = static_cast<int>(desync_fingerprint::words);
                         return MPI_Iallgather(x.fp_mine.data(), w, MPI_INT64_T, x.fp_all.data(), w, MPI_INT64_T,
                                               comm, q);
                       },
                       [n](mpi_running& x) {
                         int culprit = 0;
                         if (auto msg = desync_report(x.fp_all, n, x.task.seq, culprit))
                           x.mismatch.emplace(culprit, std::move(*msg));
                       }});
  }

  switch (c.kind) {
    case comm_kind::barrier:  // the descriptor all_gather already waits for every rank
      if (opts.check_collectives) return;
      r.steps.push_back({[comm](mpi_running&, MPI_Request* q) { return MPI_Ibarrier(comm, q); }, {}});
      return;

    case comm_kind::broadcast: {
      std::byte* const S = direct ? nullptr : cache.take(r, cl_max * esz);
      int const root = c.root;
      for (std::size_t c0 = 0; c0 < count; c0 += limit) {
        std::size_t const cl = std::min(limit, count - c0);
        std::byte* const user = A + c0 * esz;
        std::byte* const buf = direct ? user : S;
        r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                             if (!direct && me == root) std::memcpy(buf, user, cl * esz);
                             return MPI_Ibcast(buf, ci(cl), type, root, comm, q);
                           },
                           [=](mpi_running&) {
                             if (!direct && me != root) std::memcpy(user, buf, cl * esz);
                           }});
      }
      return;
    }

    case comm_kind::all_gather: {  // a = out (n*m), b = in (m)
      std::size_t const m = count;
      if (direct) {
        bool const in_place = B == A + static_cast<std::size_t>(me) * m * esz;
        r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                             return MPI_Iallgather(in_place ? MPI_IN_PLACE : B, ci(m), type, A, ci(m), type, comm, q);
                           },
                           {}});
        return;
      }
      std::byte* const S = cache.take(r, (un + 1) * cl_max * esz);
      std::byte* const R = S + cl_max * esz;
      for (std::size_t c0 = 0; c0 < m; c0 += limit) {
        std::size_t const cl = std::min(limit, m - c0);
        r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                             std::memcpy(S, B + c0 * esz, cl * esz);
                             return MPI_Iallgather(S, ci(cl), type, R, ci(cl), type, comm, q);
                           },
                           [=](mpi_running&) {
                             for (std::size_t j = 0; j < un; ++j)
                               std::memcpy(A + (j * m + c0) * esz, R + j * cl * esz, cl * esz);
                           }});
      }
      return;
    }

    case comm_kind::all_reduce:
    case comm_kind::reduce: {
      bool const to_root = c.kind == comm_kind::reduce;
      int const root = c.root;
      if (direct) {
        for (std::size_t c0 = 0; c0 < count; c0 += limit) {
          std::size_t const cl = std::min(limit, count - c0);
          std::byte* const user = A + c0 * esz;
          r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                               if (!to_root) return MPI_Iallreduce(MPI_IN_PLACE, user, ci(cl), type, MPI_SUM, comm, q);
                               if (me == root) return MPI_Ireduce(MPI_IN_PLACE, user, ci(cl), type, MPI_SUM, root, comm, q);
                               return MPI_Ireduce(user, nullptr, ci(cl), type, MPI_SUM, root, comm, q);
                             },
                             {}});
        }
        return;
      }
      if (!rank_order) {
        std::byte* const S = cache.take(r, cl_max * esz);
        for (std::size_t c0 = 0; c0 < count; c0 += limit) {
          std::size_t const cl = std::min(limit, count - c0);
          std::byte* const user = A + c0 * esz;
          r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                               std::memcpy(S, user, cl * esz);
                               if (!to_root) return MPI_Iallreduce(MPI_IN_PLACE, S, ci(cl), type, MPI_SUM, comm, q);
                               if (me == root) return MPI_Ireduce(MPI_IN_PLACE, S, ci(cl), type, MPI_SUM, root, comm, q);
                               return MPI_Ireduce(S, nullptr, ci(cl), type, MPI_SUM, root, comm, q);
                             },
                             [=](mpi_running&) {
                               if (to_root && me != root) return;
                               if (scale) scale_avg(S, cl);
                               std::memcpy(user, S, cl * esz);
                             }});
        }
        return;
      }
      // Rank order: S holds the chunk (then the reduced slices), R every rank's copy of my slice.
      std::size_t const recv_max = un * (cl_max / un + 1);
      std::byte* const S = cache.take(r, (cl_max + recv_max) * esz);
      std::byte* const R = S + cl_max * esz;
      reduce_op const op = c.op;
      for (std::size_t c0 = 0; c0 < count; c0 += limit) {
        std::size_t const cl = std::min(limit, count - c0);
        std::byte* const user = A + c0 * esz;
        auto const um = static_cast<std::size_t>(me);
        std::size_t const lo_me = slice(cl, um);
        std::size_t const len_me = slice(cl, um + 1) - lo_me;
        r.steps.push_back({[=](mpi_running& x, MPI_Request* q) {
                             std::memcpy(S, user, cl * esz);
                             for (std::size_t j = 0; j < un; ++j) {
                               x.c1[j] = ci(slice(cl, j + 1) - slice(cl, j));
                               x.d1[j] = ci(slice(cl, j));
                               x.c2[j] = ci(len_me);
                               x.d2[j] = ci(j * len_me);
                             }
                             return MPI_Ialltoallv(S, x.c1.data(), x.d1.data(), type, R, x.c2.data(), x.d2.data(),
                                                   type, comm, q);
                           },
                           [=](mpi_running&) {
                             std::vector<void const*> srcs(un);
                             for (std::size_t j = 0; j < un; ++j) srcs[j] = R + j * len_me * esz;
                             reduce_in_rank_order(ty, srcs, S + lo_me * esz, len_me, op, n);
                           }});
        r.steps.push_back({[=](mpi_running& x, MPI_Request* q) {
                             for (std::size_t j = 0; j < un; ++j) {
                               x.c1[j] = ci(slice(cl, j + 1) - slice(cl, j));
                               x.d1[j] = ci(slice(cl, j));
                             }
                             if (!to_root)
                               return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, S, x.c1.data(), x.d1.data(),
                                                      type, comm, q);
                             if (me == root)
                               return MPI_Igatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, S, x.c1.data(), x.d1.data(),
                                                   type, root, comm, q);
                             return MPI_Igatherv(S + lo_me * esz, ci(len_me), type, nullptr, nullptr, nullptr, type,
                                                 root, comm, q);
                           },
                           [=](mpi_running&) {
                             if (!to_root || me == root) std::memcpy(user, S, cl * esz);
                           }});
      }
      return;
    }

    case comm_kind::reduce_scatter: {  // a = out (m), b = in (n*m)
      std::size_t const m = count;
      if (direct) {
        r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                             return MPI_Ireduce_scatter_block(B, A, ci(m), type, MPI_SUM, comm, q);
                           },
                           {}});
        return;
      }
      reduce_op const op = c.op;
      std::byte* const S = cache.take(r, (rank_order ? 2 * un : un + 1) * cl_max * esz);
      std::byte* const R = S + un * cl_max * esz;
      for (std::size_t c0 = 0; c0 < m; c0 += limit) {
        std::size_t const cl = std::min(limit, m - c0);
        auto const pack = [=] {
          for (std::size_t j = 0; j < un; ++j) std::memcpy(S + j * cl * esz, B + (j * m + c0) * esz, cl * esz);
        };
        if (rank_order) {
          r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                               pack();
                               return MPI_Ialltoall(S, ci(cl), type, R, ci(cl), type, comm, q);
                             },
                             [=](mpi_running&) {
                               std::vector<void const*> srcs(un);
                               for (std::size_t j = 0; j < un; ++j) srcs[j] = R + j * cl * esz;
                               reduce_in_rank_order(ty, srcs, A + c0 * esz, cl, op, n);
                             }});
        } else {
          r.steps.push_back({[=](mpi_running&, MPI_Request* q) {
                               pack();
                               return MPI_Ireduce_scatter_block(S, R, ci(cl), type, MPI_SUM, comm, q);
                             },
                             [=](mpi_running&) {
                               if (scale) scale_avg(R, cl);
                               std::memcpy(A + c0 * esz, R, cl * esz);
                             }});
        }
      }
      return;
    }
  }
}

}  // namespace detail
DPARALLEL_NAMESPACE_END

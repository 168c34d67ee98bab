#pragma once
// The collective algorithms of the shared-memory communicator (see <dparallel/comm/shm.hpp>).
// A rank's process can read and write only its own buffers and the segment, so data moves
// through the segment: each rank copies its input in, the ranks meet, each computes from the
// segment, and copies results out. Every element of a reduction is summed over the ranks'
// copies in rank order 0..n-1 with the host communicator's kernel (reduce_bytes), so the result
// is bitwise what thread ranks give.
//
// Small collectives (a rank's input at most options::small_bytes) meet once: each rank copies its
// input into its small slot of the collective's parity (sequence number mod 2), they meet, and
// each rank computes its own result from every slot. A slot is written again two collectives
// later, after every rank has passed the meeting of the collective in between, i.e. after every
// rank finished reading it. An all_reduce or reduce in which some rank's buffer lies in its group
// memory meets twice (small_reduce), that rank copying nothing in.
// Larger ones go in chunks of options::chunk_bytes per rank, with two meetings per chunk:
//   all_reduce / reduce: copy the chunk in, but for this rank's stripes; meet; rank r sums its
//     stripes (for_each_stripe: 64 KiB or more, dealt out round robin, as thread ranks share a
//     buffer) of every rank's copy (its own from its buffer) into the result area and into its
//     own buffer; meet; copy the other stripes out. Stripes, not one slice per rank: the end of a
//     buffer just written sits in its writer's cache, and the rank whose slice it was read it
//     from there (DDP over 2 processes: 185 us for that rank's half of a 1.6 MB gradient
//     against 81 us for the other's). A rank whose buffer lies in its group
//     memory (process_group::allocate; segment.hpp) says so in its descriptor and copies nothing:
//     the peers read its stripes in place and write their sums straight into it. When every
//     rank's buffer is there, the whole buffer goes in one pass with two meetings, as thread
//     ranks reduce (reduce_chunk);
//   broadcast: the root copies the chunk into the result area; meet; the others copy it out; meet;
//   reduce_scatter: copy in every block's part of the chunk; meet; sum this rank's block; meet;
//   all_gather: copy the chunk in; meet; copy every rank's chunk out; meet.
// all_reduce_coalesced reads a list of tensors as one array: the same steps, copying the list in
// and the sums out run by run (small_list, chunked_list; this rank's own stripes of a chunk are read
// from the list and its sums written into it), so it matches a peer's all_reduce.
// reduce_scatter_coalesced and all_gather_coalesced take the steps of their plain forms, with
// the copies in (take_in, take_block) and out (give_out) going run by run through the list.
// The first meeting of every collective also compares the ranks' descriptors of it (check()).

#include <dparallel/config.hpp>
#include <dparallel/comm/communicator.hpp>
#include <dparallel/comm/detail/coalesced.hpp>
#include <dparallel/comm/detail/comm_call.hpp>
#include <dparallel/comm/detail/host_kernels.hpp>
#include <dparallel/comm/shm/detail/group.hpp>
#include <dparallel/comm/shm/detail/kernels.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/stripes.hpp>
#include <dparallel/core/tensor_view.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <span>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// Runs one rank's collectives over a shm_group (on its communication thread, one at a time).
class shm_runner {
 public:
  explicit shm_runner(shm_group& g)
      : g_(g), srcs_(static_cast<std::size_t>(g.size())), peers_(static_cast<std::size_t>(g.size())) {
    dsts_.reserve(static_cast<std::size_t>(g.size()) + 1);
  }

  /// Collective `seq` of this rank: its failure, or null.
  /// `list`: a *_coalesced call's tensors (c.parts of them), in place of `a` (all_reduce,
  /// all_gather) or `b` (reduce_scatter).
  std::exception_ptr run(std::uint64_t seq, comm_call const& c, tensor_ref a, tensor_ref b,
                         std::chrono::milliseconds timeout, std::span<tensor_ref const> list = {}) {
    if (g_.failed()) return g_.error(seq, c);
    seq_ = seq;
    call_ = c;
    timeout_ = timeout;
    checked_ = false;
    A_ = static_cast<std::byte*>(a.data());
    B_ = static_cast<std::byte*>(b.data());
    esz_ = size_of(c.type);
    list_ = list;
    // An all_reduce or reduce of a buffer in this rank's group memory: the peers use it in place.
    std::size_t const bytes = c.count * esz_;
    bool const reduces = c.kind == comm_kind::all_reduce || c.kind == comm_kind::reduce;
    direct_ = c.parts == 0 && reduces && bytes != 0 ? g_.arena().offset_of(A_, bytes) : 0;
    g_.publish(seq, c, direct_);
    bool ok = true;
    if (c.parts != 0 && c.kind == comm_kind::all_reduce)
      ok = input_bytes() <= g_.segment().layout().small ? small_list() : chunked_list();
    else if (c.kind == comm_kind::barrier) ok = meet();
    else if (input_bytes() <= g_.segment().layout().small) ok = small();
    else ok = chunked();
    return ok ? nullptr : g_.error(seq, c);
  }

 private:
  [[nodiscard]] std::size_t input_bytes() const noexcept {
    return (call_.kind == comm_kind::reduce_scatter ? call_.total : call_.count) * esz_;
  }
  [[nodiscard]] std::byte* small_slot(int j) const noexcept {
    auto const& L = g_.segment().layout();
    auto const index = static_cast<std::size_t>(seq_ % 2) * static_cast<std::size_t>(g_.size()) +
                       static_cast<std::size_t>(j);
    return g_.segment().at(L.small_at() + index * L.small);
  }
  [[nodiscard]] std::byte* chunk_slot(int j) const noexcept {
    auto const& L = g_.segment().layout();
    return g_.segment().at(L.chunk_at() + static_cast<std::size_t>(j) * L.chunk);
  }
  [[nodiscard]] std::byte* result() const noexcept { return g_.segment().at(g_.segment().layout().result_at()); }

  bool meet() {
    if (!g_.barrier(seq_, call_, timeout_)) return false;
    if (!checked_) {
      checked_ = true;
      return g_.check(seq_);
    }
    return true;
  }

  static void copy(std::byte* dst, std::byte const* src, std::size_t bytes) {
    if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
  }

  // srcs_[j] = base(j) + offset for every rank j, then the reduction into `dsts`.
  template <class Base>
  void reduce_from(Base base, std::size_t offset, std::span<void* const> dsts, std::size_t count) {
    for (int j = 0; j < g_.size(); ++j) srcs_[static_cast<std::size_t>(j)] = base(j) + offset;
    reduce_any(call_.type, srcs_, dsts, count, call_.op, g_.size());
  }
  template <class Base>
  void reduce_from(Base base, std::size_t offset, std::initializer_list<void*> dsts, std::size_t count) {
    reduce_from(base, offset, std::span<void* const>(dsts.begin(), dsts.size()), count);
  }

  bool small() {
    int const r = g_.rank();
    std::size_t const bytes = call_.count * esz_;
    switch (call_.kind) {
      case comm_kind::all_reduce:
      case comm_kind::reduce:
        if (direct_ == 0) copy(small_slot(r), A_, bytes);
        break;
      case comm_kind::broadcast:
        if (r == call_.root) copy(small_slot(r), A_, bytes);
        break;
      case comm_kind::reduce_scatter: take_in(0, call_.total, small_slot(r)); break;
      case comm_kind::all_gather: take_block(0, call_.count, small_slot(r)); break;
      case comm_kind::barrier: break;
    }
    if (!meet()) return false;
    auto const slot = [&](int j) { return small_slot(j); };
    switch (call_.kind) {
      case comm_kind::all_reduce:
      case comm_kind::reduce: return small_reduce();
      case comm_kind::broadcast:
        if (r != call_.root) copy(A_, small_slot(call_.root), bytes);
        break;
      case comm_kind::reduce_scatter: reduce_from(slot, static_cast<std::size_t>(r) * bytes, {A_}, call_.count); break;
      case comm_kind::all_gather:
        for (int j = 0; j < g_.size(); ++j) give_out(j, 0, call_.count, small_slot(j));
        break;
      case comm_kind::barrier: break;
    }
    return true;
  }

  // all_reduce / reduce of at most small_bytes, after the meeting. With no rank's buffer in group
  // memory, each rank that keeps the result sums every slot into its buffer (one meeting). With
  // every rank's there, as reduce_chunk: rank r sums slice r of every buffer into the buffers that
  // keep the result; meet. Some: every rank that keeps the result sums the slots and the buffers
  // in group memory, into its buffer (not in group memory) or its slot (in group memory, which
  // its peers are still reading); meet; the latter copy the slot into their buffer.
  bool small_reduce() {
    int const r = g_.rank();
    int const n = g_.size();
    auto const slot = [&](int j) { return small_slot(j); };
    find_peers();
    auto const in_group = [](std::byte* p) { return p != nullptr; };
    if (std::none_of(peers_.begin(), peers_.end(), in_group)) {
      if (keeps(r)) reduce_from(slot, 0, {A_}, call_.count);
      return true;
    }
    if (std::all_of(peers_.begin(), peers_.end(), in_group)) {
      auto const [s0, s1] = rank_slice(call_.count, n, r);
      if (s1 > s0) sum_run(0, s0, s1 - s0, A_ + s0 * esz_);
      return meet();
    }
    if (keeps(r)) {
      std::byte* const into = direct_ != 0 ? small_slot(r) : A_;
      reduce_from([&](int j) { std::byte* p = peers_[static_cast<std::size_t>(j)]; return p != nullptr ? p : slot(j); },
                  0, {into}, call_.count);
    }
    if (!meet()) return false;
    if (keeps(r) && direct_ != 0) copy(A_, small_slot(r), call_.count * esz_);
    return true;
  }

  bool chunked() {
    int const r = g_.rank();
    int const n = g_.size();
    auto const un = static_cast<std::size_t>(n);
    std::size_t const chunk = g_.segment().layout().chunk;
    std::size_t const count = call_.count;
    auto const slot = [&](int j) { return chunk_slot(j); };
    std::size_t step = std::max<std::size_t>(1, call_.kind == comm_kind::reduce_scatter ? chunk / (un * esz_)
                                                                                          : chunk / esz_);
    // This rank's buffer is in its group memory: it has nothing to copy in, so it meets first and
    // learns where the peers' buffers are. When they all are in group memory, no rank copies
    // anything and the whole buffer goes in one pass (as thread ranks reduce).
    bool met_first = false;
    if (direct_ != 0) {
      if (!meet()) return false;
      met_first = true;
      find_peers();
      if (std::all_of(peers_.begin(), peers_.end(), [](std::byte* p) { return p != nullptr; })) step = count;
    }
    for (std::size_t lo = 0; lo < count; lo += step) {
      std::size_t const len = std::min(step, count - lo);
      std::size_t const bytes = len * esz_;
      std::byte* const mine = A_ == nullptr ? nullptr : A_ + lo * esz_;  // none: all_gather into a list
      switch (call_.kind) {
        case comm_kind::all_reduce:
        case comm_kind::reduce:
          if (!reduce_chunk(lo, len, mine, lo == 0 && met_first)) return false;
          break;
        case comm_kind::broadcast:
          if (r == call_.root) copy(result(), mine, bytes);
          if (!meet()) return false;
          if (r != call_.root) copy(mine, result(), bytes);
          if (!meet()) return false;
          break;
        case comm_kind::reduce_scatter:
          for (std::size_t j = 0; j < un; ++j) take_in(j * count + lo, len, chunk_slot(r) + j * bytes);
          if (!meet()) return false;
          reduce_from(slot, static_cast<std::size_t>(r) * bytes, {mine}, len);
          if (!meet()) return false;
          break;
        case comm_kind::all_gather:
          take_block(lo, len, chunk_slot(r));
          if (!meet()) return false;
          for (int j = 0; j < n; ++j) give_out(j, lo, len, chunk_slot(j));
          if (!meet()) return false;
          break;
        case comm_kind::barrier: break;
      }
    }
    return checked_ || meet();  // a collective with no elements still meets (and is checked) once
  }

  // all_reduce / reduce, elements [lo, lo + len) at `mine`: copy in (unless this rank's buffer is
  // in group memory) all but this rank's stripes; meet (unless met already); rank r sums its
  // stripes of every rank's copy (in place for the ranks whose buffers are in group memory, from
  // its own buffer for itself) into the result area (when some rank copies its results out) and
  // into the buffers that keep the result and are in place; meet; copy the other stripes out.
  bool reduce_chunk(std::size_t lo, std::size_t len, std::byte* mine, bool met) {
    int const r = g_.rank();
    int const n = g_.size();
    if (direct_ == 0)
      for_each_gap(len, [&](std::size_t a, std::size_t b) {
        copy(chunk_slot(r) + a * esz_, mine + a * esz_, (b - a) * esz_);
      });
    if (!met && !meet()) return false;
    if (lo == 0 && !met) find_peers();
    for_each_stripe(len, n, r, esz_, [&](std::size_t a, std::size_t b) { sum_run(lo, a, b - a, mine + a * esz_); });
    if (!meet()) return false;
    if (keeps(r) && direct_ == 0)
      for_each_gap(len, [&](std::size_t a, std::size_t b) {
        copy(mine + a * esz_, result() + a * esz_, (b - a) * esz_);
      });
    return true;
  }

  [[nodiscard]] bool keeps(int j) const noexcept { return call_.kind == comm_kind::all_reduce || j == call_.root; }

  // Elements [a, a + m) of the chunk at `lo`, summed over every rank's copy (this rank's at `own`;
  // a peer's in its group memory where it lies, else in its chunk slot) into the buffers that
  // keep the result: this rank's at `own`, the peers' in group memory, and the result area when
  // some rank that keeps it copies its results out from there.
  void sum_run(std::size_t lo, std::size_t a, std::size_t m, std::byte* own) {
    int const r = g_.rank();
    int const n = g_.size();
    bool copied_out = false;
    dsts_.clear();
    for (int j = 0; j < n; ++j) {
      if (!keeps(j)) continue;
      std::byte* const p = peers_[static_cast<std::size_t>(j)];
      if (j == r) dsts_.push_back(own);
      else if (p != nullptr) dsts_.push_back(p + (lo + a) * esz_);
      if (p == nullptr) copied_out = true;
    }
    if (copied_out) dsts_.push_back(result() + a * esz_);
    for (int j = 0; j < n; ++j) {
      std::byte* const p = peers_[static_cast<std::size_t>(j)];
      srcs_[static_cast<std::size_t>(j)] = j == r ? own : (p != nullptr ? p + lo * esz_ : chunk_slot(j)) + a * esz_;
    }
    reduce_any(call_.type, srcs_, dsts_, m, call_.op, n);
  }

  // f(a, b) for each run [a, b) of elements [0, len) of a chunk that other ranks reduce (between
  // this rank's stripes), in increasing order.
  template <class F>
  void for_each_gap(std::size_t len, F&& f) const {
    std::size_t done = 0;
    for_each_stripe(len, g_.size(), g_.rank(), esz_, [&](std::size_t a, std::size_t b) {
      if (a > done) f(done, a);
      done = b;
    });
    if (done < len) f(done, len);
  }

  // After the first meeting of a reduction: each rank's buffer where it lies in its group memory
  // (this rank's too), else null.
  void find_peers() {
    std::size_t const bytes = call_.count * esz_;
    for (int j = 0; j < g_.size(); ++j)
      peers_[static_cast<std::size_t>(j)] =
          j == g_.rank() ? (direct_ != 0 ? A_ : nullptr) : g_.buffer_of(j, seq_, bytes);
  }

  // reduce_scatter: elements [lo, lo + len) of this rank's input array (its list, or `in`) into
  // `flat`.
  void take_in(std::size_t lo, std::size_t len, std::byte* flat) {
    if (list_.empty()) {
      copy(flat, B_ + lo * esz_, len * esz_);
      return;
    }
    coalesced_cursor at(list_, esz_);
    move_list(at, lo, len, flat, true);
  }
  // all_gather: elements [lo, lo + len) of this rank's block (its `in`, or block rank() of its
  // list) into `flat`.
  void take_block(std::size_t lo, std::size_t len, std::byte* flat) {
    if (list_.empty()) copy(flat, B_ + lo * esz_, len * esz_);
    else take_in(static_cast<std::size_t>(g_.rank()) * call_.count + lo, len, flat);
  }
  // all_gather: `flat` into elements [lo, lo + len) of rank j's block of this rank's output
  // array (its `out`, or its list, whose own block is in place already).
  void give_out(int j, std::size_t lo, std::size_t len, std::byte* flat) {
    std::size_t const at_elem = static_cast<std::size_t>(j) * call_.count + lo;
    if (list_.empty()) {
      copy(A_ + at_elem * esz_, flat, len * esz_);
    } else if (j != g_.rank()) {
      coalesced_cursor at(list_, esz_);
      move_list(at, at_elem, len, flat, false);
    }
  }

  // Elements [lo, lo + len) of this rank's list (read as one array) to or from `flat`: `into`
  // copies the list into flat, else flat into the list. `at` only moves forward.
  void move_list(coalesced_cursor& at, std::size_t lo, std::size_t len, std::byte* flat, bool into) {
    for (std::size_t done = 0; done < len;) {
      auto const [p, run] = at.locate(lo + done);
      std::size_t const m = std::min(run, len - done);
      if (into) copy(flat + done * esz_, reinterpret_cast<std::byte*>(p), m * esz_);
      else copy(reinterpret_cast<std::byte*>(p), flat + done * esz_, m * esz_);
      done += m;
    }
  }

  // all_reduce_coalesced, small: the list into this rank's small slot; meet; the sums of every
  // slot written straight into the list, a run of one tensor at a time. Peers whose buffers are
  // in group memory are read there, and then the ranks meet once more (small_reduce).
  bool small_list() {
    coalesced_cursor in(list_, esz_), out(list_, esz_);
    move_list(in, 0, call_.count, small_slot(g_.rank()), true);
    if (!meet()) return false;
    find_peers();
    auto const source = [&](int j) {
      std::byte* const p = peers_[static_cast<std::size_t>(j)];
      return p != nullptr ? p : small_slot(j);
    };
    for (std::size_t lo = 0; lo < call_.count;) {
      auto const [p, run] = out.locate(lo);
      reduce_from(source, lo * esz_, {p}, run);
      lo += run;
    }
    bool const shared = std::any_of(peers_.begin(), peers_.end(), [](std::byte* q) { return q != nullptr; });
    return !shared || meet();
  }

  // all_reduce_coalesced, in chunks, as reduce_chunk: the chunk into this rank's slot but for its
  // own slice; meet; slice r of the sums, a run of one tensor at a time, from the list and the
  // peers' copies (or their buffers in group memory) into the result area, the list and the
  // peers' buffers in group memory; meet; the other slices out into the list. The same sums, in
  // rank order, as chunked(): the same bits, and it meets a peer's plain all_reduce.
  bool chunked_list() {
    int const r = g_.rank();
    int const n = g_.size();
    std::size_t const step = std::max<std::size_t>(1, g_.segment().layout().chunk / esz_);
    coalesced_cursor in(list_, esz_), own(list_, esz_), out(list_, esz_);
    for (std::size_t lo = 0; lo < call_.count; lo += step) {
      std::size_t const len = std::min(step, call_.count - lo);
      for_each_gap(len, [&](std::size_t a, std::size_t b) {
        move_list(in, lo + a, b - a, chunk_slot(r) + a * esz_, true);
      });
      if (!meet()) return false;
      if (lo == 0) find_peers();
      for_each_stripe(len, n, r, esz_, [&](std::size_t a, std::size_t b) {
        while (a < b) {
          auto const [p, run] = own.locate(lo + a);
          std::size_t const m = std::min(run, b - a);
          sum_run(lo, a, m, reinterpret_cast<std::byte*>(p));
          a += m;
        }
      });
      if (!meet()) return false;
      for_each_gap(len, [&](std::size_t a, std::size_t b) {
        move_list(out, lo + a, b - a, result() + a * esz_, false);
      });
    }
    return checked_ || meet();
  }

  shm_group& g_;
  std::span<tensor_ref const> list_;  // a *_coalesced call's tensors
  std::vector<void const*> srcs_;
  std::vector<void*> dsts_;
  std::vector<std::byte*> peers_;  // a reduction's buffers in group memory, by rank (find_peers)
  std::size_t direct_ = 0;         // offset of this rank's buffer in its group memory; 0: not there
  std::uint64_t seq_ = 0;
  comm_call call_{};
  std::chrono::milliseconds timeout_{};
  bool checked_ = false;
  std::byte* A_ = nullptr;
  std::byte* B_ = nullptr;
  std::size_t esz_ = 1;
};

}  // namespace detail
DPARALLEL_NAMESPACE_END

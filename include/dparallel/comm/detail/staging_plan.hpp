#pragma once
// Host staging of a device communicator's collective, planned without touching a device: which
// of the collective's two sides (`in`, `out`) is host memory and so goes through the
// communicator's device staging block, and where each staged side lives in that block. The NCCL
// communicator copies a staged `in` host -> pinned -> device before the call and a staged `out`
// device -> pinned -> host after it; a side in device memory is passed to NCCL as it is.
//
// In place on the host (an all_reduce's one buffer; an all_gather whose `in` is block rank() of
// `out`; a reduce_scatter whose `out` is block rank() of `in`), both sides are staged as ONE
// region covering the two, at the same relative offsets: the device pointers NCCL receives are
// in place too (e.g. sendbuff == recvbuff + rank * count for all_gather), and the staging block
// is as large as the larger side, never the smaller one.

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

DPARALLEL_NAMESPACE_BEGIN
namespace detail {

/// One side of a collective as the staging planner sees it.
struct staging_side {
  void const* data = nullptr;
  std::size_t bytes = 0;
  bool host = false;  // host memory (pageable or pinned), as opposed to device memory
};

/// Where the host sides of one collective live in the device staging block.
struct staging_plan {
  bool stage_in = false;       // `in` is copied host -> device before the call
  bool stage_out = false;      // `out` is copied device -> host after the call
  std::size_t bytes = 0;       // size of the staging block the collective needs
  std::size_t in_offset = 0;   // `in`'s place in the block (when stage_in)
  std::size_t out_offset = 0;  // `out`'s place in the block (when stage_out)
  [[nodiscard]] bool any() const noexcept { return stage_in || stage_out; }
};

/// Offsets of a separately staged second side are rounded up to this (NCCL and the copy
/// engines prefer aligned buffers; cudaMalloc's own alignment is at least 256 bytes).
inline constexpr std::size_t staging_alignment = 256;

/// Plans the staging of a collective reading `in` and writing `out` (see the top of this file).
/// Empty sides are never staged. Host sides that overlap must be one inside the other (in place);
/// anything else is an invalid_argument naming `what`.
inline staging_plan plan_staging(staging_side in, staging_side out, char const* what) {
  staging_plan p;
  p.stage_in = in.host && in.bytes != 0;
  p.stage_out = out.host && out.bytes != 0;
  if (p.stage_in && !p.stage_out) {
    p.bytes = in.bytes;
    return p;
  }
  if (p.stage_out && !p.stage_in) {
    p.bytes = out.bytes;
    return p;
  }
  if (!p.any()) return p;
  auto const a = reinterpret_cast<std::uintptr_t>(in.data);
  auto const b = reinterpret_cast<std::uintptr_t>(out.data);
  bool const overlap = a < b + out.bytes && b < a + in.bytes;
  if (!overlap) {
    p.in_offset = 0;
    p.out_offset = (in.bytes + staging_alignment - 1) / staging_alignment * staging_alignment;
    p.bytes = p.out_offset + out.bytes;
    return p;
  }
  bool const in_inside_out = a >= b && a + in.bytes <= b + out.bytes;
  bool const out_inside_in = b >= a && b + out.bytes <= a + in.bytes;
  require(in_inside_out || out_inside_in, [&] {
    return std::string(what) + ": the input (" + std::to_string(in.bytes) + " bytes) and the output (" +
           std::to_string(out.bytes) +
           " bytes) overlap partly; expected disjoint buffers or one inside the other (in place)";
  });
  std::uintptr_t const base = in_inside_out ? b : a;
  p.in_offset = static_cast<std::size_t>(a - base);
  p.out_offset = static_cast<std::size_t>(b - base);
  p.bytes = in_inside_out ? out.bytes : in.bytes;
  return p;
}

}  // namespace detail
DPARALLEL_NAMESPACE_END
